"""Control-plane messages and their one codec (msgpack).

Sockets (ZMQ; every address is chosen at start, none is hard-coded):
- the router binds one ROUTER socket; every worker connects a DEALER whose identity is its
  instance id plus a per-process nonce (the connection the router binds the instance to),
  and sends ``Register`` then a ``LoadReport`` every heartbeat;
- every worker binds one ROUTER "peer" socket for the KV handoff with other workers;
- every one of these sockets is CURVE-secured with the cluster key (``transport/curve.py``).

Request path (disaggregated)::

    router --GenerateRequest(decode=D)--> prefill P
    P --TokenEvent(first token)--> router          (TTFT does not wait for the transfer)
    P --KvReady(blocks, checksum, lease)--> D      (P holds the blocks under the lease)
    D pulls the blocks through transport/ when it has room, verifies, then
    D --KvAck(ok)--> P                              (P releases; a NACK too)
    D --TokenEvent(...)--> router                   (every later token, then finished)

A worker sends one engine step's events for a router as one ``TokenEvents`` (a lone event as
a plain ``TokenEvent``) once that router's ``RegisterAck`` said it takes them; an older router
(whose acks lack the field) gets every event alone, as before.

With several routers every worker registers with each. ``RegisterAck.router_id`` tells a
worker which link leads to which router; a request carries its router's id (``origin``)
from ``GenerateRequest`` through ``KvReady``, and each worker sends the request's events
to that router only (to every router when the origin is unknown: an older sender).
    router --Abort--> P and D                       (client gone, stop string, re-run)
    router --RegisterAck--> worker                  (answers every LoadReport: "alive")

Colocated workers get ``GenerateRequest(decode=None)`` and stream every token themselves.
An embedding request (``GenerateRequest.pooling``) always comes with ``decode=None``: the
worker computes the prompt and answers with one finished ``TokenEvent`` holding the vector.

Every message is a frozen dataclass registered here; the codec packs each as a msgpack
extension ``[tag, field values...]``, recursively, so nested values keep their types.

Versions mix during a rolling upgrade, in either order: a field is only ever added last, with
a default; a message from an older process lacks the trailing fields and decodes with their
defaults, and one from a newer process has trailing fields this one does not know, which
it ignores (as protobuf does with unknown fields). A change an older peer must not get wrong
by ignoring a field takes a new type or a version it checks (``KV_HANDOFF_VERSION``); for
``SamplingParams``, whose every later field changes the output, a worker lists the fields it
knows (``Register.sampling_fields``) and the router sends it no request that sets another.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, TypeVar

import msgpack

from kvrelay.protocol import sampling_params
from kvrelay.protocol.errors import ProtocolError
from kvrelay.protocol.pooling import PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams, StructuredOutput

_EXT_CODE = 1

CacheTier = Literal["device", "host"]  # the tiers whose contents placement tracks


class Role(str, enum.Enum):
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclasses.dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of a KV pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def compatible(self, other: KvLayout) -> bool:
        """Same per-block layout (the block count may differ between pools)."""
        return dataclasses.replace(other, num_blocks=self.num_blocks) == self


KV_HANDOFF_VERSION = 2
"""The KV hand-off's definition (checksum and framing), which prefill and decode must share:
1 = xxh3-64 slab digests (older processes, which send no version); 2 = XXH64 slab digests
(``transport/checksum.py``). A pull between different versions is refused before any copy."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerInfo:
    """What another instance needs to reach this one."""

    instance_id: str
    role: Role
    host_id: str  # equal host ids: shared memory is reachable
    peer_addr: str  # ZMQ address of this instance's peer ROUTER socket
    status_url: str  # http://host:port of /health, /ready, /metrics
    kv_segment: str | None  # shared-memory name of the KV pool (None: not shared)
    layout: KvLayout
    fingerprint: bytes  # model identity (identity.model_identity): pairs and KV keys
    transport: str = "auto"  # the transport this instance asks for: auto | shm | tcp | cuda_ipc
    kv_version: int = KV_HANDOFF_VERSION  # the sender's; absent (an older process): 1


