"""What the simulator replays: a trace's requests at a chosen rate, with prefix sharing.

**Rate.** ``rate`` (and a burst window ``burst_rate`` times that) is reached by superposing
``K = ceil(max rate)`` copies of the trace, copy ``j`` shifted by ``j * D / K`` and wrapped
around the trace's duration ``D``, then keeping each request with probability
``rate(t) / K`` (seeded). At rate 1 this is the trace itself; at 10 each arrival pattern
and length distribution of the trace recurs ten times as densely.

**Prefix sharing** (the Splitwise traces carry no prompt content, so it is a model; state it
with the result): ``tenants`` tenants with Zipf(``zipf_s``) popularity, each with one system
prompt of ``system_prompt_len`` tokens that starts every prompt of that tenant (as far as the
prompt is long); the rest of a prompt is unique. A mooncake trace brings its own sharing:
``hash_ids`` name its 512-token blocks, equal ids equal content (the model is then unused).

A prompt's shareable part is a list of **segments** (a tenant's system prompt, or one
mooncake hash id), each a run of whole KV blocks; the cache tiers hold segments, and the
router sees each segment's block hashes (``segment_keys``), as workers would report them.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence

from kvrelay.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadConfig:
    rate: float = 1.0  # times the trace's own rate
    duration_s: float | None = None  # simulate this much of the trace (None: all of it)
    start_s: float = 0.0  # from this point of the trace
    burst_rate: float = 1.0  # times ``rate`` inside the burst window
    burst_start_s: float = 0.0  # burst window, seconds after start
    burst_len_s: float = 0.0
    max_prompt_tokens: int | None = None  # caps (a model's context)
    max_output_tokens: int | None = None
    tenants: int = 100  # prefix model: tenants, each with one system prompt
    zipf_s: float = 1.1  # tenant popularity ~ 1 / rank^s
    system_prompt_len: int = 512  # tokens (0: no sharing)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate", "burst_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.tenants < 1:
            raise ValueError(f"tenants must be >= 1, got {self.tenants}")

    def rate_at(self, t: float) -> float:
        in_burst = self.burst_start_s <= t < self.burst_start_s + self.burst_len_s
        return self.rate * (self.burst_rate if in_burst else 1.0)


@dataclasses.dataclass(slots=True)
class SimRequest:
    rid: int
    arrival_s: float
    prompt_len: int
    output_len: int
    segments: tuple[tuple[int, int], ...]  # (segment key, blocks) of the shareable prefix
    unique_blocks: int  # the prompt's other full blocks (never shared)
    # filled in by the simulation
    first_token_s: float = math.nan
    finish_s: float = math.nan
    computed_tokens: int = 0  # prompt tokens prefill computed (the rest came from a tier)
    hit_blocks: tuple[int, int, int] = (0, 0, 0)  # device, host (L1), global (L2)
    prefill_id: str = ""
    decode_id: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.output_len <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)


def build_requests(
    trace: Sequence[TraceRequest], config: WorkloadConfig, block_size: int
) -> list[SimRequest]:
    """The requests of ``config`` in arrival order (see the module doc)."""
    import numpy as np

    if not trace:
        raise ValueError("empty trace")
    span = trace[-1].arrival_s - trace[0].arrival_s
    span_s = span + span / max(1, len(trace) - 1)  # one mean gap after the last request
    duration = span_s - config.start_s if config.duration_s is None else config.duration_s
    peak = config.rate * max(1.0, config.burst_rate if config.burst_len_s > 0 else 1.0)
    copies = max(1, math.ceil(peak - 1e-9))
    base = np.array([r.arrival_s for r in trace])
    times = np.concatenate([(base + j * span_s / copies) % span_s for j in range(copies)])
    index = np.tile(np.arange(len(trace)), copies)
    t = times - config.start_s
    keep = (t >= 0) & (t < duration)
    rng = np.random.default_rng(config.seed)
    draws = rng.random(len(t))
    rates = np.where(
        (t >= config.burst_start_s) & (t < config.burst_start_s + config.burst_len_s),
        config.rate * config.burst_rate,
        config.rate,
    )
    keep &= draws < rates / copies
    order = np.argsort(t[keep], kind="stable")
    arrivals, picked = t[keep][order], index[keep][order]
    ranks = np.arange(1, config.tenants + 1, dtype=float)
    popularity = ranks**-config.zipf_s
    tenants = rng.choice(config.tenants, size=len(picked), p=popularity / popularity.sum())
    out = []
    for rid, (arrival, i, tenant) in enumerate(
        zip(arrivals.tolist(), picked.tolist(), tenants.tolist())
    ):
        r = trace[i]
        prompt_len = min(r.prompt_len, config.max_prompt_tokens or r.prompt_len)
        output_len = max(1, min(r.output_len, config.max_output_tokens or r.output_len))
        segments = _segments(r, prompt_len, tenant, config, block_size)
        reusable = (prompt_len - 1) // block_size  # the last token is always computed
        shared = min(reusable, sum(n for _, n in segments))
        out.append(SimRequest(rid, arrival, prompt_len, output_len, segments, reusable - shared))
    return out


def _segments(
    r: TraceRequest, prompt_len: int, tenant: int, config: WorkloadConfig, block_size: int
) -> tuple[tuple[int, int], ...]:
    reusable = (prompt_len - 1) // block_size
    if r.hash_ids:
        per_id = MOONCAKE_BLOCK_TOKENS // block_size
        segs = []
        left = reusable
        for h in r.hash_ids:
            if left <= 0:
                break
            segs.append((h, min(per_id, left)))
            left -= per_id
        return tuple(segs)
    blocks = min(reusable, config.system_prompt_len // block_size)
    return ((tenant, blocks),) if blocks > 0 else ()


_KEYS: dict[tuple[int, int], tuple[bytes, ...]] = {}


def segment_keys(segment: int, num_blocks: int) -> tuple[bytes, ...]:
    """The 16-byte block hashes of a segment's first ``num_blocks`` blocks (memoised)."""
    keys = _KEYS.get((segment, num_blocks))
    if keys is None:
        keys = tuple(struct.pack("<qq", segment, j) for j in range(num_blocks))
        _KEYS[(segment, num_blocks)] = keys
    return keys
