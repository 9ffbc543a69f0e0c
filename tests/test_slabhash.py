"""Slab digests: the native kvcopy library and the numpy + xxhash fallback against
python-xxhash's xxh64 over random inputs, random piece splits and odd lengths."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from kvrelay.transport import slabhash
from kvrelay.transport.blocks import Run
from kvrelay.transport.checksum import _device_checksum, kv_checksum, slabs_checksum
from kvrelay.transport.copier import SlabCopier
from kvrelay.transport.slabhash import SlabJob

PATHS = ["native", "python"]


@pytest.fixture(params=PATHS)
def path(request: Any, monkeypatch: Any) -> str:
    """Runs a test on the native library and again on the forced Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(slabhash, "load_library", lambda: None)
    return str(request.param)


def random_cuts(rng: random.Random, total: int) -> list[int]:
    """Piece lengths summing to ``total``: empty, 1-byte, stripe-sized and odd pieces."""
    cuts, left = [], total
    while left:
        length = min(left, rng.choice([0, 1, 3, 7, 8, 31, 32, 33, 64, rng.randrange(1, 3000)]))
        cuts.append(length)
        left -= length
    return cuts


def runs_of(cuts: list[int], rng: random.Random) -> tuple[list[Run], list[Run]]:
    """Byte runs (block size 1) for ``cuts``: in order, and the same runs in a shuffled order
    with destinations packed back to back in that order."""
    in_order, start = [], 0
    for length in cuts:
        in_order.append(Run(start, start, length))
        start += length
    shuffled = rng.sample(in_order, len(in_order))
    packed, dst = [], 0
    for run in shuffled:
        packed.append(Run(run.src_start, dst, run.length))
        dst += run.length
    return in_order, packed


def test_native_library_is_built() -> None:
    assert slabhash.load_library() is not None, "pip install did not compile kvrelay/csrc"


@pytest.mark.parametrize("seed", range(40))
def test_digests_equal_xxh64_over_random_piece_splits(path: str, seed: int) -> None:
    rng = random.Random(seed)
    total = rng.choice([0, 1, 5, 31, 32, 33, 63, 64, 65, 1000, rng.randrange(20_000)])
    data = np.frombuffer(rng.randbytes(total), dtype=np.uint8).reshape(-1, 1)
    slabs = np.stack([data, data[::-1].copy()])  # two slabs, [2, total, 1]
    in_order, packed = runs_of(random_cuts(rng, total), rng)
    expected = [xxhash.xxh64_intdigest(slab.tobytes()) for slab in slabs]
    assert SlabJob(slabs, None, in_order).digests(0, 2) == expected
    shuffled = [b"".join(slab[r.src_start : r.src_start + r.length].tobytes() for r in packed)
                for slab in slabs]  # fmt: skip
    dst = np.zeros_like(slabs)
    digests = SlabJob(slabs, dst, packed).digests(0, 2)
    assert digests == [xxhash.xxh64_intdigest(b) for b in shuffled]
    assert [slab.tobytes() for slab in dst] == shuffled


@pytest.mark.parametrize("block_bytes", [1, 7, 40, 4096])
def test_copy_moves_exactly_the_runs(path: str, block_bytes: int) -> None:
    rng = np.random.default_rng(block_bytes)
    src = rng.integers(0, 256, (3, 10, block_bytes), dtype=np.uint8)
    dst = rng.integers(0, 256, (3, 12, block_bytes), dtype=np.uint8)
    before = dst.copy()
    runs = [Run(7, 0, 3), Run(0, 9, 2), Run(4, 5, 1), Run(5, 6, 0)]
    digests = SlabJob(src, [*dst], runs).digests(1, 3)  # slabs 1 and 2 only, as a list
    expected = before.copy()
    for src_start, dst_start, length in runs:
        expected[1:, dst_start : dst_start + length] = src[1:, src_start : src_start + length]
    np.testing.assert_array_equal(dst, expected)
    moved = [0, 1, 2, 9, 10, 5]  # the destination blocks, in run order
    assert digests == [xxhash.xxh64_intdigest(dst[i, moved].tobytes()) for i in (1, 2)]


def test_empty_runs_give_the_empty_digest(path: str) -> None:
    slabs = np.zeros((4, 3, 16), dtype=np.uint8)
    assert SlabJob(slabs, None, []).digests(0, 4) == [xxhash.xxh64_intdigest(b"")] * 4
    assert SlabJob(slabs, slabs.copy(), []).digests(2, 2) == []


def test_jobs_reject_what_the_native_code_could_not_do_safely(path: str) -> None:
    src, dst = np.zeros((2, 4, 8), dtype=np.uint8), np.zeros((2, 3, 8), dtype=np.uint8)
    with pytest.raises(ValueError, match="destination slab 0 has 3 blocks"):
        SlabJob(src, dst, [Run(0, 1, 3)])
    with pytest.raises(ValueError, match="source slab 0 has 4 blocks"):
        SlabJob(src, dst, [Run(2, 0, 3)])
    with pytest.raises(ValueError, match="negative"):
        SlabJob(src, dst, [Run(-1, 0, 1)])
    with pytest.raises(ValueError, match="contiguous blocks"):
        SlabJob(src[:, :, ::2], None, [Run(0, 0, 1)])
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        SlabJob(src, dst, [Run(0, 0, 1)])
    with pytest.raises(ValueError, match="2 source slabs but 1"):
        SlabJob(src, dst[:1], [])


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_threaded_checksum_equals_single_threaded(path: str, num_threads: int) -> None:
    slabs = np.random.default_rng(5).integers(0, 256, (6, 50, 4096), dtype=np.uint8)
    ids = [3, 4, 5, 49, 0, 17, 18, 2]
    runs = [Run(3, 3, 3), Run(49, 49, 1), Run(0, 0, 1), Run(17, 17, 2), Run(2, 2, 1)]
    copier = SlabCopier(num_threads, min_bytes_per_thread=0)
    try:
        actual = copier.checksum(slabs, runs)
    finally:
        copier.close()
    digests = [xxhash.xxh64_intdigest(slab[ids].tobytes()) for slab in slabs]
    expected = xxhash.xxh64_intdigest(np.array(digests, dtype="<u8").tobytes())
    assert actual == expected == slabs_checksum(slabs, ids)


def test_native_and_python_agree_on_a_large_pool(monkeypatch: Any) -> None:
    pool = torch.randn(4, 2, 64, 16, 4, 16, generator=torch.Generator().manual_seed(3))
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:40].tolist()
    native = kv_checksum(pool, ids)  # 40 blocks x 4 KiB x 8 slabs: more than one thread's worth
    monkeypatch.setattr(slabhash, "load_library", lambda: None)
    assert kv_checksum(pool, ids) == native


def test_device_checksum_path_on_a_cpu_pool() -> None:
    pool = torch.randn(2, 2, 9, 4, 2, 8, generator=torch.Generator().manual_seed(6))
    ids = [8, 0, 1, 2, 5]
    assert _device_checksum(pool, ids, None) == kv_checksum(pool, ids)


def test_missing_library_warns_once(monkeypatch: Any, caplog: Any) -> None:
    monkeypatch.setattr(slabhash, "LIBRARY_NAME", "_no_such_library")
    load = slabhash.load_library.__wrapped__  # the uncached loader
    with caplog.at_level(logging.WARNING, logger=slabhash.__name__):
        assert load() is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "fall back to numpy + xxhash" in caplog.text