@dataclasses.dataclass(frozen=True, slots=True)
class Register:
    info: PeerInfo
    model_name: str
    max_model_len: int
    pid: int
    # the SamplingParams fields it knows (it would drop later ones): the router sends it no
    # request that sets another; absent (an older worker): sampling_params.BASE_FIELDS
    sampling_fields: tuple[str, ...] = sampling_params.FIELDS
    # its LoRA adapters, name -> identity (engine.lora.adapter_identity): the router sends a
    # request naming an adapter only to workers whose adapter of that name is the same files
    lora_adapters: dict[str, bytes] | None = None
    # the width of its embeddings (``GenerateRequest.pooling``); 0: it cannot pool (an older
    # worker): the router sends it no embedding request
    embedding_size: int = 0
    # how far it lowered its CPU priority (``--cpu-nice``, 0-19): it yields the cores to
    # others on its host, so its heartbeats may come late while they keep them busy; the
    # router gives it ``LOWERED_SILENCE_FACTOR`` x ``--dead-after`` before calling it dead
    cpu_nice: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RegisterAck:
    """Router -> worker: ``known`` after a Register; ``known=False`` asks it to register
    again (a router that restarted gets heartbeats from instances it never saw)."""

    instance_id: str
    known: bool
    router_id: str = ""  # the router's id, as requests carry it in ``origin``
    token_batches: bool = False  # it takes ``TokenEvents`` (an older router drops them)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport:
    """Worker -> every router, every heartbeat: what placement and the autoscaler read.
    A message from an older worker lacks the trailing fields and decodes with their defaults."""

    instance_id: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_pending_kv: int = 0  # handoffs waiting for room (decode) or for an ack (prefill)
    num_leaked_blocks: int = 0  # blocks held by nothing the worker knows about (tests)
    draining: bool = False
    # prompt tokens still to compute: the rest of running prompts, and waiting prompts less
    # their device-cached prefix (placement's queue, in prefill work; 0 from older workers)
    num_prefill_tokens: int = 0
    # per router id: the ``seq`` of the last GenerateRequest taken in from it when this
    # report was made: the router's requests up to it are in this report's numbers, later
    # ones are not yet (None: an older worker)
    last_taken: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class CacheEvent:
    """Cache changes one instance made, in one tier (the feed of the router's prefix index).

    ``tier="device"``: the instance's own KV pool; the full set once on registration
    (``reset``), deltas after. ``tier="host"``: the L1 pool of host ``host_id``, shared by
    every instance there; deltas only (the keys this instance wrote and the ones its writes
    evicted; another writer reports its own), never a full set: an L1 pool can hold 256 MiB
    and more, so a router learns a host's L1 from the events after it started. Both are
    hints: an index that is briefly stale costs a cache miss, never a wrong block. A message
    from an older worker lacks the last two fields and decodes as a device event.
    """

    instance_id: str
    stored: list[bytes]  # block hashes newly cached
    evicted: list[bytes]  # block hashes dropped
    reset: bool = False  # ``stored`` is the whole cache; forget what was known before
    tier: CacheTier = "device"
    host_id: str = ""  # tier "host": the host whose L1 pool changed (PeerInfo.host_id)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = dataclasses.field(default_factory=list)  # already streamed
    decode: PeerInfo | None = None  # where the KV goes; None: generate here (colocated)
    origin: str = ""  # id of the router that sent it ("": unknown, answer every router)
    attempt: int = 0  # the router's re-run count of this request (its events carry it back)
    seq: int = 0  # the router's count of requests sent, this one's (LoadReport.last_taken)
    # set: an embedding request: the prompt is computed and pooled, nothing is sampled, and
    # the one finished TokenEvent carries the vector (always run here: ``decode`` is None)
    pooling: PoolingParams | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    instance_id: str
    token_ids: list[int]
    offset: int  # output tokens before these (events from prefill and decode may cross)
    logprobs: list[Any] | None = None  # per token: [token_id, logprob, rank, [[id, lp], ...]]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    handed_off_to: str | None = None  # prefill: the decode instance that continues
    error: str | None = None  # the worker could not run the request
    attempt: int = 0  # GenerateRequest.attempt of the run that made these tokens
    error_param: str | None = None  # set when ``error`` is the request's fault: its bad field
    # with the first token, when params.prompt_logprobs is set: per prompt token, as logprobs
    # (None for the first); from the worker that computed the prompt
    prompt_logprobs: list[Any] | None = None
    # GenerateRequest.pooling set: the embedding, float32 little-endian (the finished event)
    embedding: bytes | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenEvents:
    """One engine step's token events for one router, as one message (a step of n sequences
    was n messages: each its own send, receive and event-loop wake-up at the router)."""

    events: list[TokenEvent]

    def __post_init__(self) -> None:
        if not isinstance(self.events, list) or not all(
            isinstance(e, TokenEvent) for e in self.events
        ):
            raise TypeError("events must be a list of TokenEvent")


@dataclasses.dataclass(frozen=True, slots=True)
class KvReady:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    src: PeerInfo
    block_ids: list[int]  # prefill's blocks covering the prompt's tokens, in order
    num_tokens: int  # tokens whose KV the blocks hold
    checksum: int
    lease_deadline: float  # wall-clock time after which prefill may reuse the blocks
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    origin: str = ""  # the request's router (GenerateRequest.origin)
    attempt: int = 0  # GenerateRequest.attempt


