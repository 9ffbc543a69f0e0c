"""Embeddings in the engine (``engine.pooling``, ``LLM.embed``) against transformers.

Every pooling type (last token, mean, first) on Llama and Qwen2 checkpoints, chunked under a
small step budget and batched beside generation requests; ``dimensions`` and ``use_activation``;
a prefix-cache hit (last-token pooling may use one, mean pooling may not); a preempted mean
pooling that computes its first chunk again; an embedding checkpoint saved from the bare
decoder (``LlamaModel``: no ``model.`` prefix, no LM head) with a sentence-transformers
pooling config; and the refusals (``dimensions`` too large, a prompt over the context, text
generation on a model without a head). Values agree within 1e-5 (float32).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvrelay import LLM, PoolingParams, SamplingParams  # noqa: E402
from kvrelay.engine.admission import RequestError  # noqa: E402
from kvrelay.engine.config import ConfigError  # noqa: E402
from kvrelay.engine.engine import LLMEngine  # noqa: E402
from kvrelay.engine.make_tiny import make_tiny  # noqa: E402
from kvrelay.protocol.pooling import PoolerConfig, PoolingConfigError  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (1, 5, 16, 37, 90)] + [[7, 9, 11, 13] * 20]
TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny")


def _hf_states(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' ``last_hidden_state`` (after the final norm) of each prompt."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def _pooled(states: torch.Tensor, kind: str) -> torch.Tensor:
    return {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind]


def _llm(model_dir: Path, **kwargs) -> LLM:
    args = dict(max_model_len=256, num_blocks=96, block_size=16, max_num_batched_tokens=48)
    return LLM(model_dir, warm_up=False, **{**args, **kwargs})


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_every_pooling_type_matches_transformers(checkpoint: Path, kind: str) -> None:
    llm = _llm(checkpoint, pooler_config={"pooling_type": kind})
    outs = llm.embed(PROMPTS)
    for prompt, out, states in zip(PROMPTS, outs, _hf_states(checkpoint, PROMPTS), strict=True):
        want = torch.nn.functional.normalize(_pooled(states, kind), dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert out.prompt_token_ids == prompt
        assert torch.allclose(got, want, atol=TOL), (kind, len(prompt), (got - want).abs().max())
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_dimensions_and_use_activation(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    (states,) = _hf_states(checkpoint, PROMPTS[3:4])
    raw, cut = llm.embed(
        [PROMPTS[3]] * 2, [PoolingParams(use_activation=False), PoolingParams(dimensions=24)]
    )
    assert torch.allclose(torch.tensor(raw.outputs.embedding), states[-1], atol=TOL)
    assert len(cut.outputs.embedding) == 24  # Matryoshka: the first 24, then normalized
    want = torch.nn.functional.normalize(states[-1][:24], dim=0)
    assert torch.allclose(torch.tensor(cut.outputs.embedding), want, atol=TOL)


def test_embeddings_batched_with_generation_keep_both_exact(checkpoint: Path) -> None:
    """Embedding prompts share steps (and chunked prefill) with generating sequences: each
    gets what it gets alone."""
    alone = _llm(checkpoint)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want_tokens = [o.outputs[0].token_ids for o in alone.generate(PROMPTS[2:5], greedy)]
    want_vectors = [o.outputs.embedding for o in alone.embed(PROMPTS)]

    llm = _llm(checkpoint, enable_prefix_caching=False)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[2:5]):
        engine.add_request(f"gen-{i}", prompt, greedy)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"emb-{i}", prompt, SamplingParams(), pooling=PoolingParams())
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, list[float]] = {}
    kinds = set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        kinds.add(engine.last_step_kind)
        for out in outs:
            if out.request_id.startswith("emb"):
                assert out.finished and out.new_token_ids == [] and out.embedding is not None
                vectors[out.request_id] = out.embedding.tolist()
            elif out.finished:
                tokens[out.request_id] = out.token_ids
    assert "mixed" in kinds  # embedding chunks ran in steps with decode tokens
    assert [tokens[f"gen-{i}"] for i in range(3)] == want_tokens
    for i, want in enumerate(want_vectors):
        assert torch.allclose(torch.tensor(vectors[f"emb-{i}"]), torch.tensor(want), atol=TOL)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every request gave its blocks back


def test_last_token_pooling_reuses_the_prefix_cache_and_mean_does_not(checkpoint: Path) -> None:
    prompt = PROMPTS[4]
    last = _llm(checkpoint)
    first, again = last.embed([prompt]), last.embed([prompt])
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == 80  # 5 full blocks of 90 tokens (the last token runs)
    assert first[0].outputs.embedding == again[0].outputs.embedding
    mean = _llm(checkpoint, pooler_config={"pooling_type": "MEAN"})
    mean.embed([prompt])
    assert mean.embed([prompt])[0].num_cached_tokens == 0  # every token's state is pooled
    # the blocks an embedding computed serve a later generation of the same prompt
    out = last.generate([[*prompt, 5]], SamplingParams(max_tokens=1))[0]
    assert out.num_cached_tokens == 80


def test_preempted_mean_pooling_counts_each_token_once(checkpoint: Path) -> None:
    """A mean-pooled prompt preempted after its first chunk computes that chunk again; the
    state it pooled stays, and the chunk is not added twice."""
    prompt = PROMPTS[4]  # 90 tokens: two chunks of 48
    (states,) = _hf_states(checkpoint, [prompt])
    llm = _llm(checkpoint, pooler_config={"pooling_type": "MEAN"})
    engine = llm.engine
    engine.add_request("emb", prompt, SamplingParams(), pooling=PoolingParams())
    assert engine.step() == []
    seq = engine.scheduler.get("emb")
    assert seq is not None and seq.num_computed_tokens == 48 and seq.pool.counted == 48
    assert engine.scheduler._preempt_last() == "emb"  # as when blocks run out
    assert seq.num_computed_tokens == 0 and not seq.block_ids
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and seq.pool.counted == 90
    want = torch.nn.functional.normalize(states.mean(0), dim=0)
    assert torch.allclose(outs[0].embedding, want, atol=TOL)


def test_refusals(checkpoint: Path) -> None:
    llm = _llm(checkpoint, max_model_len=64)
    with pytest.raises(RequestError, match="'dimensions' is 4096") as info:
        llm.embed([[5, 6]], PoolingParams(dimensions=4096))
    assert info.value.param == "dimensions"
    with pytest.raises(RequestError, match="65 tokens"):
        llm.embed([list(range(3, 68))])
    assert len(llm.embed([list(range(3, 67))])[0].outputs.embedding) > 0  # the whole window
    with pytest.raises(PoolingConfigError, match="'dimensions' must be an integer >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ConfigError, match="pooling_type must be one of LAST, MEAN, CLS"):
        _llm(checkpoint, pooler_config={"pooling_type": "max"})
    with pytest.raises(ConfigError, match="unsupported key"):
        _llm(checkpoint, pooler_config={"activation": True})


def test_pooler_config_parses_vllm_json() -> None:
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig(
        "MEAN", False
    )
    assert PoolerConfig.from_dict({"use_activation": False}) == PoolerConfig("LAST", False)
    with pytest.raises(PoolingConfigError, match="not JSON"):
        PoolerConfig.parse("{mean")


@pytest.fixture(scope="module")
def embedding_checkpoint(tmp_path_factory) -> Path:
    """A ``LlamaModel`` saved by transformers (no head, names without ``model.``), with a
    sentence-transformers mean-pooling and Normalize modules.json."""
    out = tmp_path_factory.mktemp("e5-like")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(7)
    transformers.LlamaModel(config).save_pretrained(out)
    st = "sentence_transformers.models."
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (out / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": st + kind}
        for i, (path, kind) in enumerate(modules)
    ]))  # fmt: skip
    (out / "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
             "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}  # fmt: skip
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **modes})
    )
    return out


def test_an_embedding_checkpoint_pools_as_its_modules_say(
    embedding_checkpoint: Path, tiny_model_dir: Path
) -> None:
    ckpt = embedding_checkpoint
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaModel"]
    assert PoolerConfig.from_model_dir(ckpt) == PoolerConfig("MEAN", True)
    llm = LLM(ckpt, skip_tokenizer_init=True, max_model_len=256, num_blocks=64)  # warms up too
    assert "lm_head" not in llm.engine.runner.model.weights
    outs = llm.embed(PROMPTS[:4])
    for out, states in zip(outs, _hf_states(ckpt, PROMPTS[:4]), strict=True):
        want = torch.nn.functional.normalize(states.mean(0), dim=0)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=TOL)
    with pytest.raises(RequestError, match="has no LM head") as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert info.value.param == "model"
    # a Pooling module kvrelay cannot follow is named, not guessed
    bad = ckpt.parent / "max-pooled"
    shutil.copytree(ckpt, bad)
    st = json.loads((bad / "1_Pooling" / "config.json").read_text())
    st.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (bad / "1_Pooling" / "config.json").write_text(json.dumps(st))
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        LLMEngine.from_args(bad, skip_tokenizer_init=True, num_blocks=8)
    # a generative checkpoint without modules.json: the last token, normalized
    assert PoolerConfig.from_model_dir(tiny_model_dir) is None
