"""A GPU engine's steps timed one by one, with Triton's compiles counted beside each.

Serves random-token prompts through ``LLMEngine`` directly, a fixed number in flight, outputs
of varied length so that new prompts join running batches (mixed steps); each step is timed
(its tokens reach the host, so the time is the GPU's too) and the ``.cubin`` files in
Triton's cache are counted before and after it: a step that compiled a kernel shows it.
Passes repeat the workload in the same process (the second has nothing left to compile).
``--profile`` runs torch's profiler over one mixed step of the last pass. ``--prefill both``
runs the workload twice in the process, prefill attention in Triton's one-launch kernel
(``triton``) and then through torch's gather + SDPA per segment (``sdpa``,
``KVRELAY_TRITON_PREFILL=0``), each on its own engine, and prints the medians side by side.
``--rows both`` does the same for a layer's small ops in Triton's row kernels (``triton-rows``)
and in torch's ops (``torch-rows``, ``KVRELAY_TRITON_ROWS=0``). ``--mixed-graphs both`` does
the same for prompt and mixed steps replayed as CUDA graphs
(``graphs``: the whole step) and run eagerly (``eager``, ``KVRELAY_MIXED_GRAPHS=0``); ``all``
adds ``pieces`` between them: the layers around attention as graphs, attention eager
(``LayerGraphs`` installed on an engine made without step graphs, Triton's prefill kept).

    python benchmarks/gpu_steps.py --like SMOLLM2_DIR [--requests 64] [--concurrency 32]
        [--prefill triton|sdpa|both] [--mixed-graphs graphs|pieces|eager|both|all]
        [--rows triton|torch|both]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main(), once the arguments are checked (torch's import: ~3 s)
    from kvrelay.engine.llm import LLM


def compiled() -> int:
    """``.cubin`` files in Triton's cache: one per compiled kernel variant."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")))
    return len(list(cache.glob("*/*.cubin"))) if cache.is_dir() else 0


def run_pass(llm: LLM, tag: str, args: argparse.Namespace, rng: random.Random, profile: bool):
    from kvrelay import SamplingParams

    engine, sched = llm.engine, llm.engine.scheduler
    low, high = args.output_len
    vocab = engine.config.model_config.vocab_size
    added = done = 0
    rows: list[tuple[str, float, int]] = []
    profiled = False
    while done < args.requests:
        while added < args.requests and sched.num_running + sched.num_waiting < args.concurrency:
            prompt = [rng.randrange(vocab // 50, vocab) for _ in range(args.prompt_len)]
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(low, high), ignore_eos=True
            )
            engine.add_request(f"{tag}-{added}", prompt, params)
            added += 1
        before, started = compiled(), time.perf_counter()
        if profile and not profiled and sched.num_waiting and sched.num_running:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                outputs = engine.step()
            print(p.key_averages().table(sort_by="cpu_time_total", row_limit=18))
            profiled = True
        else:
            outputs = engine.step()
        rows.append(
            (engine.last_step_kind, 1e3 * (time.perf_counter() - started), compiled() - before)
        )
        done += sum(1 for out in outputs if out.finished)
    medians = {}
    for kind in ("decode", "mixed", "prefill"):
        times = [t for k, t, _ in rows if k == kind]
        if times:
            medians[kind] = statistics.median(times)
            print(f"{tag} {kind}: n={len(times)} median {medians[kind]:.2f} ms "
                  f"max {max(times):.1f} ms")  # fmt: skip
    slow = [(k, round(t), c) for k, t, c in rows if t > args.slow_ms]
    print(f"{tag} steps over {args.slow_ms} ms (kind, ms, kernels compiled): {slow[:20]}")
    return medians


def install_pieces(llm: LLM) -> None:
    """The layers around attention as graphs on an engine made without step graphs."""
    from kvrelay.engine.cuda_graphs import LayerGraphs

    runner = llm.engine.runner
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    on_gpu = runner.kv_cache.device.type == "cuda"  # a CPU runs the same pieces uncaptured
    runner.layer_graphs = LayerGraphs(runner.model, runner.kv_cache, budget, capture=on_gpu)
    runner.layer_graphs.capture_all()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--like", type=Path, required=True, help="config + tokenizer dir; random weights"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 160], metavar=("LOW", "HIGH"),
                   help="each request's output tokens, drawn from [LOW, HIGH)")  # fmt: skip
    p.add_argument("--slow-ms", type=float, default=50.0)
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--prefill",
        choices=("triton", "sdpa", "both"),
        default="triton",
        help="prefill attention: Triton's one-launch kernel, torch's SDPA per segment "
        "(KVRELAY_TRITON_PREFILL=0), or both in turn",
    )
    p.add_argument(
        "--mixed-graphs",
        choices=("graphs", "pieces", "eager", "both", "all"),
        default="graphs",
        help="prompt and mixed steps: whole-step CUDA graphs, graphs around eager attention "
        "(pieces), eager (KVRELAY_MIXED_GRAPHS=0), graphs and eager in turn (both), or all three",
    )
    p.add_argument(
        "--rows",
        choices=("triton", "torch", "both"),
        default="triton",
        help="a layer's small ops: Triton's row kernels, torch's ops (KVRELAY_TRITON_ROWS=0), "
        "or both in turn",
    )
    args = p.parse_args()
    compared = [args.prefill == "both", args.mixed_graphs in ("both", "all"), args.rows == "both"]
    if sum(compared) > 1:
        p.error("compare one thing at a time: --prefill both, --mixed-graphs both or --rows both")
    if not 1 <= args.output_len[0] < args.output_len[1]:
        p.error("--output-len needs 1 <= LOW < HIGH")
    import torch

    from kvrelay.engine.llm import LLM

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_decode import random_checkpoint

    prefill = ("triton", "sdpa") if args.prefill == "both" else (args.prefill,)
    layers = {"both": ("graphs", "eager"), "all": ("graphs", "pieces", "eager")}.get(
        args.mixed_graphs, (args.mixed_graphs,)
    )
    # each path: its name and the environment its engine is made under
    rows = ("triton", "torch") if args.rows == "both" else (args.rows,)
    paths = {
        (f"{c}-rows" if len(rows) > 1 else b if len(layers) > 1 else a): {
            "KVRELAY_TRITON_PREFILL": "1" if a == "triton" else "0",
            "KVRELAY_MIXED_GRAPHS": "1" if b == "graphs" else "0",
            "KVRELAY_TRITON_ROWS": "1" if c == "triton" else "0",
        }
        for a in prefill
        for b in layers
        for c in rows
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = random_checkpoint(args.like, Path(tmp), torch.bfloat16)
        for path, env in paths.items():
            os.environ.update(env)
            started = time.perf_counter()
            llm = LLM(model, dtype="bfloat16", device=args.device)
            if path == "pieces":
                install_pieces(llm)
            print(f"[{path}] engine + warm-up {time.perf_counter() - started:.1f} s; "
                  f"kernels {compiled()}")  # fmt: skip
            rng = random.Random(0)  # the same workload for each path
            for n in range(args.passes):
                profile = args.profile and n == args.passes - 1
                results[path] = run_pass(llm, f"{path} pass{n + 1}", args, rng, profile)
            print(f"[{path}] kernels at the end {compiled()}")
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if len(paths) > 1:
        first, *others = paths
        for kind in ("decode", "mixed", "prefill"):
            for other in others:
                if kind in results[first] and kind in results[other]:
                    a, b = results[first][kind], results[other][kind]
                    print(f"last pass {kind} median: {first} {a:.2f} ms, {other} {b:.2f} ms "
                          f"({other} / {first} {b / a:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
