"""kvrelay's engine at another commit against the working tree, on the same machine and load.

An engine change is measured against the engine before it in the same run: the other commit
is checked out into a git worktree (``--base``, built in place there), both engines are
started once (``peers_engine.py``, the offline ``LLM``) and kept alive, and timed runs
alternate between them (A, B, B, A...), each started on a quiet machine. Measured as in
``peers.py``: offline throughput (64 mixed requests, ignore_eos, prefix caching off), a
lone request's decode step, and a prefill step of ``--prefill-prompts`` prompts of 256 random
tokens with one output token each (8 x 256: one 2,048-token step, the default chunk budget).
This VM's speed drifts by 20-30% within an hour, so only ratios from one run mean anything;
the offline ratio is also given per repeat (its two runs are close in time), median and range.

    python benchmarks/engine_ab.py --model DIR --base REV [--dtype bfloat16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import wait_for_quiet_cpu
from peers import ENGINE_SCRIPT, Engine, make_requests, model_vocab

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--worktree", default="/tmp/kvrelay-ab-base", help="where it is built")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--cpu-packed-weights", choices=("auto", "1", "0"), default="auto",
        help="KVRELAY_CPU_PACKED_WEIGHTS for both engines: auto leaves it unset (kvrelay's "
        "default: packed copies when they fit in memory, as a served engine has)",
    )  # fmt: skip
    parser.add_argument("--max-wait-quiet", type=float, default=30.0, help="seconds; 0: none")
    parser.add_argument("--prefill-prompts", type=int, default=8, help="0: no prefill step")
    parser.add_argument("--build-cache", type=Path, help="keeps the base's native libraries "
                        "by their sources (base_tree); default: always compiled")  # fmt: skip
    return parser.parse_args(argv)


def native_sources_key(tree: Path) -> str:
    """What the native libraries are built from: setup.py, kvrelay/csrc and the interpreter."""
    digest = hashlib.sha256(f"{sys.version}\n{platform.machine()}\n".encode())
    for source in [tree / "setup.py", *sorted((tree / "kvrelay" / "csrc").rglob("*"))]:
        if source.is_file():
            digest.update(f"{source.relative_to(tree)}\n".encode() + source.read_bytes())
    return digest.hexdigest()[:16]


def base_tree(rev: str, path: Path, build_cache: Path | None = None) -> Path:
    """A worktree of ``rev`` with its native library built in place. ``build_cache``: a folder
    that keeps the built libraries by their sources (``native_sources_key``), so another
    worktree of the same sources copies them instead of compiling again."""
    if path.exists():  # left by a run that was killed: this script's own scratch tree
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       capture_output=True)  # fmt: skip
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", str(path), rev], check=True)
    cached = build_cache / native_sources_key(path) if build_cache is not None else None
    if cached is not None and cached.is_dir():
        shutil.copytree(cached, path, dirs_exist_ok=True)
        return path
    build = [sys.executable, "setup.py", "build_ext", "--inplace", "-q"]
    subprocess.run(build, cwd=path, check=True, capture_output=True)
    if cached is not None:
        building = cached.with_name(f"{cached.name}.{os.getpid()}")
        for library in (path / "kvrelay").rglob("*.so"):
            target = building / library.relative_to(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library, target)
        try:
            building.rename(cached)  # whole or not at all
        except OSError:  # another run kept the same sources' libraries first
            shutil.rmtree(building)
    return path


def start(name: str, root: Path, args: argparse.Namespace) -> Engine:
    """``name``'s engine process from ``root``, loading (``Engine.ask_ready`` waits for it)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(root))
    if args.cpu_packed_weights != "auto":  # was "0" unless asked: engines without the copies
        env["KVRELAY_CPU_PACKED_WEIGHTS"] = args.cpu_packed_weights
    argv = [sys.executable, str(root / "benchmarks" / ENGINE_SCRIPT.name), "--system", "kvrelay"]
    argv += ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads)]
    return Engine(name, argv, env, wait=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    worktree = Path(args.worktree)
    engines = []
    try:
        # the head engine loads while the base is built (the timed runs start once both are)
        head = start("head", ROOT, args)
        engines = [head]
        engines = [start("base", base_tree(args.base, worktree, args.build_cache), args), head]
        for engine in engines:
            engine.ask_ready()
        requests = make_requests(args.num_requests, model_vocab(args.model))
        tokens = sum(r[1] for r in requests)
        for engine in engines:  # untimed: first-run costs
            engine.call(op="offline", requests=requests)
        offline: dict[str, list[float]] = {e.name: [] for e in engines}
        step: dict[str, list[float]] = {e.name: [] for e in engines}
        prefill: dict[str, list[float]] = {e.name: [] for e in engines}
        rng = random.Random(1)
        vocab = model_vocab(args.model)
        for i in range(args.repeats):
            for engine in engines if i % 2 == 0 else engines[::-1]:
                if args.max_wait_quiet > 0:
                    wait_for_quiet_cpu(max_wait_s=args.max_wait_quiet)
                seconds = engine.call(op="offline", requests=requests)["seconds"]
                offline[engine.name].append(tokens / seconds)
                if args.max_wait_quiet > 0:
                    wait_for_quiet_cpu(max_wait_s=args.max_wait_quiet)
                prompt = list(range(100, 164))
                step_s = engine.call(op="decode", prompt=prompt, steps=32)["step_s"]
                step[engine.name].append(step_s * 1e3)
                if args.prefill_prompts > 0:
                    batch = [
                        [[rng.randrange(3, vocab) for _ in range(256)], 1]
                        for _ in range(args.prefill_prompts)
                    ]
                    prefill[engine.name].append(
                        1e3 * engine.call(op="offline", requests=batch)["seconds"]
                    )
    finally:
        for engine in engines:
            engine.close()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "-f", str(worktree)])
    print(f"{args.dtype}, {args.threads} threads, base {args.base} vs the working tree")
    for name in offline:
        runs = " / ".join(f"{v:.1f}" for v in offline[name])
        steps = " / ".join(f"{v:.2f}" for v in step[name])
        print(
            f"{name}: offline {statistics.median(offline[name]):.1f} tok/s ({runs}); "
            f"decode step {statistics.median(step[name]):.2f} ms ({steps})"
        )
        if prefill[name]:
            runs = " / ".join(f"{v:.0f}" for v in prefill[name])
            print(
                f"{name}: prefill step of {args.prefill_prompts} x 256 tokens "
                f"{statistics.median(prefill[name]):.0f} ms ({runs})"
            )
    ratio = statistics.median(offline["head"]) / statistics.median(offline["base"])
    print(f"head / base offline: {ratio:.2f}x")
    # a repeat's two runs are close in time: their ratio cancels the machine's drift between
    # repeats, which on a shared VM can exceed the change being measured
    paired = sorted(h / b for h, b in zip(offline["head"], offline["base"], strict=True))
    print(
        f"head / base offline, paired by repeat: {statistics.median(paired):.2f}x "
        f"({paired[0]:.2f}-{paired[-1]:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
