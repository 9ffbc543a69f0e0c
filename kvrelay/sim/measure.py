"""``kvrelay sim profile``: measures this machine's ``Profile`` with the real engine.

What is timed (each point the fastest of ``repeats``: on a machine shared with other jobs the
minimum is the best estimate of the uncontended cost, which is what an instance of its own
would see):

- prefill: ``LLMEngine.step()`` over fresh random prompts (no prefix hit), ``batch`` prompts
  of ``tokens`` each computed in one step; fitted to ``a + b * tokens + c * attn``, and
  ``base(tokens) + c * attn`` with ``base`` through the measured token counts.
- decode: ``batch`` sequences of ``context`` tokens each (one shared prefix, so setting up
  costs one prefill), then single decode steps; fitted to ``a + b * seqs + c * context``,
  and ``base(seqs) + c * context`` with ``base`` through the measured batch sizes.
- hand-off, shm: what a shm pull does to the bytes: the source's lease checksum and the
  destination's fused copy + checksum (``SlabCopier``) over ``n`` blocks of the model's layout.
  tcp: the same plus the bytes sent over a ZMQ loopback socket. Control messages are not
  timed (a few hundred microseconds each).
- start: process start and the imports a worker needs (a fresh interpreter), plus the
  weights: disk = ``load_weights``, pool = ``ParamPool`` attach (a pool of a private scope,
  removed after), peer = the weight bytes at the tcp rate measured above.
"""

from __future__ import annotations

import logging
import platform
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrelay.sim.profile import Link, Profile, fit_base, fit_linear

logger = logging.getLogger(__name__)

PREFILL_POINTS = ((1, 32), (2, 32), (1, 128), (2, 128), (1, 512), (2, 512), (1, 1024), (1, 2048))
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (128, 1024)
HANDOFF_BLOCKS = (4, 64, 256)
Stat = Callable[[list[float]], float]  # repeats -> one figure (min, or statistics.median)


def measure_profile(
    model_dir: str,
    threads: int = 1,
    repeats: int = 3,
    quick: bool = False,
    statistic: Callable[[list[float]], float] = min,
) -> Profile:
    """Measures every part of the profile (about a minute or two for a 135M model on 2 CPUs;
    ``quick``: fewer and shorter points, for tests)."""
    import torch

    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.engine import LLMEngine, build_engine_config
    from kvrelay.engine.loader import check_model_dir

    torch.set_num_threads(threads)
    max_len = ModelConfig.from_dir(check_model_dir(model_dir)).max_position_embeddings
    points = PREFILL_POINTS[: 4 if quick else None]
    points = tuple((b, t) for b, t in points if t < max_len - 8)
    prefill_tokens = tuple(t for _, t in points)
    contexts = tuple(c for c in ((32, 128) if quick else DECODE_CONTEXTS) if c < max_len - 64)
    batches = DECODE_BATCHES[:3] if quick else DECODE_BATCHES
    config = build_engine_config(
        model_dir,
        num_threads=threads,
        num_blocks=(max(prefill_tokens) * 2 + max(batches) * (max(contexts) + 64)) // 16 + 64,
        max_num_batched_tokens=2 * max(prefill_tokens),
        max_model_len=max_len,
    )
    engine = LLMEngine(config)
    engine.runner.model.wait_packed()  # time the steps a warmed-up worker runs
    vocab = config.model_config.vocab_size
    prefill_rows = _measure_prefill(engine, vocab, points, repeats, statistic)
    decode_rows = _measure_decode(engine, vocab, batches, contexts, repeats, statistic)
    mc = config.model_config
    elem = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    block_bytes = config.cache.block_size * mc.kv_bytes_per_token * elem
    del engine
    handoff, handoff_rows = _measure_handoff(
        mc, config.cache.block_size, config.dtype, threads, repeats, statistic
    )
    weight_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    start_s, start_parts = _measure_start(model_dir, config, handoff["tcp"], weight_bytes)
    decode = fit_linear([(b, c, s) for b, c, s in decode_rows])
    prefill = fit_linear([(t, a, s) for t, a, s in prefill_rows])
    return Profile(
        model=Path(model_dir).name,
        machine=_machine(),
        threads=threads,
        block_size=config.cache.block_size,
        kv_bytes_per_block=block_bytes,
        kv_blocks_per_gib=(1 << 30) // block_bytes,
        prefill=prefill,
        decode=decode,
        decode_base=fit_base(decode_rows, decode),
        prefill_base=fit_base(prefill_rows, prefill),
        handoff=handoff,
        start_s=start_s,
        points={
            "prefill (tokens, attn, s)": prefill_rows,
            "decode (seqs, context, s)": decode_rows,
            "handoff (transport, bytes, s)": handoff_rows,
            "start parts (s)": start_parts,
        },
    )


