"""kernels.hugepages: the CPU KV pool on 2 MiB pages, read back from the kernel's own
accounting (/proc/self/smaps) rather than from the advice given."""

from __future__ import annotations

import mmap
import re
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.engine.device import allocate_local
from kvrelay.kernels import hugepages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (always / madvise / never), None off Linux."""
    try:
        found = re.search(r"\[(\w+)\]", THP_MODE.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages are off on this host",
)


def smaps_field(t: torch.Tensor, field: str) -> str:
    """A field of /proc/self/smaps (``AnonHugePages``, ``VmFlags``) for the mapping that holds
    ``t``'s first byte."""
    address = t.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no mapping holds the tensor")


def advised_kib() -> int:
    """The size (KiB) of this process's mappings that carry MADV_HUGEPAGE's flag (``hg``)."""
    total = size = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line.startswith("Size:"):
            size = int(line.split()[1])
        elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            total += size
    return total


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``t``'s first byte."""
    return int(smaps_field(t, "AnonHugePages").split()[0])


@needs_thp
def test_a_fresh_tensor_is_backed_by_huge_pages_once_touched() -> None:
    t = hugepages.empty(((16 << 20) // 4,), torch.float32)  # 16 MiB
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(1.0)
    assert huge_kib(t) >= 2048, "the kernel gave the advised range no huge page"
    assert float(t.sum()) == t.numel()


@needs_thp
def test_the_switch_turns_the_advice_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    before = advised_kib()
    t = hugepages.zeros(((16 << 20) // 4,), torch.float32)
    # nothing advised for it ("hg" is MADV_HUGEPAGE's flag). The huge pages of the mapping
    # that holds it are not the test: with a CPU engine started earlier in this process (its
    # malloc thresholds raised, engine.device.keep_step_memory), 16 MiB comes from malloc's
    # heap, a mapping shared with everything else (one CI run saw 106 MiB of huge pages there)
    assert advised_kib() <= before
    assert t.shape == ((16 << 20) // 4,) and float(t.abs().sum()) == 0.0
    monkeypatch.setenv("KVRELAY_HUGE_PAGES", "1")  # the contrast: on, 16 MiB more advised
    before = advised_kib()
    on = hugepages.zeros(((16 << 20) // 4,), torch.float32)
    assert advised_kib() - before >= 16 << 10 and "hg" in smaps_field(on, "VmFlags").split()
    monkeypatch.setenv("KVRELAY_HUGE_PAGES", "0")  # and a mapping is not advised either
    assert hugepages.advise_mapping(mmap.mmap(-1, 4 << 20)) is False


def test_small_tensors_stay_on_malloc_memory() -> None:
    small = hugepages.empty((1000,), torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32
    assert int(hugepages.zeros((3, 4), torch.int64).sum()) == 0


@needs_thp
def test_a_private_kv_pool_is_zeroed_on_huge_pages() -> None:
    pool = allocate_local((2, 4, 256, 16, 4, 64), torch.float32, torch.device("cpu"))  # 32 MiB
    assert int(torch.count_nonzero(pool)) == 0
    assert huge_kib(pool) >= 2048
