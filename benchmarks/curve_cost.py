"""What CURVE costs a KV transfer: tcp pulls from one source over a CURVE and a plain socket.

The source process of ``transfer.py`` (spawned: a real second process) serves one shared
pool on two ROUTER sockets: one a CURVE server with the cluster's ZAP check (how every worker
peer socket runs by default), one plain (``--insecure-no-auth``). This process pulls the same
lease through a ``TcpTransport`` that is a CURVE client and one that is not, round-robin, so
both see the same background load. A pull's time is everything decode waits for: request,
gather, socket (encryption and decryption with CURVE), copy and checksum verification.

    python benchmarks/curve_cost.py                 # writes its section of BENCHMARKS.md
    python benchmarks/curve_cost.py --quick --no-write
"""

# ruff: noqa: E402  (torch is imported after the OpenMP wait policy is set)
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import uuid
from collections.abc import Sequence

from kvrelay import envs

envs.use_passive_openmp_wait()

import torch
from common import (
    add_model_args,
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    median,
    update_benchmarks_md,
)
from transfer import (
    BLOCK_SIZE,
    CREDENTIAL,
    FINGERPRINT,
    PULL_TIMEOUT_S,
    Shape,
    block_ids,
    interleaved_seconds,
    layout_for,
    shapes_of,
    start_source,
)

from kvrelay.transport.blocks import layout_of, pool_shape, transfer_bytes
from kvrelay.transport.curve import SocketSecurity
from kvrelay.transport.registry import create_transport
from kvrelay.transport.shm_pool import cleanup_segments, segment_name

SECTION_TITLE = "CURVE on the tcp KV transfer"
HEADERS = ["model", "tokens", "MiB", "plain GB/s", "CURVE GB/s", "CURVE / plain"]


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    size: str
    tokens: int
    num_bytes: int
    plain_gbps: float
    curve_gbps: float


def measure(shape: Shape, tokens_list: Sequence[int], repeats: int, cluster: str) -> list[Row]:
    size = shape.name
    num_blocks = 2 * math.ceil(max(tokens_list) / BLOCK_SIZE) + 8
    layout = layout_for(shape, num_blocks)
    name = segment_name(cluster, f"src-{uuid.uuid4().hex[:6]}", "kv")
    source = start_source(layout, name, seed=1)
    dst_pool = torch.zeros(pool_shape(layout), dtype=getattr(torch, shape.dtype))
    dst_layout = layout_of(dst_pool)
    secure = create_transport("tcp", security=SocketSecurity(CREDENTIAL))
    plain = create_transport("tcp", security=SocketSecurity(None))
    rows = []
    try:
        for tokens in tokens_list:
            num = math.ceil(tokens / BLOCK_SIZE)
            ids = block_ids("contiguous", num, num_blocks, seed=tokens)
            spec = source.lease(f"{size}-{tokens}", ids)
            plain_spec = dataclasses.replace(
                spec, src=dataclasses.replace(spec.src, peer_addr=source.plain_addr)
            )
            fns = {
                name: functools.partial(
                    transport.pull,
                    pull_spec,
                    dst_pool,
                    ids,
                    dst_layout,
                    FINGERPRINT,
                    PULL_TIMEOUT_S,
                )
                for name, transport, pull_spec in (
                    ("curve", secure, spec),
                    ("plain", plain, plain_spec),
                )
            }
            seconds, _ = interleaved_seconds(fns, repeats)
            num_bytes = transfer_bytes(dst_layout, num)
            gbps = {k: num_bytes / median(v) / 1e9 for k, v in seconds.items()}
            rows.append(Row(size, tokens, num_bytes, gbps["plain"], gbps["curve"]))
    finally:
        secure.close()
        plain.close()
        source.stop()
    return rows


def table(rows: Sequence[Row]) -> list[list[str]]:
    return [
        [
            r.size,
            str(r.tokens),
            f"{r.num_bytes / 2**20:.1f}",
            f"{r.plain_gbps:.2f}",
            f"{r.curve_gbps:.2f}",
            f"{r.curve_gbps / r.plain_gbps:.2f}",
        ]
        for r in rows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per case (median)")
    add_model_args(parser)
    parser.add_argument("--quick", action="store_true", help="small model, 256 tokens")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = (256,) if args.quick else (256, 2048)
    cluster = f"curve{uuid.uuid4().hex[:8]}"
    try:
        rows = [
            r for shape in shapes_of(args) for r in measure(shape, tokens, args.repeats, cluster)
        ]
    finally:
        cleanup_segments(f"kvrelay-{cluster}-")
    print(markdown_table(HEADERS, table(rows)))
    if not args.no_write:
        body = "\n\n".join(
            [
                "tcp pulls of the same lease from one source process over a CURVE socket (the "
                "default: authenticated, encrypted) and a plain one (`--insecure-no-auth`), "
                f"round-robin, median of {args.repeats}; contiguous blocks, {args.dtype}, "
                "loopback. GB/s = KV bytes per second. CURVE encrypts and authenticates every "
                "frame (XSalsa20-Poly1305) in ZMQ's I/O thread on both ends, so the bytes of "
                "one connection go through one core each way. Same-host hand-offs (shm, "
                "cuda_ipc) move no KV bytes over a socket and pay only for the small control "
                "messages. The 1-minute load average "
                f"was {os.getloadavg()[0]:.1f} at the end (the machine is shared).",
                markdown_table(HEADERS, table(rows)),
                machine_markdown(machine_info(torch.get_num_threads())),
            ]
        )
        print(f"wrote {update_benchmarks_md(SECTION_TITLE, body, command_line(__file__))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
