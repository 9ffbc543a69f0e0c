"""kvrelay: a disaggregated LLM serving cluster (router, prefill and decode workers)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay import envs

logger = logging.getLogger("kvrelay")


def _add_engine_args(p: argparse.ArgumentParser, from_env: bool = False) -> None:
    """The engine options; with ``from_env`` the deployment ones also read the environment."""
    if from_env:
        envs.add_option(p, "KVRELAY_MODEL")
    else:
        p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
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
        "--no-prefix-caching", action="store_true", help="disable reuse of cached prompt blocks"
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "seed": args.seed,
        "num_threads": args.threads,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "kv_cache_memory_bytes": int(args.kv_cache_memory * (1 << 30)),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
    }


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    envs.add_option(parser, "KVRELAY_LOG_LEVEL")
    sub = parser.add_subparsers(dest="command", required=True)

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

    gen = sub.add_parser("generate", help="complete prompts with the offline engine")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")

    chat = sub.add_parser("chat", help="one chat turn per --user message, with the chat template")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--user", action="append", required=True, help="user message (repeatable)")
    up = sub.add_parser(
        "up", help="start router + workers as local processes (the embedded default)"
    )
    _add_engine_args(up)
    up.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    up.add_argument(
        "--colocated", type=int, default=0, help="colocated workers (no hand-off) instead"
    )
    up.add_argument("--host", default="127.0.0.1", help="bind address of every process")
    up.add_argument("--port", type=int, default=8000, help="router HTTP port (0: any free)")
    up.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    up.add_argument("--log-dir", default=None, help="one log file per process (default: stderr)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    up.add_argument(
        "--autoscale", action="store_true", help="the router adds and removes local workers"
    )
    _add_autoscale_args(up)

    serve = sub.add_parser(
        "serve",
        help="run one cluster process (router or worker)",
        epilog="Options marked [env KVRELAY_...] may come from that environment variable "
        "instead. Precedence: flag > environment variable > default. README.md lists every "
        "variable.",
    )
    serve.add_argument(
        "--role", required=True, choices=["router", "prefill", "decode", "colocated"]
    )
    _add_engine_args(serve, from_env=True)
    _add_serve_args(serve)
    from kvrelay.autoscale.registry import HOOK_NAMES

    serve.add_argument(
        "--autoscale", default="off", choices=["off", *HOOK_NAMES], help="router: scaling hook"
    )
    serve.add_argument("--autoscale-options", default="{}", help="router: hook options (JSON)")
    _add_autoscale_args(serve)
    _add_bench_parser(sub)
    _add_pool_parser(sub)
    _add_cache_parser(sub)
    return parser


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    for name in (
        "KVRELAY_HOST", "KVRELAY_ADVERTISE_HOST", "KVRELAY_PORT", "KVRELAY_CONTROL_ADDR",
        "KVRELAY_STATUS_PORT", "KVRELAY_PEER_PORT", "KVRELAY_CLUSTER_ID", "KVRELAY_INSTANCE_ID",
        "KVRELAY_TRANSPORT", "KVRELAY_HOST_ID", "KVRELAY_SERVED_MODEL_NAME",
        "KVRELAY_ADMIN_TOKEN",
    ):  # fmt: skip
        envs.add_option(p, name)
    p.add_argument("--dead-after", type=float, default=2.0, help="router: heartbeat timeout (s)")
    p.add_argument("--lease-ttl", type=float, default=30.0, help="prefill: KV lease (s)")
    p.add_argument(
        "--host-pool",
        default="auto",
        help="worker: L1 host shared-memory KV pool name ('auto': one per host and model; "
        "'off': none)",
    )
    p.add_argument(
        "--host-pool-memory", type=float, default=0.25, help="worker: L1 pool size in GiB"
    )
    envs.add_option(p, "KVRELAY_REDIS_URL")
    p.add_argument(
        "--param-peers",
        default="",
        help="worker: hosts serving the weights (`kvrelay pool serve`), nearest first; used "
        "when this host has no parameter pool yet, before falling back to disk",
    )
    p.add_argument(
        "--no-param-pool",
        action="store_true",
        help="worker: load weights from disk instead of the host's parameter pool",
    )
    p.add_argument("--corrupt-transfers", type=int, default=0, help=argparse.SUPPRESS)


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    for role in ("prefill", "decode"):
        p.add_argument(f"--min-{role}", type=int, default=None, help=f"autoscale: min {role}")
        p.add_argument(f"--max-{role}", type=int, default=None, help=f"autoscale: max {role}")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="autoscale: prefill SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="autoscale: decode SLO")
    p.add_argument("--autoscale-interval", type=float, default=2.0, help="seconds per decision")
    p.add_argument(
        "--autoscale-policy",
        default="{}",
        help='more policy settings as JSON, e.g. {"decode": {"cooldown_down_s": 30}}',
    )


def _json_object(text: str, flag: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def autoscale_policy(args: argparse.Namespace) -> Any:
    """The router's ``PolicyConfig`` from ``--autoscale-policy`` and the per-role flags."""
    from kvrelay.autoscale.policy import PolicyConfig

    policy = PolicyConfig.from_dict(_json_object(args.autoscale_policy, "--autoscale-policy"))
    policy = policy.with_target(
        "prefill", min_instances=args.min_prefill, max_instances=args.max_prefill,
        slo_ms=args.slo_ttft_ms,
    )  # fmt: skip
    return policy.with_target(
        "decode", min_instances=args.min_decode, max_instances=args.max_decode,
        slo_ms=args.slo_tpot_ms,
    )  # fmt: skip


