"""Start-up work that runs beside serving yields the CPU: its threads run at nice 10."""

from __future__ import annotations

import os
import threading
import time

from kvrelay.engine import background


def _own_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_lower_priority_lowers_only_the_calling_thread() -> None:
    before = _own_niceness()
    seen: list[int] = []

    def work() -> None:
        background.lower_priority()
        seen.append(_own_niceness())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(10)
    assert seen == [max(before, background.NICENESS)]
    assert _own_niceness() == before  # this thread (the serving one) keeps its priority


def test_the_grammar_tables_build_at_low_priority(tiny_model_dir, monkeypatch) -> None:
    from kvrelay.engine import structured

    seen: list[int] = []
    real = structured._hf_tokenizer

    def recording(path):
        seen.append(_own_niceness())
        return real(path)

    monkeypatch.setattr(structured, "_hf_tokenizer", recording)
    cache = structured.GrammarCache(tiny_model_dir, vocab_size=256, stop_token_ids=[0])
    cache.warm_up_in_background().join(60)
    assert seen == [max(_own_niceness(), background.NICENESS)]


def test_weights_pack_at_low_priority(tiny_model_dir, monkeypatch) -> None:
    import pytest
    import torch

    from kvrelay import LLM
    from kvrelay.kernels import cpu_packed

    if not cpu_packed.supported(torch.float32):
        pytest.skip("this torch has no oneDNN for float32")
    seen: list[int] = []
    real = cpu_packed.pack

    def recording(w, transposed):
        seen.append(_own_niceness())
        return real(w, transposed)

    monkeypatch.delenv("KVRELAY_CPU_PACKED_WEIGHTS", raising=False)  # unset: on a thread
    monkeypatch.setattr(cpu_packed, "pack", recording)
    llm = LLM(tiny_model_dir, num_blocks=32, warm_up=False)
    assert llm.engine.runner.model.wait_packed(60)
    assert seen and set(seen) == {max(_own_niceness(), background.NICENESS)}


# -- the KV pool's pages, backed in the background --------------------------------------------


def _kv_segment(name: str):
    from kvrelay.protocol.messages import KvLayout
    from kvrelay.transport.shm_pool import SharedKvPool

    return SharedKvPool.create(name, KvLayout(2, 64, 16, 4, 64, "float32"))  # 4 MiB


def _backed_bytes(name: str) -> int:
    from kvrelay.cachetier.segments import SHM_DIR

    return (SHM_DIR / name).stat().st_blocks * 512


def test_populate_backs_a_segment_without_changing_it() -> None:
    import uuid

    pool = _kv_segment(f"kvrelay-test-populate-{uuid.uuid4().hex[:8]}")
    try:
        t = pool.tensor
        t.view(-1)[:1000] = 7.0  # KV a step already wrote: must survive
        assert _backed_bytes(pool.name) < t.nbytes // 2  # the rest is not backed yet
        assert background.populate(t.data_ptr(), t.nbytes, "test pool")
        assert _backed_bytes(pool.name) >= t.nbytes
        assert bool((t.view(-1)[:1000] == 7.0).all()) and float(t.view(-1)[1000:].abs().sum()) == 0
    finally:
        pool.close(unlink=True)


def test_populate_in_background_runs_at_low_priority_and_stops(monkeypatch) -> None:
    import uuid

    seen: list[int] = []
    real = background.populate

    def recording(address, nbytes, what, stop=None):
        seen.append(_own_niceness())
        return real(address, nbytes, what, stop)

    monkeypatch.setattr(background, "populate", recording)
    pool = _kv_segment(f"kvrelay-test-populate-{uuid.uuid4().hex[:8]}")
    try:
        t = pool.tensor
        background.populate_in_background(t, t.data_ptr(), t.nbytes, "test pool")
        deadline = time.monotonic() + 30
        while _backed_bytes(pool.name) < t.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _backed_bytes(pool.name) >= t.nbytes
        assert seen == [max(_own_niceness(), background.NICENESS)]
        stop = threading.Event()
        stop.set()  # a stopped populate backs nothing more
        assert background.populate(t.data_ptr(), t.nbytes, "test pool", stop) is False
    finally:
        pool.close(unlink=True)


def test_populate_reports_memory_that_is_not_there(caplog) -> None:
    import ctypes
    import logging
    import mmap

    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    anchor = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(anchor)
    del anchor
    region.close()  # unmapped: what a segment past /dev/shm's room or a closed pool gives
    with caplog.at_level(logging.WARNING, logger="kvrelay.engine.background"):
        assert background.populate(address, 4 * mmap.PAGESIZE, "gone pool") is False
    assert "gone pool: could not back" in caplog.text
