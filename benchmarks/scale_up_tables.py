"""Scale-up benchmark, tables: the typed values of a result dict (a run's, or a saved
``--json``) and the rows of its three tables (starts, pool attach, chain)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from common import median
from scale_up_measure import MODES, AttachResult, ChainRun, StartRun, link_label
from scale_up_setup import Checkpoint


def median_of(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None; None if every one is."""
    present = [v for v in values if v is not None]
    return median(present) if present else None


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f}"


def _params(num: int) -> str:
    return f"{num / 1e9:.2f}B" if num >= 1e9 else f"{num / 1e6:.0f}M"


START_HEADERS = (
    "model", "params", "weights MiB", "mode", "start -> first token p50 (s)", "min - max (s)",
    "vs disk", "worker ready (s)", "router lists it (s)", "first token after join (s)",
    "weights (s)",
)  # fmt: skip


def weight_seconds(mode: str, runs: Sequence[StartRun], attach: AttachResult | None) -> str:
    """The weights' share: logged by the worker (build, peer) or measured here (disk, pool)."""
    if mode in ("build", "peer"):
        return _s(median_of([r.weights_logged_s for r in runs]))
    if attach is None:
        return "-"
    if mode == "disk":
        return _s(median(attach.disk_load_s)) + " (a)"
    return _s(median(attach.attach_ms) / 1e3, 3) + " (b)"


def start_rows(
    ckpts: Sequence[Checkpoint], starts: Sequence[StartRun], attach: dict[str, AttachResult]
) -> list[list[Any]]:
    rows = []
    for c in ckpts:
        by_mode = {m: [r for r in starts if r.model == c.name and r.mode == m] for m in MODES}
        disk = median_of([r.first_token_s for r in by_mode["disk"]])
        for mode, runs in by_mode.items():
            if not runs:
                continue
            total = median([r.first_token_s for r in runs])
            after_join = median([r.first_token_s - r.joined_s for r in runs])
            spread = [r.first_token_s for r in runs]
            rows.append([
                c.name, _params(c.num_params), f"{mib(c.num_bytes)} ({c.dtype})", mode,
                _s(total), f"{min(spread):.2f} - {max(spread):.2f}",
                "-" if disk is None else f"{disk / total:.2f}x",
                _s(median_of([r.ready_s for r in runs])), _s(median([r.joined_s for r in runs])),
                _s(after_join),
                weight_seconds(mode, runs, attach.get(c.name)),
            ])  # fmt: skip
    return rows


ATTACH_HEADERS = (
    "model", "pool MiB", "attach p50 (ms)", "min (ms)", "max (ms)", "fingerprint (ms)",
    "disk load (s)", "disk load / attach",
)  # fmt: skip


def attach_rows(results: Sequence[AttachResult]) -> list[list[Any]]:
    rows = []
    for a in results:
        p50 = median(a.attach_ms)
        rows.append([
            a.model, mib(a.pool_bytes), _s(p50), _s(min(a.attach_ms)), _s(max(a.attach_ms)),
            _s(a.fingerprint_ms), _s(median(a.disk_load_s)),
            f"{median(a.disk_load_s) * 1e3 / p50:,.0f}x",
        ])  # fmt: skip
    return rows


CHAIN_HEADERS = (
    "link", "receivers", "start -> last done p50 (s)", "min (s)", "max (s)", "vs 1 receiver",
    "per-receiver fetch p50 (s)", "pool GB/s delivered", "chain order kept",
)  # fmt: skip


def by_link(runs: Sequence[ChainRun]) -> dict[float, list[ChainRun]]:
    """Chain runs per link condition, unlimited (0) first."""
    return {m: [r for r in runs if r.link_mbps == m] for m in sorted({r.link_mbps for r in runs})}


def chain_p50(runs: Sequence[ChainRun]) -> dict[int, float]:
    """Median start -> last done per receiver count, of one link condition's runs."""
    counts = sorted({r.num_receivers for r in runs})
    return {n: median([r.last_done_s for r in runs if r.num_receivers == n]) for n in counts}


def chain_rows(ckpt: Checkpoint, runs: Sequence[ChainRun]) -> list[list[Any]]:
    return [row for group in by_link(runs).values() for row in _chain_rows(ckpt, group)]


def _chain_rows(ckpt: Checkpoint, runs: Sequence[ChainRun]) -> list[list[Any]]:
    p50s = chain_p50(runs)
    base = p50s.get(1)
    rows = []
    for n, p50 in p50s.items():
        mine = [r for r in runs if r.num_receivers == n]
        each = [median([r.fetch_s[k] for r in mine]) for k in range(n)]
        rows.append([
            link_label(mine[0].link_mbps), n, _s(p50), _s(min(r.last_done_s for r in mine)),
            _s(max(r.last_done_s for r in mine)),
            "-" if base is None else f"{p50 / base:.2f}x", " / ".join(_s(v) for v in each),
            _s(n * ckpt.num_bytes / p50 / 1e9), f"{sum(r.is_chain for r in mine)}/{len(mine)}",
        ])  # fmt: skip
    return rows


class Results(NamedTuple):
    ckpts: list[Checkpoint]
    starts: list[StartRun]
    attach: list[AttachResult]
    chain: list[ChainRun]
    chain_ckpt: Checkpoint | None


def parse_results(result: dict[str, Any]) -> Results:
    """The typed values of a result dict (``run_all``'s, or a saved ``--json``)."""
    ckpts = [
        Checkpoint(**{**c, "path": Path(c["path"]), "twin": Path(c["twin"])})
        for c in result["checkpoints"]
    ]
    return Results(
        ckpts,
        [StartRun(**r) for r in result["starts"]],
        [AttachResult(**{**a, "attach_ms": tuple(a["attach_ms"])}) for a in result["attach"]],
        [ChainRun(**r) for r in result["chain"]],
        next((c for c in ckpts if c.name == result["chain_model"]), None),
    )


def chain_bytes(r: Results) -> int:
    return r.chain_ckpt.num_bytes if r.chain_ckpt is not None else 0
