"""Start-up work that runs beside serving yields the CPU where it can: weight packing runs at
nice 10; the grammar tables, which hold the GIL, at the caller's priority (``background``)."""

from __future__ import annotations

import os
import threading

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


def test_the_grammar_tables_build_at_the_callers_priority(tiny_model_dir, monkeypatch) -> None:
    """The build holds the GIL for stretches: lowered, it stalled the worker's heartbeat past
    a test cluster's ``--dead-after`` on a busy CI host (a priority inversion)."""
    from kvrelay.engine import structured

    seen: list[int] = []
    real = structured._hf_tokenizer

    def recording(path):
        seen.append(_own_niceness())
        return real(path)

    monkeypatch.setattr(structured, "_hf_tokenizer", recording)
    cache = structured.GrammarCache(tiny_model_dir, vocab_size=256, stop_token_ids=[0])
    cache.warm_up_in_background().join(60)
    assert seen == [_own_niceness()]


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
