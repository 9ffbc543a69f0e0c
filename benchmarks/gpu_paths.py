"""The CUDA paths: KV hand-off over CUDA IPC, and weights from disk or the pool to the GPU.

Runs only where torch sees a CUDA device (the lent GPU machine); ``--render`` rebuilds the
BENCHMARKS.md section from a saved ``--json`` anywhere.

KV over CUDA IPC: a spawned source process holds a CUDA pool of random float32 KV (the
``small`` and ``medium`` layouts, block size 16) and exports it; this process pulls 16, 256
and 2048 tokens of it with ``CudaIpcTransport`` into its own CUDA pool, contiguous or
scattered ids. A pull is what decode waits for: the device-to-device copies plus the checksum
of the destination blocks (one gather on the device, one copy to the host, the host hash).
Baselines in the same run: ``copy_`` of the same byte count between two device tensors, and
the checksum alone.

Weights to the GPU, per checkpoint (``small``, ``medium``, and a 1B bfloat16 one written once
into ``--cache-dir``): from disk (safetensors, page cache warm: the file was just read),
from the host parameter pool as pageable memory, and from the pool registered as pinned
(``param_device.copy_to_device``, what a worker on a GPU does).

    python benchmarks/gpu_paths.py --json /tmp/gpu.json            # on the GPU machine
    python benchmarks/gpu_paths.py --render /tmp/gpu.json          # writes BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from common import command_line, markdown_table, median, update_benchmarks_md, write_json

from kvrelay.engine.make_tiny import SIZES, make_tiny
from kvrelay.protocol.messages import KvLayout, PeerInfo, Role
from kvrelay.transport.base import PullSpec
from kvrelay.transport.blocks import PinnedStaging, pool_shape, transfer_bytes
from kvrelay.transport.checksum import kv_checksum
from kvrelay.transport.copier import SlabCopier
from kvrelay.transport.registry import create_transport

SECTION_TITLE = "GPU paths (CUDA IPC hand-off, weights to the device)"
TOKENS = (16, 256, 2048)
MODELS = ("small", "medium")
BLOCK_SIZE = 16
FINGERPRINT = b"gpu-paths-benchmark"


def layout_for(size: str, num_blocks: int) -> KvLayout:
    s = SIZES[size]
    return KvLayout(s.num_layers, num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, "float32")


def cuda_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` (synchronised before and after), after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


# -- KV over CUDA IPC ---------------------------------------------------------------------------


def _source_main(conn: Connection, layout: KvLayout) -> None:
    from kvrelay.transport.cuda_ipc import export_cuda_pool

    pool = torch.randn(pool_shape(layout), device="cuda")
    conn.send(export_cuda_pool(pool))
    while (ids := conn.recv()) is not None:
        conn.send(kv_checksum(pool, ids))


def measure_kv(size: str, repeats: int) -> list[dict[str, Any]]:
    max_blocks = max(TOKENS) // BLOCK_SIZE
    layout = layout_for(size, 4 * max_blocks)
    parent, child = mp.get_context("spawn").Pipe()
    source = mp.get_context("spawn").Process(target=_source_main, args=(child, layout))
    source.start()
    rows = []
    try:
        handle = parent.recv()
        src = PeerInfo("src", Role.PREFILL, "h", "tcp://x:1", "", handle, layout, FINGERPRINT)
        dst = torch.zeros(pool_shape(layout), device="cuda")
        transport = create_transport("cuda_ipc")
        staging, copier = PinnedStaging(), SlabCopier()  # as the transport's checksum uses
        rng = random.Random(0)
        for tokens in TOKENS:
            n = tokens // BLOCK_SIZE
            for pattern in ("contiguous", "scattered"):
                if pattern == "contiguous":
                    src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
                else:
                    src_ids = rng.sample(range(layout.num_blocks), n)
                    dst_ids = rng.sample(range(layout.num_blocks), n)
                parent.send(src_ids)
                spec = PullSpec("r", src, src_ids, parent.recv(), time.time() + 3600)
                num_bytes = transfer_bytes(layout, n)

                def pull(spec: PullSpec = spec, dst_ids: list[int] = dst_ids) -> None:
                    transport.pull(spec, dst, dst_ids, layout, FINGERPRINT, 30.0)

                a = torch.empty(num_bytes // 4, device="cuda")
                b = torch.empty_like(a)
                memcpy_s = cuda_time(lambda a=a, b=b: b.copy_(a), repeats)
                checksum_s = cuda_time(
                    lambda ids=dst_ids: kv_checksum(dst, ids, staging, copier), repeats
                )
                pull_s = cuda_time(pull, repeats)
                rows.append(
                    {
                        "size": size,
                        "tokens": tokens,
                        "pattern": pattern,
                        "num_bytes": num_bytes,
                        "memcpy_gbps": num_bytes / memcpy_s / 1e9,
                        "pull_gbps": num_bytes / pull_s / 1e9,
                        "pull_ms": pull_s * 1e3,
                        "checksum_ms": checksum_s * 1e3,
                    }
                )
                print(rows[-1], flush=True)
        transport.close()
        copier.close()
    finally:
        parent.send(None)
        source.join(timeout=30)
    return rows


# -- weights to the GPU ---------------------------------------------------------------------------


def checkpoints(work: Path, cache: Path, skip_1b: bool) -> list[tuple[str, Path, str]]:
    out = [(size, make_tiny(work / size, size=size, seed=0), "float32") for size in MODELS]
    if not skip_1b:
        from scale_up_setup import write_1b

        out.append(("1b", write_1b(cache), "bfloat16"))
    return out


def measure_weights(name: str, model_dir: Path, dtype: str, repeats: int) -> dict[str, Any]:
    from kvrelay.cachetier.param_device import copy_to_device
    from kvrelay.cachetier.param_ops import remove
    from kvrelay.cachetier.param_pool import ParamPool
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.loader import load_weights

    config = ModelConfig.from_dir(model_dir)

    def from_disk() -> None:
        weights = load_weights(model_dir, config, dtype)
        {k: v.to("cuda") for k, v in weights.items()}

    disk_s = cuda_time(from_disk, repeats)
    pool = ParamPool.attach_or_create(model_dir, dtype, scope=f"bench_{uuid.uuid4().hex[:8]}")
    try:
        num_bytes = pool.total_bytes
        pageable_s = cuda_time(lambda: {k: v.to("cuda") for k, v in pool.weights.items()}, repeats)
        copied = copy_to_device(pool, "cuda")  # registers the segment (once) and copies
        pinned_s = cuda_time(lambda: copy_to_device(pool, "cuda"), repeats)
        return {
            "model": name,
            "dtype": dtype,
            "num_bytes": num_bytes,
            "disk_s": disk_s,
            "pageable_s": pageable_s,
            "pinned_s": pinned_s,
            "is_pinned": copied.is_pinned,
        }
    finally:
        pool_name = pool.name
        pool.close()
        remove(pool_name, force=True)


# -- report ---------------------------------------------------------------------------------------


def _tables(data: dict[str, Any]) -> tuple[str, str]:
    kv = markdown_table(
        ["model", "tokens", "block ids", "MiB", "device memcpy GB/s", "pull GB/s", "pull ms",
         "of which checksum ms"],
        [
            [r["size"], r["tokens"], r["pattern"], f"{r['num_bytes'] / 2**20:.2f}",
             f"{r['memcpy_gbps']:.0f}", f"{r['pull_gbps']:.2f}", f"{r['pull_ms']:.2f}",
             f"{r['checksum_ms']:.2f}"]
            for r in data["kv"]
        ],
    )  # fmt: skip
    weights = markdown_table(
        ["model", "dtype", "MiB", "disk -> GPU s", "pool (pageable) -> GPU s",
         "pool (pinned) -> GPU s", "pinned GB/s", "pinned vs pageable"],
        [
            [w["model"], w["dtype"], f"{w['num_bytes'] / 2**20:.0f}", f"{w['disk_s']:.3f}",
             f"{w['pageable_s']:.3f}", f"{w['pinned_s']:.3f}",
             f"{w['num_bytes'] / w['pinned_s'] / 1e9:.1f}",
             f"{w['pageable_s'] / w['pinned_s']:.2f}x" if w["is_pinned"] else "not pinned"]
            for w in data["weights"]
        ],
    )  # fmt: skip
    return kv, weights


def render(data: dict[str, Any]) -> str:
    return "\n\n".join(
        [
            *_intro(data),
            *_chain_parts(data.get("chain")),
        ]
    )


def _chain_parts(chain: dict[str, Any] | None) -> list[str]:
    """The chain multicast run of ``scale_up.py --chain-only`` on the same machine, if any."""
    if chain is None:
        return []
    from scale_up_report import chain_notes, verdicts
    from scale_up_tables import CHAIN_HEADERS, chain_bytes, chain_rows, parse_results

    r = parse_results(chain)
    if r.chain_ckpt is None:
        return []
    cpus = chain["machine"]["num_cpus"]
    return [
        f"**Chain multicast of the parameter pool on this machine's {cpus} CPUs** "
        f"(`{chain['command']}`; every receiver a separate process standing for a host, "
        "loopback TCP, no link limit):",
        markdown_table(CHAIN_HEADERS, chain_rows(r.chain_ckpt, r.chain)),
        "\n".join(verdicts(r.attach, r.starts, r.chain, chain_bytes(r))),
        chain_notes(r, cpus),
    ]


def _intro(data: dict[str, Any]) -> list[str]:
    kv, weights = _tables(data)
    return [
        f"Measured on {data['device']} (torch {data['torch']}), median of {data['repeats']} "
        "runs after a warm-up, every time taken with the device synchronised.",
        "**KV hand-off over CUDA IPC** (decode pulls from a prefill process's exported "
        "pool, one device-to-device copy per run of blocks, then verifies the checksum of "
        "what it wrote: one gather on the device, one copy to the host, the host hash):",
        kv,
        "**Weights to the GPU** (disk: safetensors load with the page cache warm, then "
        "`.to('cuda')`; pool: the host parameter pool's zero-copy tensors, as pageable "
        "memory and registered as pinned, which is what a worker on a GPU does):",
        weights,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--render", type=Path, help="only rebuild BENCHMARKS.md from this JSON")
    p.add_argument("--skip-1b", action="store_true", help="leave out the 1B checkpoint")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument(
        "--chain-json",
        type=Path,
        help="add a `scale_up.py --chain-only --json` run made on the same machine",
    )
    args = p.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_paths.py needs a CUDA device (use --render JSON elsewhere)")
        data = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "repeats": args.repeats,
            "command": command_line(),
            "kv": [row for size in MODELS for row in measure_kv(size, args.repeats)],
        }
        with tempfile.TemporaryDirectory() as work:
            data["weights"] = [
                measure_weights(name, path, dtype, args.repeats)
                for name, path, dtype in checkpoints(Path(work), args.cache_dir, args.skip_1b)
            ]
        if args.json:
            write_json(args.json, data)
    if args.chain_json:
        data["chain"] = json.loads(args.chain_json.read_text())
        if args.json:
            write_json(args.json, data)
    body = render(data)
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION_TITLE, body, data["command"])


if __name__ == "__main__":
    main()
