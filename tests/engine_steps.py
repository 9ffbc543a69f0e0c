"""Driving an ``LLMEngine`` step by step in tests."""

from __future__ import annotations

from kvrelay.engine.engine import LLMEngine
from kvrelay.protocol.sampling_params import SamplingParams


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Adds every prompt (greedy, ``max_tokens`` each, eos ignored), steps the engine until
    all finish, and returns each prompt's tokens in order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    return [tokens[f"r{n}"] for n in range(len(prompts))]
