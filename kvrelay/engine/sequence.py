"""One request's state as the engine sees it.

A sequence's tokens are ``prompt + output``. ``num_computed_tokens`` of them have KV in the
cache (in ``block_ids``); the next step computes ``num_tokens - num_computed_tokens`` more
(the whole remaining prompt, chunked, or the one newest token while decoding)::

    token_ids:   [ p0 p1 ... p(P-1) | o0 o1 ... ]
                 |<-- computed -->|<-- to compute -->|
    block_ids:   one id per block_size tokens of capacity, allocated ahead of compute
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvrelay.cachetier.block_hash import BlockHash

if TYPE_CHECKING:
    from kvrelay.protocol.sampling_params import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    RUNNING = "running"  # holds blocks; scheduled every step
    FINISHED_STOPPED = "stop"  # eos, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context window
    FINISHED_ABORTED = "abort"  # cancelled by the client or the system


FINISHED_STATES = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
    }
)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # device / host / redis
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, in order
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # params.prompt_logprobs set: entry i is prompt token i's (None for the first), filled as
    # the prompt's chunks are computed (``ModelRunner``)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: int | str | None = None
    generator: Any = None  # torch.Generator for seeded sampling; owned by the runner side
    matcher: Any = None  # xgrammar GrammarMatcher; has accepted exactly the output tokens
    arrival_index: int = 0  # its place in its scheduler's arrival order (set when added)
    lora: Any = None  # engine.lora.LoRAAdapter of params.lora_name, set by the engine
    spec_history: Any = None  # engine.spec_decode.TokenHistory, made by the first draft
    pool: Any = None  # engine.pooling.PoolState: an embedding request (computes its prompt only)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATES

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    @property
    def needs_every_prompt_token(self) -> bool:
        """Whether each prompt token's state is read (prompt logprobs, or an embedding that
        pools more than the last token): no cached prefix may skip computing one."""
        if self.params.prompt_logprobs is not None:
            return True
        return self.pool is not None and self.pool.pooling_type != "LAST"

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is left to compute (the prompt, or a recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1
