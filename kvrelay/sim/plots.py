"""PNG plots of a bench run or a simulation (matplotlib: ``pip install 'kvrelay[plot]'``).

Both show the TTFT and TPOT distributions (CDFs, the SLOs marked) and latency over time by
arrival; a simulation adds instances over time. matplotlib is imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.bench import RequestRecord, Slo


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ValueError("--plot needs matplotlib: pip install 'kvrelay[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: Sequence[float], slo_ms: float, title: str) -> None:
    ordered = sorted(values_ms)
    n = len(ordered)
    ax.plot(ordered, [(i + 1) / n for i in range(n)])
    ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title} distribution")
    ax.legend()


def _over_time(
    ax: Any, arrivals_s: Sequence[float], values_ms: Sequence[float], label: str
) -> None:
    ax.scatter(arrivals_s, values_ms, s=4, label=label)
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")


def plot_latencies(
    arrivals_s: Sequence[float],
    ttft_ms: Sequence[float],
    tpot_ms: Sequence[float],
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    path: Path,
    instances: Mapping[str, Sequence[tuple[float, int]]] | None = None,
) -> None:
    """Writes the PNG: CDFs, latency over time and (when given) instances over time."""
    plt = _pyplot()
    rows = 3 if instances else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows))
    _cdf(axes[0][0], ttft_ms, slo_ttft_ms, "TTFT")
    _cdf(axes[0][1], tpot_ms, slo_tpot_ms, "TPOT")
    _over_time(axes[1][0], arrivals_s, ttft_ms, "TTFT")
    axes[1][0].set_title("TTFT over time")
    _over_time(axes[1][1], arrivals_s, tpot_ms, "TPOT")
    axes[1][1].set_title("TPOT over time")
    if instances:
        ax = axes[2][0]
        for role, series in instances.items():
            ax.step([t for t, _ in series], [n for _, n in series], where="post", label=role)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("instances")
        ax.set_title("instances over time")
        ax.legend()
        axes[2][1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bench(records: Sequence[RequestRecord], slo: Slo, path: Path) -> None:
    done = [r for r in records if r.is_ok]
    plot_latencies(
        [r.sent_s for r in done],
        [(r.ttft_s or 0.0) * 1e3 for r in done],
        [r.tpot_s * 1e3 for r in done],
        slo.ttft_ms,
        slo.tpot_ms,
        path,
    )
