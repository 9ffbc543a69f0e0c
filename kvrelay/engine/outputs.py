"""What the engine hands back after a step: one ``RequestOutput`` per request that made
progress (a generation's new tokens and text, or an embedding request's vector)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.engine.sequence import Sequence
from kvrelay.protocol.sampling_params import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step; ``new_*`` hold only this step's part."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # params.prompt_logprobs set: one per prompt token (None for the first), from the
    # process that computed the prompt (a decode worker's import has none)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # an embedding request (``add_request(pooling=...)``), once finished: float32 ``[dims]``
    embedding: torch.Tensor | None = None


def pooled_output(seq: Sequence) -> RequestOutput:
    """The one output of an embedding request: finished, its vector, no tokens."""
    return RequestOutput(
        request_id=seq.seq_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=[],
        new_token_ids=[],
        text="",
        new_text="",
        finished=True,
        finish_reason=seq.finish_reason,
        num_cached_tokens=seq.num_cached_tokens,
        cached_tokens_by_tier=seq.cached_tokens_by_tier,
        embedding=None if seq.pool is None else seq.pool.embedding,
    )
