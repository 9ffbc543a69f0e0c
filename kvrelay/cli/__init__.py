"""The ``kvrelay`` command: one parser over every subcommand, and the dispatch to them.

Decides which subcommands exist and how one runs: options left unset are filled from the
environment (``kvrelay.envs``), and a ``ValueError`` is a one-line error with exit status 2.
Each command group lives in its own module: ``offline`` (model make-tiny, generate, chat),
``model`` (model import-gguf, get, ls),
``cluster`` (up, serve), ``host_admin`` (pool, cache); ``engine_args`` holds the engine flags
they share. ``kvrelay = kvrelay.cli:main`` is the console script.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay import envs
from kvrelay.cli.cluster import (
    add_cluster_parsers,
    autoscale_policy,
    autoscale_router_args,
    cmd_serve,
    cmd_up,
)
from kvrelay.cli.engine_args import engine_cli_args, engine_kwargs
from kvrelay.cli.host_admin import add_cache_parser, add_pool_parser, cmd_cache, cmd_pool
from kvrelay.cli.model import cmd_model
from kvrelay.cli.offline import add_offline_parsers, cmd_chat, cmd_generate, cmd_make_tiny
from kvrelay.cli.secret import add_secret_parser, cmd_secret

__all__ = [
    "COMMANDS",
    "autoscale_policy",
    "autoscale_router_args",
    "build_parser",
    "cmd_bench",
    "cmd_cache",
    "cmd_chat",
    "cmd_generate",
    "cmd_make_tiny",
    "cmd_model",
    "cmd_pool",
    "cmd_secret",
    "cmd_serve",
    "cmd_sim",
    "cmd_up",
    "engine_cli_args",
    "engine_kwargs",
    "main",
    "parse_args",
]

DESCRIPTION = "kvrelay: a disaggregated LLM serving cluster (router, prefill and decode workers)."

logger = logging.getLogger("kvrelay")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    envs.add_option(parser, "KVRELAY_LOG_LEVEL")
    envs.add_option(parser, "KVRELAY_CACHE_DIR")
    sub = parser.add_subparsers(dest="command", required=True)
    add_offline_parsers(sub)
    add_cluster_parsers(sub)
    _add_bench_parser(sub)
    add_pool_parser(sub)
    add_cache_parser(sub)
    add_secret_parser(sub)
    _add_sim_parser(sub)
    return parser


def _add_bench_parser(sub: Any) -> None:
    from kvrelay.cli.bench import add_bench_args

    bench = sub.add_parser(
        "bench", help="Poisson load against a server: TTFT, TPOT, throughput and goodput"
    )
    add_bench_args(bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvrelay.cli.bench import run_cli

    return run_cli(args)


def _add_sim_parser(sub: Any) -> None:
    from kvrelay.sim.cli import add_sim_parser

    add_sim_parser(sub)


def cmd_sim(args: argparse.Namespace) -> int:
    from kvrelay.sim.cli import cmd_sim as run

    return run(args)


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "up": cmd_up,
    "bench": cmd_bench,
    "pool": cmd_pool,
    "cache": cmd_cache,
    "model": cmd_model,
    "secret": cmd_secret,
    "sim": cmd_sim,
}


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The command line with options left unset filled from ``environ`` (default: this
    process's environment), then from the defaults in ``kvrelay.envs``."""
    parser = build_parser()
    _remember_parsers(parser)
    args, extra = parser.parse_known_args(argv)
    command_parser = args.__dict__.pop("_parser", parser)
    if extra:  # the command's own usage, not the top level's
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        envs.apply(args, args.command, environ)
    except envs.EnvError as e:
        command_parser.error(str(e))
    return args


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command's parser records itself in the namespace (``_parser``), the deepest
    one last, so an error can show the usage of the command that was typed."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.set_defaults(_parser=subparser)
                _remember_parsers(subparser)


def main(argv: Sequence[str] | None = None) -> int:
    envs.use_passive_openmp_wait()  # before any command imports torch
    args = parse_args(argv)
    os.environ["KVRELAY_CACHE_DIR"] = args.cache_dir  # read by this process and its workers
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:  # ConfigError, CheckpointError, TokenizerError and bad values
        print(f"kvrelay {args.command}: error: {e}", file=sys.stderr)
        return 2