def _machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _params(max_tokens: int) -> Any:
    from kvrelay.protocol.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run_all(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _measure_prefill(
    engine: Any, vocab: int, points: tuple[tuple[int, int], ...], repeats: int, stat: Stat
) -> list[tuple[float, float, float]]:
    rng = random.Random(0)
    rows = []
    for batch, tokens in points:
        times = []
        for _ in range(repeats):
            for i in range(batch):
                prompt = [rng.randrange(4, vocab) for _ in range(tokens)]
                engine.add_request(f"p{rng.random()}-{i}", prompt, _params(1))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            _run_all(engine)
        rows.append((float(batch * tokens), batch * tokens * tokens / 2, stat(times)))
        logger.info("prefill %d x %d tokens: %.1f ms", batch, tokens, rows[-1][2] * 1e3)
    return rows


def _measure_decode(
    engine: Any,
    vocab: int,
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    repeats: int,
    stat: Stat,
) -> list[tuple[float, float, float]]:
    rng = random.Random(1)
    rows = []
    steps = max(3, repeats)
    for context in contexts:
        prefix = [rng.randrange(4, vocab) for _ in range(context - 1)]
        engine.add_request(f"warm{context}", [*prefix, 5], _params(1))
        _run_all(engine)
        for batch in batches:
            for i in range(batch):
                engine.add_request(f"d{context}-{batch}-{i}", [*prefix, 6 + i], _params(steps + 1))
            engine.step()  # the prompts' last tokens (the prefix is cached)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            _run_all(engine)
            rows.append((float(batch), float(batch * (context + steps // 2)), stat(times)))
            logger.info("decode %d x %d context: %.1f ms", batch, context, rows[-1][2] * 1e3)
    return rows


def _measure_handoff(
    mc: Any, block_size: int, dtype: str, threads: int, repeats: int, stat: Stat
) -> tuple[dict[str, Link], list[tuple[str, int, float]]]:
    import torch

    from kvrelay.transport.blocks import Run
    from kvrelay.transport.checksum import pool_slabs
    from kvrelay.transport.copier import SlabCopier

    num = max(HANDOFF_BLOCKS)
    shape = (mc.num_layers, 2, num, block_size, mc.num_kv_heads, mc.head_dim)
    src = torch.randn(shape).to(getattr(torch, dtype))
    dst = torch.zeros_like(src)
    src_slabs, dst_slabs = pool_slabs(src), pool_slabs(dst)
    copier = SlabCopier(threads)
    rows: list[tuple[str, int, float]] = []
    try:
        for n in HANDOFF_BLOCKS:
            runs = [Run(0, 0, n)]
            nbytes = n * int(src_slabs.shape[0] * src_slabs.shape[2])

            def shm(runs: list[Run] = runs) -> None:
                copier.checksum(src_slabs, runs)
                copier.copy_and_checksum(src_slabs, dst_slabs, runs)

            rows.append(("shm", nbytes, _time(shm, repeats + 2, stat)))
            payload = [s[:n].copy() for s in src_slabs]
            rows.append(
                ("tcp", nbytes, _tcp_time(payload, copier, dst_slabs, runs, repeats + 2, stat))
            )
    finally:
        copier.close()
    links = {}
    for transport in ("shm", "tcp"):
        pts = [(b, s) for t, b, s in rows if t == transport]
        fit = fit_linear([(b, 0.0, s) for b, s in pts])
        links[transport] = Link(fit.intercept_s, 1.0 / max(fit.per_item_s, 1e-12))
    return links, rows


def _time(fn: Callable[[], None], repeats: int, stat: Stat) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return stat(times)


def _tcp_time(
    payload: list[Any], copier: Any, dst_slabs: Any, runs: list[Any], repeats: int, stat: Stat
) -> float:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    try:

        def once() -> None:
            sender = threading.Thread(target=lambda: tx.send_multipart(payload, copy=False))
            sender.start()
            frames = rx.recv_multipart(copy=False)
            sender.join()
            slabs = [
                np.frombuffer(f.buffer, dtype=np.uint8).reshape(p.shape)
                for f, p in zip(frames, payload)
            ]
            copier.checksum(payload, runs)  # the source's lease checksum
            copier.copy_and_checksum(slabs, dst_slabs, runs)

        return _time(once, repeats, stat)
    finally:
        rx.close(0)
        tx.close(0)
        ctx.term()


def _measure_start(
    model_dir: str, config: Any, tcp: Link, weight_bytes: int
) -> tuple[dict[str, float], dict[str, float]]:
    from kvrelay.cachetier.param_ops import remove
    from kvrelay.cachetier.param_pool import ParamPool
    from kvrelay.engine.loader import load_weights

    code = "import torch, kvrelay.engine.engine, kvrelay.router.registry, zmq"
    imports = []
    for _ in range(2):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        imports.append(time.perf_counter() - start)
    import_s = min(imports)
    start = time.perf_counter()
    load_weights(model_dir, config.model_config, config.dtype)
    disk_s = time.perf_counter() - start
    scope = f"simprof{random.randrange(1 << 30):x}"
    pool = ParamPool.attach_or_create(model_dir, config.dtype, scope=scope)
    name = pool.name
    pool.close()
    start = time.perf_counter()
    pool = ParamPool.attach_or_create(model_dir, config.dtype, scope=scope)
    attach_s = time.perf_counter() - start
    pool.close()
    remove(name, force=True)
    peer_s = tcp.seconds(weight_bytes)
    parts = {"imports": import_s, "disk": disk_s, "pool_attach": attach_s, "peer_fetch": peer_s}
    modes = {"disk": import_s + disk_s, "pool": import_s + attach_s, "peer": import_s + peer_s}
    return modes, parts
