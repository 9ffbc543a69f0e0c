"""L2 block sealing: what the MAC and the encryption cost per block, and on the L2 TTFT gain.

Part 1, per block (no cluster): sealing (write) and opening (read) one block of SmolLM2-135M's
format (30 layers x 2 x 16 tokens x 3 kv heads x 64 dims x float32 = 720 KiB) in each form
of ``block_seal.py``: ``unkeyed`` (xxh3-64, no credential), ``mac`` (HMAC-SHA256) and
``aead`` (AES-256-GCM); the median of ``--block-reps`` runs. The ``unkeyed`` and ``mac``
rows are also what L1 would pay per block read and write with and without a MAC (DESIGN.md).

Part 2, the L2 TTFT gain (a cluster per form; make_tiny ``--size`` llama, 1 prefill + 1
decode worker, ``--host-pool off``): ``--prompts`` distinct prompts of about
``--prompt-words`` words are served once by prefill A (filling Redis); once the write-behind
queue is empty, a cold prefill B joins and A is drained. B then serves each of them (every
full block read from Redis: the L2 TTFT) and as many fresh prompts of the same length
(computed: the no-cache TTFT). Gain = no-cache p50 - L2 p50. TTFT is client-side: sending a
streaming completion to its first chunk with text.

    python benchmarks/l2_seal.py                      # writes BENCHMARKS.md
    python benchmarks/l2_seal.py --size tiny --prompts 2 --prompt-words 100 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import (
    REPO_ROOT,
    command_line,
    markdown_table,
    median,
    text_table,
    update_benchmarks_md,
    wait_for_quiet_cpu,
)
from prefix_cache_clusters import drain, wait_for_write_behind

from kvrelay.cachetier.base import BlockFormat
from kvrelay.cachetier.block_hash import BlockHash
from kvrelay.cachetier.block_seal import BlockSealer
from kvrelay.cli.launcher import ClusterSpec, Launcher
from kvrelay.protocol.credential import ClusterCredential

SMOLLM2 = BlockFormat(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
FORMS = ("unkeyed", "mac", "aead")
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliett",
    "kilo",
    "lima",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", help="make_tiny size of the cluster's model")
    p.add_argument("--prompts", type=int, default=3, help="prompts per form (L2 and fresh)")
    p.add_argument("--prompt-words", type=int, default=512, help="words per prompt")
    p.add_argument("--block-reps", type=int, default=200, help="runs per block timing")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- per block


def time_blocks(reps: int) -> dict[str, tuple[float, float]]:
    """Per form: median (seal, open) milliseconds of one SmolLM2-135M block."""
    payload = np.random.default_rng(0).integers(0, 256, SMOLLM2.payload_bytes, dtype=np.uint8)
    key = BlockHash(bytes(16))
    credential = ClusterCredential.generate()
    out = {}
    for form in FORMS:
        sealer = BlockSealer(SMOLLM2, None if form == "unkeyed" else credential, form == "aead")
        buf = bytearray(sealer.value_bytes)
        start = sealer.payload_offset
        buf[start : start + SMOLLM2.payload_bytes] = payload.tobytes()
        seals, opens = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            value = sealer.seal_value(key, buf)
            t1 = time.perf_counter()
            sealer.open_value(key, value)
            t2 = time.perf_counter()
            seals.append(t1 - t0)
            buf[start : start + SMOLLM2.payload_bytes] = payload.tobytes()  # sealed in place
            opens.append(t2 - t1)
        out[form] = (median(seals) * 1e3, median(opens) * 1e3)
    return out


# ---------------------------------------------------------------------------- TTFT


def prompt(i: int, num_words: int) -> str:
    rng = random.Random(i)
    return f"Prompt {i}: " + " ".join(rng.choice(WORDS) for _ in range(num_words))


def ttft(client: httpx.Client, text: str) -> tuple[float, int]:
    """Seconds to the first text chunk, and the cached prompt tokens."""
    body = {
        "model": "m",
        "prompt": text,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first: float | None = None
    cached = 0
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            if first is None and any(c.get("text") for c in event.get("choices") or ()):
                first = time.perf_counter() - start
            usage = event.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    assert first is not None, "no text streamed"
    return first, cached


def run_form(form: str, model_dir: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.redis_server import RedisServer

    log_dir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(log_dir, maxmemory="2gb")
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_CLUSTER_SECRET")}
    if form != "unkeyed":
        env["KVRELAY_CLUSTER_SECRET"] = ClusterCredential.generate().hex()
    flags = ["--threads", str(args.threads), "--num-blocks", "2048", "--host-pool", "off"]
    flags += ["--redis-url", server.url]
    flags += ["--l2-encrypt"] if form == "aead" else ["--no-l2-encrypt"]
    spec = ClusterSpec(
        model=str(model_dir),
        cluster_id=f"ls{os.getpid()}-{uuid.uuid4().hex[:6]}",
        worker_args=tuple(flags),
        router_args=("--served-model-name", "m"),
        log_dir=str(log_dir),
    )
    old_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    launcher = Launcher(spec)
    try:
        launcher.start(timeout=300)
        [warm] = [n for n, p in launcher.procs.items() if p.role == "prefill"]
        cached = [prompt(i, args.prompt_words) for i in range(args.prompts)]
        fresh = [prompt(1000 + i, args.prompt_words) for i in range(args.prompts)]
        with httpx.Client(base_url=launcher.url, timeout=600) as client:
            ttft(client, "warm up")
            for text in cached:
                ttft(client, text)
            wait_for_write_behind(launcher.url, server)
            cold = launcher.add_worker("prefill", [])
            launcher.wait_ready(timeout=300, names=[cold])
            drain(launcher.url, warm)
            ttft(client, "warm up the cold worker")
            l2, computed, hits = [], [], []
            for hit_text, fresh_text in zip(cached, fresh):
                wait_for_quiet_cpu(30, threshold=0.1)
                seconds, num_cached = ttft(client, hit_text)
                l2.append(seconds)
                hits.append(num_cached)
                wait_for_quiet_cpu(30, threshold=0.1)
                computed.append(ttft(client, fresh_text)[0])
        if min(hits) == 0:
            raise RuntimeError(f"{form}: the cold worker read nothing from Redis: {hits}")
        return {
            "l2_ms": median(l2) * 1e3,
            "computed_ms": median(computed) * 1e3,
            "cached_tokens": int(median(hits)),
        }
    finally:
        launcher.stop()
        server.stop()
        os.environ.clear()
        os.environ.update(old_env)


def goal_note(runs: dict[str, Any], base_gain: float) -> str:
    """The goal: the L2 TTFT gain with encryption within 10% of the unencrypted one."""
    aead = runs["aead"]["computed_ms"] - runs["aead"]["l2_ms"]
    share = aead / base_gain
    verdict = "met" if share >= 0.9 else "not met"
    return (
        f"Goal (the L2 TTFT gain with encryption at least 90% of the unkeyed gain): {verdict}, "
        f"{100 * share:.0f}%. The L1 question (a MAC on host-pool blocks) is the seal row of "
        "`mac` against `unkeyed`: what every L1 write (and about as much every read) would add "
        "per block; DESIGN.md, cache tiers, says why L1 keeps the unkeyed checksum."
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    blocks = time_blocks(args.block_reps)
    block_rows = [
        [form, f"{seal:.3f}", f"{opened:.3f}", f"{seal - blocks['unkeyed'][0]:+.3f}",
         f"{opened - blocks['unkeyed'][1]:+.3f}"]
        for form, (seal, opened) in blocks.items()
    ]  # fmt: skip
    block_headers = ["form", "seal ms/block", "open ms/block", "seal vs unkeyed", "open vs unkeyed"]
    print(text_table(block_headers, block_rows))
    from kvrelay.engine.make_tiny import make_tiny

    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / args.size, arch="llama", size=args.size)
        for form in FORMS:
            logs = (args.log_dir or Path(tmp)) / f"logs-{form}"
            runs[form] = run_form(form, model_dir, args, logs)
    base_gain = runs["unkeyed"]["computed_ms"] - runs["unkeyed"]["l2_ms"]
    ttft_rows = []
    for form, r in runs.items():
        gain = r["computed_ms"] - r["l2_ms"]
        ttft_rows.append(
            [form, f"{r['computed_ms']:.0f}", f"{r['l2_ms']:.0f}", f"{gain:.0f}",
             f"{100 * gain / base_gain:.0f}%", r["cached_tokens"]]
        )  # fmt: skip
    ttft_headers = ["form", "no cache p50 ms", "L2 p50 ms", "gain ms", "gain vs unkeyed",
                    "cached tokens"]  # fmt: skip
    print(text_table(ttft_headers, ttft_rows))
    if args.no_write:
        return 0
    body = (
        f"Per block (SmolLM2-135M format, {SMOLLM2.payload_bytes:,} bytes; median of "
        f"{args.block_reps}; seal = what the writer thread does, open = what a read does, "
        "a fresh copy out included):\n\n"
        + markdown_table(block_headers, block_rows)
        + f"\n\nL2 TTFT (make_tiny `{args.size}` llama, {args.prompts} prompts of "
        f"{args.prompt_words} words, each read from Redis by a cold prefill worker, vs as many "
        "fresh prompts it computes; p50):\n\n"
        + markdown_table(ttft_headers, ttft_rows)
        + "\n\n"
        + goal_note(runs, base_gain)
    )
    update_benchmarks_md("L2 block sealing (MAC, encryption)", body, command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
