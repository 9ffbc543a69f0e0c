"""Scale-up: start an instance to its first served token, weights from disk vs pool vs peer.

Part 1, per model, on one cluster (router, 1 prefill and 1 decode worker, ``--threads 1``):
for each mode, retire the current prefill worker (drain, SIGTERM), evict the checkpoint from
the page cache, start one prefill worker with the mode's flags and time from ``add_worker``
to the first streamed token of a 1-token completion that only it can serve (checked with
its device-cache counters; its log must show the pool event the mode expects). Modes, in
this order in every repeat:

- ``disk``: ``--no-param-pool``, the weights come from the checkpoint;
- ``build``: the first instance on a host: no pool yet, it builds the host's pool from disk;
- ``pool``: the host's pool is ready (built by the previous worker): attach;
- ``peer``: no pool on this host; ``--param-peers`` names a ``kvrelay pool serve`` of the
  same model under another ``--scope`` (another host, emulated on this one), so the worker
  fills this host's pool over ZMQ (TCP loopback) instead of reading the disk.

The cluster's router and original workers load a byte copy of the checkpoint (same name and
fingerprint, other files) with ``--no-param-pool``: they never hold the host's pool, and no
running process maps the measured files, so ``posix_fadvise(DONTNEED)`` really evicts them
(``fincore`` checks). The breakdown: ``ready`` (the worker's "ready" log line), ``joined``
(the router lists it), and the weights' time, logged by the worker for ``build`` / ``peer``
and measured in this process for ``disk`` (``load_weights``, file evicted) and ``pool``.

Part 2: ``ParamPool.attach_or_create`` alone on a ready pool, ``--attach-repeats`` times
(goal: under 100 ms and flat in model size).

Part 3: chain multicast of the largest pool whose copies fit in memory, from the same
``kvrelay pool serve`` (after that model's starts) to 1, 2, 4 receivers, each a process with
its own scope that forwards while it fills (``plan_chain`` order). Receivers start, import
and fingerprint the model, then all start fetching at one signal; the time is from the
signal to the last receiver's pool ready (goal: 4 receivers under 1.5x the time of 1). The
receivers of every chain size start together (in the first repeat, with the origin) and are
all ready, idle, before the first chain of the repeat is timed.
Two conditions, each with its own origin: unlimited (loopback TCP as fast as the CPUs go:
every "host" shares this machine's cores, so the run is CPU-bound) and link-limited
(``--link-mbps``: the origin and every forwarding receiver send at most that rate, a token
bucket per server as one NIC per host; ``--link-mbps 0`` leaves this condition out).

Checkpoints: make_tiny ``small`` / ``medium`` (float32), and a random Llama of 1.0B
parameters (TinyLlama's shape, the small tokenizer's vocabulary, bfloat16) written once into
``--cache-dir`` and kept there. Each run links them into a temporary directory with a
per-run key in ``config.json``, so the run's pool names collide with no other process's.
Before each timed start or chain, the script waits up to ``--quiet-wait`` s for idle CPUs.

    python benchmarks/scale_up.py               # small, medium, 1b; writes BENCHMARKS.md
    python benchmarks/scale_up.py --quick --no-write
    python benchmarks/scale_up.py --chain-only --no-write --json out.json   # part 3 alone
    python benchmarks/scale_up.py --render out.json    # report a saved --json again
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import command_line, machine_info, text_table, update_benchmarks_md, write_json
from scale_up_measure import (
    MODES,
    ChainRun,
    StartRun,
    measure_attach,
    measure_import,
    pick_chain_model,
    run_chains,
    run_starts,
)
from scale_up_report import chain_notes, markdown_body, verdicts
from scale_up_setup import MODELS, pool_server, prepare_checkpoints
from scale_up_tables import (
    ATTACH_HEADERS,
    CHAIN_HEADERS,
    START_HEADERS,
    attach_rows,
    chain_bytes,
    chain_rows,
    mib,
    parse_results,
    start_rows,
)

SECTION_TITLE = "Scale-up: start to first token (disk vs host pool vs peer) and chain multicast"
DEFAULT_LINK_MBPS = 400.0  # the modelled link: well below this machine's aggregate / 4


# ---------------------------------------------------------------------------- main


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(v.strip()) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_csv(str), default=None, help=f"from {', '.join(MODELS)}")
    p.add_argument("--skip-1b", action="store_true", help="leave out the 1B checkpoint")
    p.add_argument("--modes", type=_csv(str), default=list(MODES), help=", ".join(MODES))
    p.add_argument("--receivers", type=_csv(int), default=None, help="chain sizes (1,2,4)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per measurement (3)")
    p.add_argument("--attach-repeats", type=int, default=None, help="pool attaches timed (20)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    p.add_argument("--quiet-wait", type=float, default=None, help="max s to wait for idle CPUs")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the 1B checkpoint is written once and kept (default: the temp dir)",
    )
    p.add_argument(
        "--link-mbps",
        type=float,
        default=DEFAULT_LINK_MBPS,
        help="chain: also run every chain with each server sending at most this many "
        f"megabits/s, one modelled NIC per host (default {DEFAULT_LINK_MBPS:g}; 0: only the "
        "unlimited loopback condition)",
    )
    p.add_argument(
        "--chain-only", action="store_true", help="measure part 3 (chain multicast) alone"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat, chain 1 and 2")
    p.add_argument("--log-dir", type=Path, default=None, help="default: a temporary dir")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--render", type=Path, help="measure nothing: report a saved --json")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "models": ["tiny"] if quick else ["small", "medium", "1b"],
        "receivers": [1, 2] if quick else [1, 2, 4],
        "repeats": 1 if quick else 3,
        "attach_repeats": 5 if quick else 20,
        "quiet_wait": 0.0 if quick else 20.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.skip_1b:
        args.models = [m for m in args.models if m != "1b"]
    bad = [m for m in args.models if m not in MODELS] + [m for m in args.modes if m not in MODES]
    if bad or not args.models:
        p.error(f"unknown models or modes {bad}; models: {MODELS}, modes: {MODES}")
    if min(args.repeats, args.attach_repeats, *args.receivers, 1) < 1:
        p.error("--repeats, --attach-repeats and --receivers must be >= 1")
    if args.link_mbps < 0:
        p.error("--link-mbps must be >= 0 (0: no link-limited condition)")
    if args.chain_only and not args.receivers:
        p.error("--chain-only needs --receivers")
    args.modes = [m for m in MODES if m in args.modes]
    return args


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ckpts = prepare_checkpoints(args.models, work / "models", args.cache_dir)
    log_dir = args.log_dir or work / "logs"
    load_start = os.getloadavg()[0]
    chain_ckpt = pick_chain_model(ckpts, max(args.receivers)) if args.receivers else None
    import_s = None if args.chain_only else measure_import(args.repeats)
    attach = [] if args.chain_only else [measure_attach(c, args) for c in ckpts]
    starts: list[StartRun] = []
    chain: list[ChainRun] = []
    for c in ckpts:
        if not args.chain_only:  # the pool server is the peer of the starts
            with pool_server(c, f"peer{os.getpid()}", log_dir / c.name) as server:
                starts += run_starts(c, server, args, log_dir / c.name)
        if c is chain_ckpt:
            chain = run_chains(c, args, log_dir / "chain")
    keys = ("repeats", "attach_repeats", "num_blocks", "link_mbps", "chain_only")
    settings = {k: getattr(args, k) for k in keys}
    return {
        "command": command_line(),
        "settings": {**settings, "cache_dir": str(args.cache_dir)},
        "checkpoints": [{**asdict(c), "path": str(c.path), "twin": str(c.twin)} for c in ckpts],
        "machine": machine_info(1),
        "load_average": (load_start, os.getloadavg()[0]),
        "import_s": import_s,
        "starts": [asdict(r) for r in starts],
        "attach": [asdict(a) for a in attach],
        "chain_model": chain_ckpt.name if chain_ckpt else None,
        "chain": [asdict(r) for r in chain],
    }


def report(result: dict[str, Any], json_path: Path | None, write_md: bool) -> None:
    r = parse_results(result)
    by_model = {a.model: a for a in r.attach}
    if r.starts:
        print()
        print(text_table(START_HEADERS, start_rows(r.ckpts, r.starts, by_model)))
    if r.attach:
        print()
        print(text_table(ATTACH_HEADERS, attach_rows(r.attach)))
    if r.chain_ckpt is not None:
        print(f"\nchain: {r.chain_ckpt.name}, {mib(r.chain_ckpt.num_bytes)} MiB")
        print(text_table(CHAIN_HEADERS, chain_rows(r.chain_ckpt, r.chain)))
    print()
    print("\n".join(verdicts(r.attach, r.starts, r.chain, chain_bytes(r))))
    if r.chain_ckpt is not None and r.chain:
        print()
        print(chain_notes(r, result["machine"]["num_cpus"]))
    if json_path is not None:
        write_json(json_path, result)
    if write_md:
        path = update_benchmarks_md(SECTION_TITLE, markdown_body(result), result["command"])
        print(f"\nwrote section {SECTION_TITLE!r} of {path}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. under nohup) unwinds like Ctrl-C, so every process and pool is cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.render is not None:
        report(json.loads(args.render.read_text()), None, write_md=not args.no_write)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvrelay-scale-up-") as tmp:
        result = run_all(args, Path(tmp))
    report(result, args.json, write_md=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
