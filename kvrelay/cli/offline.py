"""``kvrelay model make-tiny``, ``generate`` and ``chat``: the commands that run no server.

Decides the options of the offline engine commands and how their outputs are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvrelay.cli.engine_args import add_engine_args, engine_kwargs, lora_modules
from kvrelay.cli.model import add_model_parsers


def add_offline_parsers(sub: Any) -> None:
    """``model make-tiny`` (and the GGUF commands of ``cli.model``), ``generate`` and ``chat``."""
    model = sub.add_parser("model", help="checkpoint utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser(
        "make-tiny", help="write a random-initialised checkpoint with a locally trained tokenizer"
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    tiny.add_argument("--size", default="tiny", choices=["tiny", "small", "medium"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_model_parsers(model_sub)

    gen = sub.add_parser("generate", help="complete prompts with the offline engine")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")

    chat = sub.add_parser("chat", help="one chat turn per --user message, with the chat template")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--user", action="append", required=True, help="user message (repeatable)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--lora", default=None, metavar="NAME", help="run through this --lora-modules adapter"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per output")


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from kvrelay.engine.make_tiny import make_tiny

    path = make_tiny(args.dir, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype)
    print(path)
    return 0


def _sampling(args: argparse.Namespace):
    from kvrelay.protocol.sampling_params import SamplingParams

    names = [name for name, _ in lora_modules(args)]
    if args.lora is not None and args.lora not in names:
        raise SystemExit(f"kvrelay: error: --lora {args.lora!r} is not among --lora-modules")
    return SamplingParams(
        lora_name=args.lora,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _print_outputs(outputs: list, as_json: bool) -> None:
    for out in outputs:
        comp = out.outputs[0]
        if as_json:
            print(
                json.dumps(
                    {
                        "prompt": out.prompt,
                        "text": comp.text,
                        "token_ids": comp.token_ids,
                        "finish_reason": comp.finish_reason,
                    }
                )
            )
        else:
            print(comp.text)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm import LLM

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("kvrelay generate: no prompts given", file=sys.stderr)
        return 2
    params = _sampling(args)
    llm = LLM(args.model, **engine_kwargs(args))
    _print_outputs(llm.generate(prompts, params), args.json)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm import LLM

    system = [{"role": "system", "content": args.system}] if args.system else []
    conversations = [[*system, {"role": "user", "content": u}] for u in args.user]
    params = _sampling(args)
    llm = LLM(args.model, **engine_kwargs(args))
    _print_outputs(llm.chat(conversations, params), args.json)
    return 0
