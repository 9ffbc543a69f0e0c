"""A KV segment's pages are backed ahead of use (``SharedKvPool.back_next``) without being
changed, and memory that cannot be backed is reported instead of killing a later write."""

from __future__ import annotations

import ctypes
import logging
import mmap
import uuid

import pytest

from kvrelay.cachetier.segments import SHM_DIR
from kvrelay.protocol.messages import KvLayout
from kvrelay.transport import shm_pool
from kvrelay.transport.shm_pool import SharedKvPool

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")
LAYOUT = KvLayout(2, 64, 16, 4, 64, "float32")  # 4 MiB


def _backed_bytes(name: str) -> int:
    return (SHM_DIR / name).stat().st_blocks * 512


def test_back_next_backs_the_segment_in_chunks_without_changing_it() -> None:
    with SharedKvPool.create(f"kvrelay-test-back-{uuid.uuid4().hex[:8]}", LAYOUT) as pool:
        flat = pool.tensor.view(-1)
        flat[:1000] = 7.0  # KV a step already wrote: must survive
        total = pool.tensor.nbytes
        assert _backed_bytes(pool.name) < total // 2  # the rest is not backed yet
        calls, more = 0, True
        while more:
            more = pool.back_next(1 << 20)
            calls += 1
            assert _backed_bytes(pool.name) >= calls * (1 << 20)  # a chunk a call
        assert calls == total // (1 << 20)
        assert _backed_bytes(pool.name) >= total
        assert bool((flat[:1000] == 7.0).all()) and float(flat[1000:].abs().sum()) == 0
        assert pool.back_next() is False  # nothing left


def test_back_next_stops_once_closed() -> None:
    pool = SharedKvPool.create(f"kvrelay-test-back-{uuid.uuid4().hex[:8]}", LAYOUT)
    pool.close(unlink=True)
    assert pool.back_next() is False


def test_memory_that_is_not_there_is_reported(caplog) -> None:
    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    anchor = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(anchor)
    del anchor
    region.close()  # unmapped: as a segment past /dev/shm's room fails to back
    with caplog.at_level(logging.WARNING, logger="kvrelay.transport.shm_pool"):
        assert shm_pool.populate(address, 4 * mmap.PAGESIZE, "gone pool") is False
    assert "gone pool: could not back" in caplog.text
