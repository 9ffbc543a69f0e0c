"""LoRA adapters in the engine: logits against ``peft``'s, mixed batches, KV isolation,
refused adapters (``engine/lora.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay import LLM, LoRARequest, SamplingParams
from kvrelay.cachetier.block_hash import HASH_BYTES, chain_seed
from kvrelay.engine.admission import RequestError
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.lora import LoRAError, adapter_identity, load_adapter
from kvrelay.protocol.lora_modules import parse_lora_modules
from tests.lora_adapters import base_logits, make_adapter, peft_logits

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [40, 41, 2, 77, 3],
    list(range(100, 140)),  # more than two 16-token blocks
]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_adapter(tiny_model_dir, root / "all", seed=1),
        # attention only, ranks per module, rsLoRA's scale
        "attn": make_adapter(
            tiny_model_dir,
            root / "attn",
            targets=("q_proj", "v_proj"),
            r=4,
            alpha=8,
            seed=2,
            use_rslora=True,
            rank_pattern={"v_proj": 2},
        ),
    }


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, adapters: dict[str, Path]) -> LLM:
    return LLM(tiny_model_dir, lora_modules=tuple((n, str(p)) for n, p in adapters.items()))


def _first_logprobs(out) -> dict[int, float]:
    first = out.outputs[0].logprobs[0]
    return dict(first.top)


def _reference(model_dir: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    if adapter is None:
        return torch.log_softmax(base_logits(model_dir, ids), -1)
    return torch.log_softmax(peft_logits(model_dir, adapter, ids), -1)


def test_a_mixed_batch_matches_peft_row_by_row(llm, tiny_model_dir, adapters) -> None:
    """Base rows, and rows of two adapters, in the same steps; each as peft (or the base)
    computes it alone."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    names = [None, "all", "attn"]
    prompts, loras = [], []
    for ids in PROMPTS:
        for name in names:
            prompts.append(ids)
            loras.append(None if name is None else LoRARequest(name, 1, str(adapters[name])))
    outs = llm.generate(prompts, params, lora_request=loras)
    moved = 0
    for out, ids, lora in zip(outs, prompts, loras):
        adapter = None if lora is None else adapters[lora.lora_name]
        ref = _reference(tiny_model_dir, adapter, ids)
        got = _first_logprobs(out)
        for token, logprob in got.items():
            assert logprob == pytest.approx(ref[token].item(), abs=2e-4)
        assert out.outputs[0].token_ids[0] == int(ref.argmax())
        if lora is not None:
            base = _reference(tiny_model_dir, None, ids)
            moved += int((ref - base).abs().max() > 0.05)
    assert moved == 2 * len(PROMPTS)  # the adapters do change the model


def test_greedy_decode_matches_peft(llm, tiny_model_dir, adapters) -> None:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapters["all"]).eval()
    ids = PROMPTS[0]
    with torch.no_grad():
        want = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate([ids], params, lora_request=LoRARequest("all"))[0].outputs[0].token_ids
    base_out = llm.generate([ids], params)[0].outputs[0].token_ids
    assert got == want
    assert got != base_out


def test_prefix_cache_is_never_shared_across_adapters(llm) -> None:
    ids = list(range(300, 352))  # three full blocks and some
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([ids], params)[0]
    assert first.num_cached_tokens == 0
    for name in ("all", "attn"):
        out = llm.generate([ids], params, lora_request=LoRARequest(name))[0]
        assert out.num_cached_tokens == 0, name  # the base's (or another adapter's) KV
        again = llm.generate([ids], params, lora_request=LoRARequest(name))[0]
        assert again.num_cached_tokens == 48, name  # its own
    assert llm.generate([ids], params)[0].num_cached_tokens == 48


def test_an_unknown_adapter_is_refused_naming_it(llm) -> None:
    with pytest.raises(RequestError, match="'nope' is not loaded here") as err:
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(lora_name="nope"))
    assert err.value.param == "model"
    assert not llm.engine.has_unfinished_requests()


def test_a_name_is_not_reused_for_another_adapter(llm, adapters) -> None:
    with pytest.raises(LoRAError, match="already loaded"):
        llm.engine.add_lora("all", str(adapters["attn"]))
    assert llm.engine.add_lora("all", str(adapters["all"])) is llm.engine.loras["all"]


