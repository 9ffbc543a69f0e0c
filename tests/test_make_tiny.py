"""make_tiny writes checkpoints that transformers loads, deterministically, at the stated sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvrelay.engine.config import ConfigError, ModelConfig
from kvrelay.engine.make_tiny import (
    ARCHS,
    SIZES,
    expected_param_count,
    make_tiny,
    param_count,
)

transformers = pytest.importorskip("transformers")

TARGET_PARAMS = {"tiny": 2_000_000, "small": 30_000_000, "medium": 120_000_000}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    return arch, make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, seed=3)


def test_transformers_loads_every_arch_without_missing_or_extra_weights(arch_dir) -> None:
    arch, path = arch_dir
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == ARCHS[arch]
    assert {key: value for key, value in info.items() if value} == {}
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings is (arch == "qwen2")
    assert sum(p.numel() for p in model.parameters()) == expected_param_count(arch, "tiny")
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, SIZES["tiny"].vocab_size)
    assert torch.isfinite(logits).all()


def test_safetensors_names_metadata_and_qwen2_biases(arch_dir) -> None:
    arch, path = arch_dir
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert ("lm_head.weight" in names) is (arch != "qwen2")
    assert ("model.layers.3.self_attn.k_proj.bias" in names) is (arch == "qwen2")
    assert not any("rotary" in n for n in names)
    assert abs(norm.mean().item() - 1.0) < 0.05 and norm.std().item() > 0.01
    assert abs(q.std().item() - 0.02) < 0.002
    assert param_count(path) == expected_param_count(arch, "tiny")


def test_config_json_matches_transformers_and_model_config(arch_dir) -> None:
    arch, path = arch_dir
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == [ARCHS[arch]] and raw["model_type"] == arch
    assert raw["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert raw["dtype"] == "float32"
    hf = transformers.AutoConfig.from_pretrained(path)
    assert hf.num_key_value_heads == 2 and hf.max_position_embeddings == 4096
    ours = ModelConfig.from_dir(path)
    assert ours.architecture == ARCHS[arch]
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (4, 4, 2, 32)
    assert ours.tie_word_embeddings is (arch == "qwen2")
    assert ours.attention_bias is (arch == "qwen2")
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (1, 3)


def test_tokenizer_files_load_in_transformers(tiny_model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == SIZES["tiny"].vocab_size
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.pad_token_id == 1
    assert tok.encode("hi")[0] == 0
    gen = transformers.GenerationConfig.from_pretrained(tiny_model_dir)
    assert gen.eos_token_id == [1, 3] and gen.bos_token_id == 0


def test_same_seed_gives_same_bytes_and_other_seed_other_weights(tmp_path: Path) -> None:
    first = make_tiny(tmp_path / "a", seed=11)
    second = make_tiny(tmp_path / "b", seed=11)
    other = make_tiny(tmp_path / "c", seed=12)
    for name in sorted(p.name for p in first.iterdir()):
        if name == "kvrelay-identity.json":  # records each file's (dev, inode, times) too
            continue
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    identity = json.loads((first / "kvrelay-identity.json").read_text())["identity"]
    assert json.loads((second / "kvrelay-identity.json").read_text())["identity"] == identity
    assert json.loads((other / "kvrelay-identity.json").read_text())["identity"] != identity
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_bfloat16_checkpoint_is_the_float32_one_rounded(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    path = make_tiny(tmp_path, dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    name = "model.layers.1.mlp.down_proj.weight"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        half = f.get_tensor(name)
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        full = f.get_tensor(name)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, full.to(torch.bfloat16))


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_param_counts_are_near_the_size_targets(arch: str, size: str) -> None:
    count = expected_param_count(arch, size)
    assert abs(count - TARGET_PARAMS[size]) <= 0.25 * TARGET_PARAMS[size], count


def test_small_size_writes_the_counted_params(tmp_path: Path) -> None:
    path = make_tiny(tmp_path, arch="qwen2", size="small")
    assert param_count(path) == expected_param_count("qwen2", "small") == 29_377_024
    assert len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]) == 8192


def test_exact_documented_tiny_counts() -> None:
    assert expected_param_count("llama", "tiny") == 1_901_696
    assert expected_param_count("mistral", "medium") == 107_760_384
    assert expected_param_count("qwen2", "medium") == 95_192_832


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "llama"),
        ({"size": "huge"}, "tiny"),
        ({"dtype": "int8"}, "bfloat16"),
    ],
)
def test_bad_arguments_name_the_choices(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_tiny(tmp_path, **kwargs)
    assert not (tmp_path / "config.json").exists()
