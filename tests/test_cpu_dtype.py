"""bfloat16 on a CPU without native BF16 multiplies float32 copies of the weights: the engine
says so when it starts."""

from __future__ import annotations

import logging

import pytest
import torch

from kvrelay.engine import device as engine_device


def test_native_bf16_is_read_from_the_cpu_flags():
    avx2 = "processor : 0\nflags : fpu sse avx avx2 fma\n"
    assert not engine_device.cpu_has_native_bf16(avx2)
    assert engine_device.cpu_has_native_bf16("flags : avx2 avx512f avx512_bf16\n")
    assert engine_device.cpu_has_native_bf16("flags : avx2 amx_tile amx_bf16\n")
    assert not engine_device.cpu_has_native_bf16("")


@pytest.mark.parametrize(("native", "dtype", "device", "noted"), [
    (False, "bfloat16", "cpu", True),
    (True, "bfloat16", "cpu", False),
    (False, "float32", "cpu", False),
])  # fmt: skip
def test_bfloat16_without_native_bf16_is_noted(monkeypatch, caplog, native, dtype, device, noted):
    monkeypatch.setattr(engine_device, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger=engine_device.__name__):
        engine_device.note_cpu_dtype(torch.device(device), dtype)
    assert ("multiply float32 copies of the weights" in caplog.text) == noted