def test_chain_seed_keeps_adapters_salts_and_the_base_apart() -> None:
    fp, adapter = b"f" * 16, b"a" * HASH_BYTES
    seeds = {
        chain_seed(fp, None),
        chain_seed(fp, "s"),
        chain_seed(fp, None, adapter),
        chain_seed(fp, "s", adapter),
        chain_seed(fp, None, b"b" * HASH_BYTES),
    }
    assert len(seeds) == 5
    assert chain_seed(fp, None) == fp  # no adapter, no salt: the keys of before adapters
    with pytest.raises(ValueError):
        chain_seed(fp, None, b"short")


def test_identity_follows_the_files(adapters, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(adapters["all"], copy)
    assert adapter_identity(copy) == adapter_identity(adapters["all"])
    tensors = load_file(copy / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key] = tensors[key] + 1
    save_file(tensors, copy / "adapter_model.safetensors")
    assert adapter_identity(copy) != adapter_identity(adapters["all"])


def _edited(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "trained biases"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"r": 0}, "r must be a positive number"),
    ],
)
def test_adapters_it_cannot_serve_are_refused(
    adapters, tiny_model_dir, tmp_path, config, message
) -> None:
    path = _edited(adapters["all"], tmp_path / "a", **config)
    with pytest.raises(LoRAError, match=message):
        load_adapter("a", path, ModelConfig.from_dir(tiny_model_dir))


def test_malformed_adapter_files_are_refused(adapters, tiny_model_dir, tmp_path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    with pytest.raises(LoRAError, match="not found"):
        load_adapter("a", tmp_path / "missing", config)
    pickled = tmp_path / "pickled"
    shutil.copytree(adapters["all"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(LoRAError, match="pickle"):
        load_adapter("a", pickled, config)
    # an embedding matrix among the LoRA ones
    extra = tmp_path / "extra"
    shutil.copytree(adapters["all"], extra)
    tensors = load_file(extra / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(8, 4)
    save_file(tensors, extra / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="embed_tokens"):
        load_adapter("a", extra, config)
    # a matrix of the wrong width (an adapter trained for another model)
    wide = tmp_path / "wide"
    shutil.copytree(adapters["all"], wide)
    tensors = load_file(wide / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(8, config.hidden_size + 1)
    save_file(tensors, wide / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="do not fit this model"):
        load_adapter("a", wide, config)


def test_lora_modules_parse() -> None:
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == (("a", "/x"), ("b", "/y=z"))
    for bad in (["a"], ["=/x"], ["a="], ["a=/x", "a=/y"], [" a=/x"]):
        with pytest.raises(ValueError):
            parse_lora_modules(bad)


def test_bfloat16_rows_stay_close_to_peft(tiny_model_dir, adapters) -> None:
    llm = LLM(tiny_model_dir, dtype="bfloat16", lora_modules=(("all", str(adapters["all"])),))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    ids = PROMPTS[2]
    out = llm.generate([ids, ids], params, lora_request=[LoRARequest("all"), None])
    ref = _reference(tiny_model_dir, adapters["all"], ids)
    base = _reference(tiny_model_dir, None, ids)
    for token, logprob in _first_logprobs(out[0]).items():
        assert logprob == pytest.approx(ref[token].item(), abs=0.1)
    for token, logprob in _first_logprobs(out[1]).items():
        assert logprob == pytest.approx(base[token].item(), abs=0.1)


def test_kvrelay_generate_runs_through_a_named_adapter(llm, tiny_model_dir, adapters) -> None:
    import subprocess
    import sys

    base = [sys.executable, "-m", "kvrelay", "generate", "--model", str(tiny_model_dir),
            "--lora-modules", f"all={adapters['all']}", "--max-tokens", "6", "--ignore-eos",
            "--json"]  # fmt: skip
    proc = subprocess.run([*base, "--lora", "all", "Hello"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate("Hello", params, lora_request=LoRARequest("all"))[0].outputs[0]
    assert json.loads(proc.stdout)["token_ids"] == want.token_ids
    proc = subprocess.run([*base, "--lora", "none", "Hello"], capture_output=True, text=True)
    assert proc.returncode != 0 and "'none' is not among --lora-modules" in proc.stderr
