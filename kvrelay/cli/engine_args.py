"""Engine options on the command line: which flags every engine-running command takes.

Decides the engine flags of ``generate``, ``chat``, ``up`` and ``serve``, and how they turn
into ``LLM``/engine keyword arguments or back into ``kvrelay serve`` words for child processes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, TypeVar

from kvrelay import envs
from kvrelay.protocol.lora_modules import parse_lora_modules
from kvrelay.protocol.pooling import PoolerConfig
from kvrelay.protocol.speculative import SpeculativeConfig

T = TypeVar("T")

# engine.config.SCHEDULING_POLICIES, which validates them: not imported here, since importing
# kvrelay.engine loads torch, and the router's command line is parsed here too
SCHEDULING_POLICIES = ("fcfs", "priority")


def add_engine_args(p: argparse.ArgumentParser, from_env: bool = False) -> None:
    """The engine options; with ``from_env`` the deployment ones also read the environment."""
    if from_env:
        envs.add_option(p, "KVRELAY_MODEL")
    else:
        p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights, KV and compute [env KVRELAY_CPU_PACKED_WEIGHTS: a CPU engine keeps a "
        "packed copy of the weights for steps of many rows, at twice their memory; "
        "unset: when the copy fits in a quarter of the memory available, on a thread after "
        "the engine starts, 1: always, before it starts, 0: never; env "
        "KVRELAY_CPU_PACKED_KERNEL: the copy's kind, panels (kvrelay's, the faster on AVX2 and "
        "AVX-512 CPUs whose bfloat16 is no faster than float32), onednn, or auto: panels on "
        "such a CPU]",
    )
    if from_env:
        envs.add_option(p, "KVRELAY_DEVICE")
    else:
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (weights, KV, compute)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of torch and of the native decode-step kernels "
        "[env KVRELAY_NATIVE_MATMUL=0: torch's matmuls instead; "
        "env KVRELAY_NATIVE_ATTENTION=0: torch's decode attention, on CPU and CUDA; "
        "env KVRELAY_CPU_MALLOC_REUSE=0: glibc's malloc policy, fresh pages for each step; "
        "env KVRELAY_CUDA_GRAPHS=0: a CUDA engine runs every step without CUDA graphs; "
        "env KVRELAY_MIXED_GRAPHS=0: its prompt and mixed steps without them; "
        "env KVRELAY_TRITON_PREFILL=0: a CUDA engine's prefill through torch's SDPA; "
        "env KVRELAY_TRITON_ROWS=0: a CUDA layer's small ops in torch, not Triton; "
        "env KVRELAY_GRAMMAR_WARM_UP=0: xgrammar's tables on the first structured request, "
        "not on a thread at start]",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (default: from memory) [env KVRELAY_HUGE_PAGES=0: a CPU pool on "
        "4 KiB pages, not 2 MiB]",
    )
    if from_env:
        envs.add_option(p, "KVRELAY_KV_CACHE_GIB")
    else:
        p.add_argument(
            "--kv-cache-memory",
            type=float,
            default=1.0,
            help="GiB for the KV pool when --num-blocks is unset",
        )
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (chunked prefill)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context window cap")
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: arrival order; priority: requests' 'priority' (lower first), then arrival,"
        " preempting less urgent running ones (vLLM's policies)",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="disable reuse of cached prompt blocks"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve beside the base model (PEFT directories: "
        "adapter_config.json, adapter_model.safetensors); a request names one as its 'model'",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\' drafts up to 3 tokens a decode step from the '
        "sequence's own earlier n-grams (prompt_lookup_min..prompt_lookup_max tokens, default "
        "2..4; disable_by_batch_size N: no drafts once N requests run); output is unchanged",
    )
    p.add_argument(
        "--pooler-config",
        default=None,
        metavar="JSON",
        help='how /v1/embeddings pools, vLLM\'s keys: \'{"pooling_type": "MEAN", "normalize": '
        "false}' (LAST, MEAN or CLS; default: the checkpoint's sentence-transformers "
        "modules.json, else the last token's state, normalized)",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """``--speculative-config`` checked; argparse's error naming what is wrong."""
    return _parsed(args.speculative_config, SpeculativeConfig.parse)


def pooler_config(args: argparse.Namespace) -> PoolerConfig | None:
    """``--pooler-config`` checked; argparse's error naming what is wrong."""
    return _parsed(args.pooler_config, PoolerConfig.parse)


def _parsed(text: str | None, parse: Callable[[str], T]) -> T | None:
    """A JSON flag's setting (None when not given); the parser's ValueError as argparse's."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise SystemExit(f"kvrelay: error: {exc}") from None


def lora_modules(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` as (name, path) pairs; argparse's error for a malformed item."""
    try:
        return parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        raise SystemExit(f"kvrelay: error: {exc}") from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "num_threads": args.threads,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "kv_cache_memory_bytes": int(args.kv_cache_memory * (1 << 30)),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "scheduling_policy": args.scheduling_policy,
        "lora_modules": lora_modules(args),
        "speculative_config": speculative_config(args),
        "pooler_config": pooler_config(args),
    }


def engine_cli_args(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as command-line words for ``kvrelay serve``."""
    out = [
        "--dtype", args.dtype,
        "--device", args.device,
        "--seed", str(args.seed),
        "--block-size", str(args.block_size),
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--scheduling-policy", args.scheduling_policy,
    ]  # fmt: skip
    for flag, value in (
        ("--threads", args.threads),
        ("--num-blocks", args.num_blocks),
        ("--max-model-len", args.max_model_len),
    ):
        if value is not None:
            out += [flag, str(value)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    spec = speculative_config(args)
    if spec is not None:
        out += ["--speculative-config", spec.to_json()]
    pooler = pooler_config(args)
    if pooler is not None:
        out += ["--pooler-config", pooler.to_json()]
    if args.lora_modules:  # absolute: the workers may start elsewhere
        out += ["--lora-modules", *(f"{n}={os.path.abspath(p)}" for n, p in lora_modules(args))]
    return out
