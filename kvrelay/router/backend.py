"""The boundary between the router's HTTP layer and whatever generates tokens.

The HTTP layer validates and tokenizes a request, then calls ``Backend.generate`` once per
choice (``n`` fans out above this line) and formats the deltas it yields. The cluster
backend (``router/cluster.py``) places the request on workers; tests may also plug in a
backend over an in-process engine. Nothing here imports torch.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from kvrelay.protocol.pooling import PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams, TokenLogprobs


class BackendError(RuntimeError):
    """A request the backend cannot take now; the HTTP layer maps it to a status code."""

    status_code = 503
    retry_after: float | None = None

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(BackendError):
    """Queues are full: 429 with Retry-After."""

    status_code = 429


class Unavailable(BackendError):
    """No capacity now (no instance is ready, or a request waited ``max_queue_time`` for a
    slot): 503 with Retry-After."""

    status_code = 503


class GenerationFailed(BackendError):
    """Generation broke off and could not be resumed (every worker that could run it died)."""

    status_code = 500


class InvalidRequest(BackendError):
    """A worker refused the request as invalid (a grammar that does not compile): 400."""

    status_code = 400

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1; stop strings are applied by the backend
    pooling: PoolingParams | None = None  # an embedding request: one delta, its vector


@dataclass(slots=True)
class Delta:
    """What one choice gained since the last delta."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None  # one per token when params.logprobs is set
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a cache (set on the first delta)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # on the first delta when params.prompt_logprobs is set: one per prompt token (None first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: bytes | None = None  # GenerateInput.pooling: float32 little-endian, finished


class Backend(abc.ABC):
    """Generates tokens for validated, tokenized requests.

    ``generate`` is an async generator: it yields deltas until one with ``finished=True``.
    Closing it early (``aclose()``, or cancelling the task that iterates it — a client
    disconnect) aborts the request everywhere and frees its KV blocks before returning.
    It raises a ``BackendError`` subclass before the first delta when the request cannot be
    admitted, and ``GenerationFailed`` if it breaks off later.
    """

    model_name: str
    max_model_len: int

    @abc.abstractmethod
    def generate(self, request: GenerateInput) -> AsyncIterator[Delta]: ...

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True when a request sent now can be served."""

    def lora_adapters(self) -> Sequence[str]:
        """The names of the LoRA adapters it serves beside the base model (requests name
        one as their ``model``); none unless a backend says otherwise."""
        return ()
