"""``kvrelay pool`` and ``kvrelay cache``: administration of this host's shared memory.

Decides the options and output of listing, freeing and garbage-collecting parameter pools and
L1 KV block pools, and of serving or fetching a parameter pool between hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from kvrelay.cli.secret import add_auth_options, load_credential


def add_pool_parser(sub: Any) -> None:
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
        add_auth_options(p)
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


def add_cache_parser(sub: Any) -> None:
    cache = sub.add_parser("cache", help="the host's L1 KV block pools (shared memory)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("ls", help="list L1 pools: size, block format, blocks held, users")
    rm = cache_sub.add_parser(
        "rm", help="free an L1 pool (refused while processes map it); its blocks are lost"
    )
    rm.add_argument("name", help="pool name, as `kvrelay cache ls` shows it")
    rm.add_argument("--force", action="store_true", help="free it even while processes map it")


def cmd_cache(args: argparse.Namespace) -> int:
    from kvrelay.cachetier import host_ops

    if args.cache_command == "ls":
        row = "{:<44} {:>9} {:<34} {:>15} {}"
        print(row.format("NAME", "MIB", "FORMAT (L,BS,KVH,D,DTYPE)", "BLOCKS", "PIDS"))
        for p in host_ops.list_host_pools():
            fmt = "?" if p.fmt is None else dataclasses.astuple(p.fmt)
            fmt_text = "unknown layout" if fmt == "?" else ",".join(map(str, fmt))
            blocks = f"{p.valid_slots}/{p.num_slots}"
            pids = ",".join(map(str, p.pids)) or "-"
            print(row.format(p.name, f"{p.total_bytes / 2**20:.1f}", fmt_text, blocks, pids))
        return 0
    try:
        if not host_ops.remove_host_pool(args.name, force=args.force):
            print(f"kvrelay cache rm: error: no pool named {args.name}", file=sys.stderr)
            return 1
    except (host_ops.PoolInUse, ValueError) as e:
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
    from kvrelay.cachetier import param_locks, param_ops

    if args.pool_command == "ls":
        row = "{:<52} {:<16} {:<8} {:>9} {:<8} {:<6} {:<6} {}"
        header = ("NAME", "IDENTITY", "DTYPE", "MIB", "STATE", "USERS", "IDLE_S", "SOURCE")
        print(row.format(*header))
        for p in param_ops.list_pools(args.scope):
            idle = p.idle_s()
            users = ",".join(map(str, p.user_pids)) or "-"
            size, idle_s = f"{p.num_bytes / 2**20:.1f}", "-" if idle is None else f"{idle:.0f}"
            identity, dtype = p.fingerprint[:16] or "-", p.dtype or "-"  # "": unknown
            source = p.source or "-"
            print(row.format(p.name, identity, dtype, size, p.state, users, idle_s, source))
        return 0
    if args.pool_command in ("serve", "fetch"):
        return _pool_transfer(args)
    if args.pool_command == "gc":
        for name in param_ops.gc(args.grace, args.scope):
            print(name)
        return 0
    try:
        if not param_ops.remove(args.name, force=args.force):
            print(f"kvrelay pool rm: error: no pool named {args.name}", file=sys.stderr)
            return 1
    except param_locks.PoolBusy as e:
        print(f"kvrelay pool rm: error: {e}", file=sys.stderr)
        return 1
    print(args.name)
    return 0


def _pool_transfer(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvrelay.cachetier.param_pool import ParamPool
    from kvrelay.cachetier.param_transfer import fetch_pool, serve_pool
    from kvrelay.engine.identity import model_identity
    from kvrelay.transport.curve import SocketSecurity
    from kvrelay.transport.rate_limit import mbps_to_bytes_per_s

    security = SocketSecurity(load_credential(args, "the pool's chain socket"))
    link = mbps_to_bytes_per_s(args.link_mbps)
    if args.pool_command == "fetch":
        sources = [a.strip() for a in args.sources.split(",") if a.strip()]
        got = fetch_pool(
            model_identity(args.model, args.dtype),
            args.dtype,
            sources,
            scope=args.scope,
            forward_bind=args.forward_bind,
            timeout=args.timeout,
            link_bytes_per_s=link,
            security=security,
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
        server = serve_pool(pool, args.bind, link_bytes_per_s=link, security=security)
        print(f"{pool.name}: serving at {server.addr}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.close()
    pool.close()
    from kvrelay.cli.cluster import exit_without_finalizing

    exit_without_finalizing(0)  # the pool and its socket are closed; torch's graph stays
