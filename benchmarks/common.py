"""Helpers shared by the benchmark scripts: timing, machine facts, tables, BENCHMARKS.md.

Every benchmark records its result as one ``## <title>`` section of ``BENCHMARKS.md`` at the
repository root; ``update_benchmarks_md`` replaces that section in place (or appends it) and
leaves every other section as it was, so each script owns exactly one section::

    # Benchmarks            <- preamble, kept
    ## Engine throughput    <- owned by engine_throughput.py
    ## KV transfer          <- owned by another script, kept
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"
MD_PREAMBLE = (
    "# Benchmarks\n\n"
    "Each section is written by the script named in its command; rerun that command to "
    "refresh it.\n"
)
_FENCE = "```"

T = TypeVar("T")
logger = logging.getLogger(__name__)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Runs ``fn`` once and returns its result and the wall-clock seconds it took."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class CpuTimes(NamedTuple):
    wall: float  # time.perf_counter()
    busy: float  # CPU-seconds all CPUs spent busy (steal included), from /proc/stat
    own: float  # CPU-seconds this process used, all its threads


class TimedRun(NamedTuple):
    value: Any
    seconds: float
    others_cpu: float  # share of all CPUs other processes used meanwhile, 0..1


def cpu_times() -> CpuTimes:
    """A snapshot for ``others_cpu_share``; ``busy`` is 0 where ``/proc/stat`` is absent."""
    busy = 0.0
    stat = Path("/proc/stat")
    if stat.is_file():
        fields = stat.read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuTimes(time.perf_counter(), busy, own.user + own.system)


def others_cpu_share(start: CpuTimes, end: CpuTimes) -> float:
    """Share of the machine's CPUs that other processes (or the hypervisor) used in between.

    A benchmark that sets its own thread count is only meaningful when this is near 0: with
    OpenMP threads competing for cores, a 2-thread matmul can run ten times slower.
    """
    wall = end.wall - start.wall
    if wall <= 0 or end.busy == 0:
        return 0.0
    others = (end.busy - start.busy) - (end.own - start.own)
    return min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))


def wait_for_quiet_cpu(max_wait_s: float = 120.0, threshold: float = 0.05) -> float:
    """Waits (up to ``max_wait_s``) until other processes use under ``threshold`` of the CPUs
    over a one-second window; returns the last share seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        start = cpu_times()
        time.sleep(1.0)
        share = others_cpu_share(start, cpu_times())
        if share < threshold or time.monotonic() >= deadline:
            return share


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (from /proc; ``kvrelay up`` starts its router and
    workers in sessions of their own, so a process group lacks them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def signal_tree(pid: int, sig: int) -> None:
    """Sends ``sig`` to ``pid`` and its descendants. Peers' benchmarks freeze (SIGSTOP) every
    system but the one they time: idle is not quiet. vLLM's CPU worker polls its queue about
    1,300 times a second while it has nothing to do (kvrelay's idle worker about 100), and
    each wake-up on a core where the timed system's OpenMP team spins stalls that team:
    kvrelay colocated served 121.7 / 126.6 tok/s alone and 98.5 / 111.3 beside an idle
    vLLM server (float32, 2 vCPUs, 2026-11-28)."""
    for member in process_tree(pid):
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            continue


def timed_quiet(
    fn: Callable[[], T],
    setup: Callable[[], object] | None = None,
    max_others_cpu: float = 0.1,
    attempts: int = 3,
    max_wait_s: float = 120.0,
) -> TimedRun:
    """Times ``fn`` on a quiet machine: waits for idle CPUs first, and runs it again (up to
    ``attempts`` times) while other processes took more than ``max_others_cpu`` of the CPUs.

    ``setup`` (untimed) runs before every attempt, e.g. to drop caches a repeat would hit;
    ``max_wait_s <= 0`` starts at once.
    Returns the least disturbed run.
    """
    best: TimedRun | None = None
    for _ in range(attempts):
        if max_wait_s > 0:
            wait_for_quiet_cpu(max_wait_s)
        if setup is not None:
            setup()
        start = cpu_times()
        value, seconds = timed(fn)
        run = TimedRun(value, seconds, others_cpu_share(start, cpu_times()))
        if best is None or run.others_cpu < best.others_cpu:
            best = run
        if run.others_cpu <= max_others_cpu:
            break
        logger.warning(
            "other processes used %.0f%% of the CPUs; timing again", 100 * run.others_cpu
        )
    assert best is not None
    return best


@functools.cache
def _vllm_rpc_dir() -> tempfile.TemporaryDirectory[str]:
    """Where this run's vLLM processes put their IPC sockets; removed when the run ends."""
    return tempfile.TemporaryDirectory(prefix="kvrelay-bench-vllm-rpc-")


def vllm_env(env: Mapping[str, str], cache: str, threads: int) -> dict[str, str]:
    """The environment of a vLLM-CPU process: ``env`` without PYTHONPATH (its venv's own
    packages), its compile cache (``VLLM_CACHE_ROOT``: a start recompiles for 80-90 s
    without it), 1 GiB of KV memory, OpenMP bound to the first ``threads`` cores, and its ZMQ
    IPC sockets in a directory of this run's (``VLLM_RPC_BASE_PATH``; vLLM leaves them in
    /tmp otherwise, one per start)."""
    out = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    out.update(VLLM_TARGET_DEVICE="cpu", VLLM_CACHE_ROOT=cache, VLLM_CPU_KVCACHE_SPACE="1")
    out.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    out["VLLM_RPC_BASE_PATH"] = _vllm_rpc_dir().name
    return out


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def cpu_model() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo`` (or ``platform`` where that is absent)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(num_threads: int) -> dict[str, Any]:
    """Facts a reader needs to compare runs: CPU, cores, threads used, library versions."""
    return {
        "cpu": cpu_model(),
        "num_cpus": os.cpu_count(),
        "num_threads": num_threads,
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "transformers": package_version("transformers"),
    }


def package_version(name: str) -> str | None:
    """An installed package's version, without importing it where it is not loaded yet
    (torch and transformers take seconds); None if it is not installed."""
    module = sys.modules.get(name)
    if module is not None:
        return str(module.__version__)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        try:
            return str(importlib.import_module(name).__version__)
        except ImportError:
            return None


def machine_markdown(info: dict[str, Any]) -> str:
    parts = [
        f"CPU: {info['cpu']} ({info['num_cpus']} logical CPUs visible)",
        f"threads: {info['num_threads']}",
        f"torch {info['torch']}",
        f"Python {info['python']}",
    ]
    if info.get("transformers"):
        parts.append(f"transformers {info['transformers']}")
    return "Machine: " + "; ".join(parts) + "."


def command_line(script: str | Path | None = None) -> str:
    """The command that reproduces this run, with the script path relative to the repo."""
    path = Path(script or sys.argv[0]).resolve()
    try:
        shown = str(path.relative_to(REPO_ROOT))
    except ValueError:
        shown = str(path)
    return shlex.join(["python", shown, *sys.argv[1:]])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; numbers are right-aligned."""
    align = [
        "---:" if rows and all(_is_number(r[i]) for r in rows) else "---"
        for i in range(len(headers))
    ]
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table for the terminal."""
    cells = [[str(h) for h in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    out = []
    for n, row in enumerate(cells):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _is_number(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    try:
        float(str(value).replace(",", "").rstrip("x"))
    except ValueError:
        return False
    return True


def render_section(section_title: str, body_markdown: str, command: str) -> str:
    return (
        f"## {section_title}\n\n{body_markdown.strip()}\n\n"
        f"Command:\n\n{_FENCE}\n{command}\n{_FENCE}\n"
    )


def update_benchmarks_md(
    section_title: str,
    body_markdown: str,
    command: str,
    path: Path = BENCHMARKS_MD,
    *,
    history: bool = False,
) -> Path:
    """Replaces the ``## section_title`` section of ``path`` (or appends it), keeping the rest;
    ``history``: the new run goes on top and the section's earlier text stays below it (the
    peer comparisons, whose earlier runs are the record of how the figures moved).

    A section runs from its ``## `` heading to the next ``# ``/``## `` heading outside a code
    fence. The file is created with a short preamble if it does not exist, and written
    atomically (a temporary file renamed over it).
    """
    old = path.read_text(encoding="utf-8") if path.is_file() else MD_PREAMBLE
    preamble, sections = split_sections(old)
    new_section = render_section(section_title, body_markdown, command)
    replaced = False
    for i, (title, text) in enumerate(sections):
        if title == section_title:
            earlier = text.split("\n", 1)[1].strip() if history and "\n" in text else ""
            sections[i] = (title, new_section + (f"\n{earlier}\n" if earlier else ""))
            replaced = True
    if not replaced:
        sections.append((section_title, new_section))
    parts = [preamble.rstrip("\n") + "\n"] if preamble.strip() else []
    parts += [text.rstrip("\n") + "\n" for _, text in sections]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(parts), encoding="utf-8")
    os.replace(tmp, path)
    return path


def split_sections(markdown: str) -> tuple[str, list[tuple[str, str]]]:
    """Splits Markdown into the text before the first ``## `` heading and ``(title, text)``."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(_FENCE):
            in_fence = not in_fence
        if not in_fence and line.startswith("## "):
            sections.append((line[3:].strip(), [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return "\n".join(preamble), [(title, "\n".join(lines)) for title, lines in sections]


DTYPES = ("float32", "bfloat16")


def add_model_args(parser: Any, what: str = "checkpoint") -> None:
    """``--model`` (alias ``--model-dir``), ``--size`` and ``--dtype``, the same in every script."""
    parser.add_argument(
        "--model",
        "--model-dir",
        dest="model_dir",
        type=Path,
        help=f"{what} directory (e.g. `kvrelay model get smollm2-135m-instruct DIR`); "
        "default: a make_tiny checkpoint of --size",
    )
    parser.add_argument("--size", default="small", help="make_tiny size when no --model")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache")


def model_label(model_dir: Path | None, size: str = "small") -> str:
    """How a section names its model: a GGUF import by its source file, else the directory."""
    if model_dir is None:
        return f"make_tiny `{size}` llama"
    record = model_dir / "kvrelay_import.json"
    if record.is_file():
        source = json.loads(record.read_text()).get("source", "")
        if source:
            stem, _, quant = source.removesuffix(".gguf").rpartition(".")
            return f"{stem} ({quant} GGUF, dequantized)" if stem else source
    return f"`{model_dir.name}`"


def model_name(model_dir: Path | None, size: str = "small") -> str:
    """``model_label`` without its notes: ``SmolLM2-135M-Instruct``, ``ckpt``."""
    return model_label(model_dir, size).split(" (")[0].strip("`")


def section_title(base: str, model_dir: Path | None, size: str, dtype: str) -> str:
    """One section per script, model and dtype: ``base: model, dtype``."""
    return f"{base}: {model_name(model_dir, size)}, {dtype}"


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def measure_memory_bandwidth(
    num_bytes: int = 512 << 20, num_runs: int = 7, num_threads: int | None = None
) -> float:
    """Copy bandwidth in bytes/s: median over runs of ``dst.copy_(src)`` on float32 tensors.

    Counts the bytes read plus the bytes written (STREAM's "copy" convention), so it is the
    rate at which a kernel that streams its operands once can touch memory.
    """
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    numel = num_bytes // 4
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    seconds = [timed(lambda: dst.copy_(src))[1] for _ in range(num_runs)]
    return 2 * numel * 4 / median(seconds)


def fmt(value: float, digits: int = 1) -> str:
    """A number with thousands separators and ``digits`` decimals."""
    return f"{value:,.{digits}f}"


def up_first_token_s(
    tree: Path,
    model_dir: Path,
    log_dir: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    then: Callable[[str], None] | None = None,
) -> float:
    """Seconds from starting ``kvrelay up`` (the code of ``tree``) to an answered 1-token
    completion; ``then(url)`` runs next, on the cluster as that answer left it; the cluster
    is stopped (SIGINT, then SIGKILL after 60 s) before returning."""
    from kvrelay.cli.launcher import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "kvrelay", "up", "--model", str(model_dir), "--port", str(port),
           "--log-dir", str(log_dir), *args]  # fmt: skip
    body = json.dumps({"model": model_dir.name, "prompt": "Hello", "max_tokens": 1}).encode()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)},
                            cwd=tree, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while time.perf_counter() - start < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"kvrelay up exited {proc.returncode}; logs: {log_dir}")
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body,
                {"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    ready = time.perf_counter() - start if resp.status == 200 else None
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                ready = None
            if ready is not None:
                if then is not None:
                    then(f"http://127.0.0.1:{port}")
                return ready
            time.sleep(0.05)
        raise RuntimeError(f"no first token in 300 s; logs: {log_dir}")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
