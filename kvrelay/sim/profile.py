"""An instance's costs as the simulator reads them: one JSON file per machine and model.

``kvrelay sim profile --model DIR`` measures it here (``measure.py``); a GPU profile is the
same format measured on a GPU. Step times are linear models fitted by least squares to
measured engine steps (the raw points are kept beside the fit)::

    prefill step   base(tokens) + c * attn          attn = sum over chunks of
                                                    chunk * (context before it + chunk / 2);
                                                    base: piecewise linear through the
                                                    measured token counts (a + b * tokens
                                                    where a profile has no such points)
    decode step    base(seqs) + c * context         context = sum of the batch's lengths;
                                                    base: piecewise linear through the
                                                    measured batch sizes (a + b * seqs where
                                                    a profile has no such points)
    mixed step     prefill + decode - min(a_prefill, a_decode)   (colocated: one overhead)
    hand-off       latency + bytes / bytes_per_s    per transport (shm, tcp)
    tier read      bytes / bytes_per_s              L1 (host pool): shm; L2 (Redis): tcp
    start          seconds from the decision to serving, per mode (disk, pool, peer)

Pure Python: no torch, no numpy (the simulator's inner loop calls these).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

START_MODES = ("disk", "pool", "peer")
TRANSPORTS = ("shm", "tcp")


@dataclasses.dataclass(frozen=True, slots=True)
class StepModel:
    intercept_s: float  # fixed cost of a step
    per_item_s: float  # per token (prefill) or per sequence (decode)
    per_attn_s: float  # per unit of attention work (prefill: attn; decode: context tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    latency_s: float  # fixed cost of one transfer
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """Measured costs of one instance (one engine process) of one model on one machine."""

    model: str  # checkpoint name
    machine: str  # where it was measured (CPU model, or GPU name)
    threads: int  # torch threads of the measured engine
    block_size: int  # tokens per KV block
    kv_bytes_per_block: int  # all layers, K and V
    kv_blocks_per_gib: int  # pool blocks per GiB of KV memory
    prefill: StepModel
    decode: StepModel
    handoff: dict[str, Link]  # per transport
    start_s: dict[str, float]  # per start mode: decision to serving
    max_num_batched_tokens: int = 2048  # the engine's chunked-prefill budget per step
    max_num_seqs: int = 256  # sequences running at once
    points: dict[str, Any] = dataclasses.field(default_factory=dict)  # raw measurements
    # [seqs, seconds] of a decode step with no context, at each measured batch size: a step's
    # cost is far from linear in its sequences at small batches (the weights' bytes dominate
    # a lone sequence's step), which a single line through 1-32 sequences overstates
    decode_base: list[list[float]] = dataclasses.field(default_factory=list)
    # [tokens, seconds] of a prefill step with no attention, at each measured token count: a
    # short prompt's cost per token is higher than a long one's (SmolLM2 on an EPYC core: 4.2
    # ms a token at 32 tokens, 2.7-2.9 from 256 on), which one line puts 12% low at 32 tokens
    prefill_base: list[list[float]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        missing = [m for m in START_MODES if m not in self.start_s]
        if missing:
            raise ValueError(f"profile start_s lacks {missing}; need {list(START_MODES)}")
        missing = [t for t in TRANSPORTS if t not in self.handoff]
        if missing:
            raise ValueError(f"profile handoff lacks {missing}; need {list(TRANSPORTS)}")

    # -------------------------------------------------------------- step costs
    def prefill_s(self, tokens: int, attn: float) -> float:
        m = self.prefill
        if not self.prefill_base:
            return m.intercept_s + m.per_item_s * tokens + m.per_attn_s * attn
        return interpolate(self.prefill_base, tokens) + m.per_attn_s * attn

    def decode_s(self, seqs: int, context: int) -> float:
        m = self.decode
        if not self.decode_base:
            return m.intercept_s + m.per_item_s * seqs + m.per_attn_s * context
        return interpolate(self.decode_base, seqs) + m.per_attn_s * context

    def step_s(self, tokens: int, attn: float, seqs: int, context: int) -> float:
        """One engine step of ``tokens`` prefill tokens and ``seqs`` decoding sequences."""
        if not seqs:
            return self.prefill_s(tokens, attn)
        if not tokens:
            return self.decode_s(seqs, context)
        shared = min(self.prefill.intercept_s, self.decode.intercept_s)
        return self.prefill_s(tokens, attn) + self.decode_s(seqs, context) - shared

    def handoff_s(self, transport: str, num_blocks: int) -> float:
        return self.handoff[transport].seconds(num_blocks * self.kv_bytes_per_block)

    # -------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """Raises ValueError naming a missing or unknown field."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        try:
            return cls(
                **{
                    **data,
                    "prefill": StepModel(**data["prefill"]),
                    "decode": StepModel(**data["decode"]),
                    "handoff": {k: Link(**v) for k, v in data["handoff"].items()},
                }
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad profile: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        return cls.from_json(data)


def interpolate(points: list[list[float]], x: float) -> float:
    """Piecewise linear through ``points`` ([x, y], x ascending): the first y below the first
    x, the last segment's slope (never negative) beyond the last."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):  # a handful of points: a scan
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)  # past the last: its slope


def fit_base(rows: list[tuple[float, float, float]], model: StepModel) -> list[list[float]]:
    """``[x, seconds]`` per measured ``x`` (decode: sequences; prefill: tokens) of ``(x, y,
    seconds)`` rows: each point's time less ``model``'s ``y`` term (context, attention),
    averaged over the rows measured at that ``x``."""
    by_x: dict[float, list[float]] = {}
    for x, y, seconds in rows:
        by_x.setdefault(x, []).append(max(0.0, seconds - model.per_attn_s * y))
    return [[x, sum(ts) / len(ts)] for x, ts in sorted(by_x.items())]


def fit_linear(rows: list[tuple[float, float, float]]) -> StepModel:
    """Least squares of ``seconds = a + b * x + c * y`` over ``(x, y, seconds)`` rows, with
    coefficients clipped at 0 (a noisy fit must not make work free)."""
    import numpy as np

    xs = np.array([[1.0, x, y] for x, y, _ in rows])
    ts = np.array([t for _, _, t in rows])
    coef = np.linalg.lstsq(xs, ts, rcond=None)[0]
    if (coef < 0).any():  # refit without the negative terms
        keep = coef >= 0
        sub = np.linalg.lstsq(xs[:, keep], ts, rcond=None)[0]
        coef = np.zeros(3)
        coef[keep] = np.maximum(sub, 0)
    return StepModel(float(coef[0]), float(coef[1]), float(coef[2]))