def autoscale_router_args(args: argparse.Namespace, cluster_id: str) -> list[str]:
    """``kvrelay up --autoscale``: the router flags that let it scale with the local hook."""
    worker_args = [
        *engine_cli_args(args),
        "--transport", args.transport,
        "--host-pool", f"kvrelay-{cluster_id}-l1",  # the launcher's pool (host_pool_name)
    ]  # fmt: skip
    options = {"worker_args": worker_args, "log_dir": args.log_dir}
    out = [
        "--cluster-id", cluster_id,
        "--autoscale", "local",
        "--autoscale-options", json.dumps(options),
        "--autoscale-interval", str(args.autoscale_interval),
        "--autoscale-policy", args.autoscale_policy,
    ]  # fmt: skip
    limits = (
        "min_prefill",
        "max_prefill",
        "min_decode",
        "max_decode",
        "slo_ttft_ms",
        "slo_tpot_ms",
    )
    for name in limits:
        if getattr(args, name) is not None:
            out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def engine_cli_args(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as command-line words for ``kvrelay serve``."""
    out = [
        "--dtype", args.dtype,
        "--seed", str(args.seed),
        "--block-size", str(args.block_size),
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
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
    return out


def cmd_up(args: argparse.Namespace) -> int:
    from kvrelay.cluster.launcher import ClusterSpec, run_up

    default = 0 if args.colocated else 1
    router_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    cluster_id = ""
    if args.autoscale:
        if args.colocated:
            raise ValueError("--autoscale scales prefill and decode workers, not --colocated")
        cluster_id = f"up{os.getpid()}-{uuid.uuid4().hex[:6]}"
        router_args += autoscale_router_args(args, cluster_id)
    spec = ClusterSpec(
        model=args.model,
        num_prefill=default if args.prefill is None else args.prefill,
        num_decode=default if args.decode is None else args.decode,
        num_colocated=args.colocated,
        host=args.host,
        port=args.port,
        transport=args.transport,
        cluster_id=cluster_id,
        worker_args=tuple(engine_cli_args(args)),
        router_args=tuple(router_args),
        log_dir=args.log_dir,
    )
    return run_up(spec, args.timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.role == "router":
        from kvrelay.router.server import RouterConfig, run_router

        run_router(
            RouterConfig(
                model=args.model,
                control_addr=args.control_addr,
                host=args.host,
                port=args.port,
                served_model_name=args.served_model_name,
                admin_token=args.admin_token or None,
                max_model_len=args.max_model_len,
                dead_after=args.dead_after,
                cluster_id=args.cluster_id,
                autoscale=args.autoscale,
                autoscale_options=_json_object(args.autoscale_options, "--autoscale-options"),
                autoscale_policy=autoscale_policy(args),
                autoscale_interval=args.autoscale_interval,
            )
        )
        return 0
    from kvrelay.cluster.messages import Role
    from kvrelay.cluster.serve import run_worker
    from kvrelay.cluster.worker_config import WorkerConfig

    run_worker(
        WorkerConfig(
            role=Role(args.role),
            model=args.model,
            router_addr=args.control_addr,
            cluster_id=args.cluster_id,
            instance_id=args.instance_id,
            host=args.host,
            advertise_host=args.advertise_host,
            host_id=args.host_id,
            status_port=args.status_port,
            peer_port=args.peer_port,
            transport=args.transport,
            served_model_name=args.served_model_name,
            lease_ttl=args.lease_ttl,
            host_pool="" if args.host_pool == "off" else args.host_pool,
            host_pool_bytes=int(args.host_pool_memory * (1 << 30)),
            redis_url=args.redis_url,
            corrupt_transfers=args.corrupt_transfers,
            param_pool=not args.no_param_pool,
            param_peers=args.param_peers,
            engine_args=engine_kwargs(args),
        )
    )
    return 0


def _add_bench_parser(sub: Any) -> None:
    from kvrelay.bench import add_bench_args

    bench = sub.add_parser(
        "bench", help="Poisson load against a server: TTFT, TPOT, throughput and goodput"
    )
    add_bench_args(bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvrelay.bench import run_cli

    return run_cli(args)


def _add_pool_parser(sub: Any) -> None:
    pool = sub.add_parser("pool", help="the host's parameter pools (weights in shared memory)")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True)
    ls = pool_sub.add_parser("ls", help="list pools: size, state, live users, idle seconds")
    rm = pool_sub.add_parser("rm", help="free a pool (refused while it has live users)")
    rm.add_argument("name", help="pool name, as `kvrelay pool ls` shows it")
    rm.add_argument("--force", action="store_true", help="free it even with live users")
    serve = pool_sub.add_parser(
        "serve", help="make or attach this host's pool of a model and serve it to peer hosts"
    )
    fetch = pool_sub.add_parser(
        "fetch", help="fill this host's pool of a model from peer hosts (a chain), not from disk"
    )
    for p in (serve, fetch):
        p.add_argument("--model", required=True, help="checkpoint directory (names the pool)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--bind", default="tcp://0.0.0.0:5570", help="ZMQ address to serve on")
    for p in (serve, fetch):
        p.add_argument("--scope", default="", help=argparse.SUPPRESS)  # tests: hosts on one machine
    fetch.add_argument(
        "--from",
        dest="sources",
        required=True,
        help="peer addresses, nearest first, comma-separated",
    )
    fetch.add_argument(
        "--forward-bind", default=None, help="also serve the pool onward while it fills (chain)"
    )
    fetch.add_argument("--timeout", type=float, default=10.0, help="seconds before a peer is dead")
    for p in (serve, fetch):
        p.add_argument(
            "--link-mbps",
            type=_link_mbps,
            default=0.0,
            help="send at most this many megabits/s to peers, as a NIC of that rate would "
            "(token bucket; models a link on one machine); 0 = unlimited (default)",
        )
    gc = pool_sub.add_parser("gc", help="free stale pools and unused ones idle past --grace")
    gc.add_argument("--grace", type=float, default=300.0, help="seconds unused before freeing")
    for p in (ls, gc):
        p.add_argument("--scope", default="", help="only the pools of this scope (tests)")


def _add_cache_parser(sub: Any) -> None:
    cache = sub.add_parser("cache", help="the host's L1 KV block pools (shared memory)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("ls", help="list L1 pools: size, block format, blocks held, users")
    rm = cache_sub.add_parser(
        "rm", help="free an L1 pool (refused while processes map it); its blocks are lost"
    )
    rm.add_argument("name", help="pool name, as `kvrelay cache ls` shows it")
    rm.add_argument("--force", action="store_true", help="free it even while processes map it")


def cmd_cache(args: argparse.Namespace) -> int:
    from kvrelay.cachetier import host_pool

    if args.cache_command == "ls":
        row = "{:<44} {:>9} {:<34} {:>15} {}"
        print(row.format("NAME", "MIB", "FORMAT (L,BS,KVH,D,DTYPE)", "BLOCKS", "PIDS"))
        for p in host_pool.list_host_pools():
            fmt = "?" if p.fmt is None else dataclasses.astuple(p.fmt)
            fmt_text = "unknown layout" if fmt == "?" else ",".join(map(str, fmt))
            blocks = f"{p.valid_slots}/{p.num_slots}"
            pids = ",".join(map(str, p.pids)) or "-"
            print(row.format(p.name, f"{p.total_bytes / 2**20:.1f}", fmt_text, blocks, pids))
        return 0
    try:
        if not host_pool.remove_host_pool(args.name, force=args.force):
            print(f"kvrelay cache rm: error: no pool named {args.name}", file=sys.stderr)
            return 1
    except (host_pool.PoolInUse, ValueError) as e:
        print(f"kvrelay cache rm: error: {e}", file=sys.stderr)
        return 1
    print(args.name)
    return 0


def _link_mbps(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = unlimited), got {text}")
    return value


def cmd_pool(args: argparse.Namespace) -> int:
    from kvrelay.cachetier import param_pool

    if args.pool_command == "ls":
        row = "{:<52} {:<32} {:<8} {:>9} {:<8} {:<6} {}"
        print(row.format("NAME", "FINGERPRINT", "DTYPE", "MIB", "STATE", "USERS", "IDLE_S"))
        for p in param_pool.list_pools(args.scope):
            idle = p.idle_s()
            users = ",".join(map(str, p.user_pids)) or "-"
            size, idle_s = f"{p.num_bytes / 2**20:.1f}", "-" if idle is None else f"{idle:.0f}"
            fingerprint, dtype = p.fingerprint or "-", p.dtype or "-"  # "": unknown
            print(row.format(p.name, fingerprint, dtype, size, p.state, users, idle_s))
        return 0
    if args.pool_command in ("serve", "fetch"):
        return _pool_transfer(args)
    if args.pool_command == "gc":
        for name in param_pool.gc(args.grace, args.scope):
            print(name)
        return 0
    try:
        if not param_pool.remove(args.name, force=args.force):
            print(f"kvrelay pool rm: error: no pool named {args.name}", file=sys.stderr)
            return 1
    except param_pool.PoolBusy as e:
        print(f"kvrelay pool rm: error: {e}", file=sys.stderr)
        return 1
    print(args.name)
    return 0


def _pool_transfer(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvrelay.cachetier.param_pool import ParamPool
    from kvrelay.cachetier.param_transfer import fetch_pool, serve_pool
    from kvrelay.engine.loader import model_fingerprint
    from kvrelay.transport.rate_limit import mbps_to_bytes_per_s

    link = mbps_to_bytes_per_s(args.link_mbps)
    if args.pool_command == "fetch":
        sources = [a.strip() for a in args.sources.split(",") if a.strip()]
        got = fetch_pool(
            model_fingerprint(args.model),
            args.dtype,
            sources,
            scope=args.scope,
            forward_bind=args.forward_bind,
            timeout=args.timeout,
            link_bytes_per_s=link,
        )
        print(
            f"{got.pool.name}: {got.num_bytes / 2**20:.1f} MiB in {got.seconds:.2f} s", flush=True
        )
        pool, server = got.pool, got.server
        if server is None:
            pool.close()
            return 0
    else:
        pool = ParamPool.attach_or_create(args.model, args.dtype, scope=args.scope)
        server = serve_pool(pool, args.bind, link_bytes_per_s=link)
        print(f"{pool.name}: serving at {server.addr}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.close()
    pool.close()
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from kvrelay.engine.make_tiny import make_tiny

    path = make_tiny(args.dir, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype)
    print(path)
    return 0


def _sampling(args: argparse.Namespace):
    from kvrelay.engine.sampling_params import SamplingParams

    return SamplingParams(
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
    llm = LLM(args.model, **engine_kwargs(args))
    _print_outputs(llm.generate(prompts, _sampling(args)), args.json)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm import LLM

    system = [{"role": "system", "content": args.system}] if args.system else []
    conversations = [[*system, {"role": "user", "content": u}] for u in args.user]
    llm = LLM(args.model, **engine_kwargs(args))
    _print_outputs(llm.chat(conversations, _sampling(args)), args.json)
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "up": cmd_up,
    "bench": cmd_bench,
    "pool": cmd_pool,
    "cache": cmd_cache,
}


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The command line with options left unset filled from ``environ`` (default: this
    process's environment), then from the defaults in ``kvrelay.envs``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        envs.apply(args, args.command, environ)
    except envs.EnvError as e:
        parser.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "model":
            return cmd_make_tiny(args)
        return COMMANDS[args.command](args)
    except ValueError as e:  # ConfigError, CheckpointError, TokenizerError and bad values
        print(f"kvrelay {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