@dataclasses.dataclass(frozen=True, slots=True)
class KvPull:
    """Decode asks prefill to send a request's blocks (tcp transport)."""

    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class KvData:
    """Header of a tcp transfer; the blocks follow as raw frames, one per layer and K/V."""

    request_id: str
    ok: bool
    reason: str = ""
    num_frames: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class KvAck:
    request_id: str
    ok: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request; with ``attempt``, only that attempt or an older one (a re-run that
    landed on the same instance again is kept)."""

    request_id: str
    attempt: int | None = None  # None: whatever attempt runs
    superseded: bool = False  # the router re-ran the request elsewhere (the worker counts it)


@dataclasses.dataclass(frozen=True, slots=True)
class Drain:
    """Stop taking new requests; finish the ones in flight."""

    instance_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Undrain:
    """Take new requests again (the autoscaler drained it, and the platform removed another)."""

    instance_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAUpdate:
    """Router -> worker: load the LoRA adapter in ``path`` (on the worker's host) as ``name``,
    or, with ``unload``, drop ``name`` (its running requests finish on it). The worker
    answers every router with a ``LoRAState``."""

    name: str
    path: str = ""
    unload: bool = False
    request_id: str = ""  # echoed in the LoRAState (the router's pending call)


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAState:
    """Worker -> every router, after a ``LoRAUpdate``: its LoRA adapters now (name ->
    identity, as ``Register.lora_adapters``), and why the update failed ("" when it did not)."""

    instance_id: str
    lora_adapters: dict[str, bytes]
    request_id: str = ""
    error: str = ""


# the most a process that leaves waits for its ``Leaving`` / ``RouterLeaving`` to go out: a
# live peer's connection takes it in well under a millisecond; to one already gone the whole
# wait is spent (that peer then learns it from the silence)
LEAVING_LINGER_MS = 200


@dataclasses.dataclass(frozen=True, slots=True)
class Leaving:
    """Worker -> every router, as it exits: take it out of placement now instead of after
    ``dead_after`` seconds of silence; a request it still had is re-run elsewhere, as for a
    dead instance (an older router logs the message as unexpected and waits the seconds)."""

    instance_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class RouterLeaving:
    """Router -> every instance it knows, as it exits: the requests it sent are orphans now
    (the worker aborts them at once instead of after ``router_timeout`` of silence), and the
    worker's own ``Leaving`` skips this router's link. Any later message on that link (a
    router restarted at the same address) makes it live again."""

    router_id: str


WIRE_TYPES: tuple[type, ...] = (
    KvLayout,
    PeerInfo,
    Register,
    RegisterAck,
    LoadReport,
    CacheEvent,
    GenerateRequest,
    TokenEvent,
    KvReady,
    KvPull,
    KvData,
    KvAck,
    Abort,
    Drain,
    Shutdown,
    SamplingParams,
    Undrain,  # new types go last: the tags of the others stay what older processes send
    StructuredOutput,
    TokenEvents,
    LoRAUpdate,
    LoRAState,
    PoolingParams,
    Leaving,
    RouterLeaving,
)
_TAG = {cls: i for i, cls in enumerate(WIRE_TYPES)}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in WIRE_TYPES}
# Fields without a default: a message from an older process may lack the trailing others.
_NUM_REQUIRED = {
    cls: sum(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )
    for cls in WIRE_TYPES
}

# Where a field absent from an older process's message means something else than its default.
_ABSENT: dict[type, dict[str, Any]] = {
    PeerInfo: {"kv_version": 1},
    Register: {"sampling_fields": tuple(sorted(sampling_params.BASE_FIELDS))},
}

T = TypeVar("T")


def _default(obj: Any) -> Any:
    tag = _TAG.get(type(obj))
    if tag is not None:
        values = [getattr(obj, name) for name in _FIELDS[type(obj)]]
        return msgpack.ExtType(_EXT_CODE, msgpack.packb([tag, *values], default=_default))
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_CODE:
        raise ProtocolError(f"unknown msgpack extension {code}")
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    if not isinstance(tag, int) or not 0 <= tag < len(WIRE_TYPES):
        raise ProtocolError(f"unknown message tag {tag!r}")
    cls = WIRE_TYPES[tag]
    names = _FIELDS[cls]
    if len(values) < _NUM_REQUIRED[cls]:
        raise ProtocolError(f"{cls.__name__}: expected {len(names)} fields, got {len(values)}")
    # a newer process's trailing fields are left out: ``zip`` stops at the known names
    kwargs = {**_ABSENT.get(cls, {}), **dict(zip(names, values))}
    try:
        if cls is PeerInfo:
            kwargs["role"] = Role(kwargs["role"])
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"invalid {cls.__name__}: {e}") from e


def encode(msg: Any) -> bytes:
    """One message to bytes."""
    return msgpack.packb(msg, default=_default)


def decode(data: bytes | memoryview, expected: type[T] | None = None) -> T:
    """Bytes to one message; raises ProtocolError for anything malformed."""
    try:
        msg = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed message: {e}") from e
    if expected is not None and not isinstance(msg, expected):
        raise ProtocolError(f"expected {expected.__name__}, got {type(msg).__name__}")
    return msg
