"""Greedy parity with Hugging Face transformers for checkpoints written by save_pretrained.

Llama (with Llama-3 rope scaling), Qwen2 (qkv bias, tied embeddings) and Mistral (sliding
window smaller than the longest prompt); prompts of 3 to 300 tokens in one batch; the same
tokens with prefix caching on and off, with a tiny chunked-prefill budget, and with a block
pool small enough to force preemption. Last-position logits agree within 1e-4 (float32).
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvrelay import LLM, SamplingParams  # noqa: E402
from kvrelay.engine.engine import LLMEngine  # noqa: E402
from kvrelay.engine.scheduler import StepResult  # noqa: E402

PROMPT_LENS = (3, 17, 64, 150, 300, 33)
MAX_NEW = 12
VOCAB = 512


def _hf_config(arch: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.MistralConfig(**common, sliding_window=96)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def hf_checkpoint(request, tmp_path_factory):
    arch = request.param
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(arch), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    path = tmp_path_factory.mktemp(f"hf-{arch}")
    model.save_pretrained(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected, last_logits = [], []
    with torch.no_grad():
        for p in prompts:
            expected.append(_hf_greedy(model, p))
            last_logits.append(model(torch.tensor([p])).logits[0, -1].float())
    return path, prompts, expected, last_logits


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of ``prompt``: MAX_NEW tokens, eos ignored."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

ENGINE_VARIANTS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill-32": {"max_num_batched_tokens": 32},
    "tiny-pool-preemption": {"num_blocks": 22, "block_size": 16},
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_tokens_match_transformers(hf_checkpoint, variant):
    path, prompts, expected, _ = hf_checkpoint
    llm = LLM(path, skip_tokenizer_init=True, **ENGINE_VARIANTS[variant])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if variant == "tiny-pool-preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_leaked() == 0


def test_prefix_cache_hits_keep_tokens_identical(hf_checkpoint):
    path, prompts, expected, _ = hf_checkpoint
    llm = LLM(path, skip_tokenizer_init=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, GREEDY)
    again = llm.generate(batch, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    # every full block but the last token's is a hit on the second pass
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("variant", ["default", "chunked-prefill-32"])
def test_a_burst_sharing_a_prefix_computes_it_once_and_keeps_tokens_identical(
    hf_checkpoint, variant
):
    """Prompts that share a 100-token prefix, sent together into a fresh engine: the first
    computes the prefix and the others adopt its blocks within the same step (no cache
    hit was possible before it ran), and every greedy output is still transformers'."""
    path, prompts, _, _ = hf_checkpoint
    prefix = prompts[4][:100]
    burst = [prefix + tail for tail in (prompts[0], prompts[1][:9], prompts[5], [7])]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [_hf_greedy(model, p) for p in burst]
    llm = LLM(path, skip_tokenizer_init=True, warm_up=False, **ENGINE_VARIANTS[variant])
    outs = llm.generate([{"prompt_token_ids": p} for p in burst], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    assert [o.num_cached_tokens for o in outs] == [0, 96, 96, 96]  # 6 full blocks of 16
    assert bm.num_hit_tokens == 3 * 96
    bm.check_integrity()
    assert bm.num_leaked() == 0


@pytest.mark.parametrize("variant", ["default", "chunked-prefill-32"])
def test_last_position_logits_match(hf_checkpoint, variant):
    path, prompts, _, last_logits = hf_checkpoint
    engine = LLMEngine.from_args(path, skip_tokenizer_init=True, **ENGINE_VARIANTS[variant])
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=1))
    got: dict[str, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        assert plan is not None
        logits = engine.runner.compute_logits_for(plan)
        sampled = [item.seq.seq_id for item in plan.scheduled if item.needs_sample]
        got.update(zip(sampled, logits))
        fake = [[0] if item.needs_sample else [] for item in plan.scheduled]
        engine.scheduler.update(plan, _result(fake))
    for i, ref in enumerate(last_logits):
        torch.testing.assert_close(got[str(i)], ref, atol=1e-4, rtol=0)
    assert engine.block_manager.num_leaked() == 0


def _result(token_ids):
    return StepResult(token_ids, [[None] * len(t) for t in token_ids])
