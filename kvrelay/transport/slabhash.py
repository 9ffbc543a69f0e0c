"""Slab digests: XXH64 of runs of blocks, optionally copied in the same pass; native or Python.

The native path is ``kvrelay/csrc/kvcopy.c``, built at install time into
``kvrelay/transport/_kvcopy*.so`` and called through ctypes, which releases the GIL for the
call: a thread copies and hashes its whole slab range in one call, each 32-byte stripe loaded
once, stored and hashed from registers. Without the library (no compiler at install time)
the same digests come from ``np.copyto`` and ``xxhash.xxh64`` (one warning, logged once)::

    SlabJob(src, dst, runs).digests(lo, hi)    copy runs of slabs lo..hi-1, return their digests
    SlabJob(slabs, None, runs).digests(lo, hi) hash only (dst_start of each run is ignored)

A slab is a ``[num_blocks, block_bytes]`` uint8 array whose rows are contiguous (a pool's
``pool_slabs`` entry, or a tcp frame); a run ``(src_start, dst_start, length)`` is that many
consecutive blocks. A slab's digest is XXH64 (seed 0) of its runs' bytes in order, whatever
path or piece size computed it, and equals ``xxhash.xxh64`` of those bytes.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvrelay.transport.blocks import Run, split_runs

if TYPE_CHECKING:
    Slabs = np.ndarray | Sequence[np.ndarray]

logger = logging.getLogger(__name__)

LIBRARY_NAME = "_kvcopy"  # the setuptools Extension kvrelay.transport._kvcopy (setup.py)
CHUNK_BYTES = 1 << 20  # Python path: bytes copied before they are hashed, within L2

_SIZE = ctypes.c_size_t
_PTR = ctypes.c_void_p


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled ``kvcopy`` library next to this module, or None (warned once) if absent."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARY_NAME}{suffix}"
        if path.exists():
            library = ctypes.CDLL(str(path))
            library.kv_copy_hash_slabs.argtypes = [_SIZE, _PTR, _PTR, _SIZE, _PTR, _PTR, _PTR, _PTR]
            library.kv_copy_hash_slabs.restype = None
            library.kv_hash_slabs.argtypes = [_SIZE, _PTR, _SIZE, _PTR, _PTR, _PTR]
            library.kv_hash_slabs.restype = None
            return library
    logger.warning(
        "%s: no compiled %s library (built by `pip install` with a C compiler); KV checksums "
        "fall back to numpy + xxhash, same values, slower",
        here,
        LIBRARY_NAME,
    )
    return None


def combine_digests(digests: Sequence[int]) -> int:
    """The transfer checksum from its slab digests, in (layer, K/V) order."""
    return xxhash.xxh64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


class SlabJob:
    """One transfer's copy-and-hash (or hash) of ``runs``, run one slab range at a time.

    Validates shapes and bounds once (``ValueError``), so that no range can touch memory
    outside the slabs; ``digests`` may then run on several threads for disjoint ranges.
    """

    def __init__(self, src: Slabs, dst: Slabs | None, runs: Sequence[Run]) -> None:
        self.src, self.dst, self.runs = src, dst, runs
        self.num_slabs = len(src)
        self.block_bytes = _block_bytes(src, "source")
        if any(run.src_start < 0 or run.dst_start < 0 or run.length < 0 for run in runs):
            raise ValueError(f"negative block index or length in runs {list(runs)[:8]}")
        num_src_blocks = max((run.src_start + run.length for run in runs), default=0)
        _check_slabs(src, "source", self.block_bytes, num_src_blocks, writeable=False)
        if dst is not None:
            if len(dst) != self.num_slabs:
                raise ValueError(f"{self.num_slabs} source slabs but {len(dst)} destination slabs")
            num_dst_blocks = max((run.dst_start + run.length for run in runs), default=0)
            _check_slabs(dst, "destination", self.block_bytes, num_dst_blocks, writeable=True)
        self._library = load_library()
        if self._library is not None:
            self._prepare_native()

    @property
    def num_bytes(self) -> int:
        """Bytes per slab times slabs: what the job reads."""
        return sum(run.length for run in self.runs) * self.block_bytes * self.num_slabs

    def digests(self, lo: int, hi: int) -> list[int]:
        """Copies (if there is a destination) and hashes slabs ``lo .. hi-1``; their digests."""
        if lo >= hi:
            return []
        if self._library is None:
            return [self._python_digest(i) for i in range(lo, hi)]
        out = np.zeros(hi - lo, dtype=np.uint64)
        src = self._src_bases.ctypes.data + 8 * lo
        runs = (len(self._lengths), self._src_offsets.ctypes.data)
        lengths, digests = self._lengths.ctypes.data, out.ctypes.data
        if self._dst_bases is None:
            self._library.kv_hash_slabs(hi - lo, src, *runs, lengths, digests)
        else:
            dst = self._dst_bases.ctypes.data + 8 * lo
            dst_offsets = self._dst_offsets.ctypes.data
            self._library.kv_copy_hash_slabs(
                hi - lo, src, dst, *runs, dst_offsets, lengths, digests
            )
        return [int(d) for d in out]

    def _prepare_native(self) -> None:
        table = np.array(self.runs, dtype=np.int64).reshape(-1, 3)
        self._src_offsets = np.ascontiguousarray(table[:, 0] * self.block_bytes)
        self._dst_offsets = np.ascontiguousarray(table[:, 1] * self.block_bytes)
        self._lengths = np.ascontiguousarray(table[:, 2] * self.block_bytes)
        self._src_bases = _base_pointers(self.src)
        self._dst_bases = None if self.dst is None else _base_pointers(self.dst)

    def _python_digest(self, index: int) -> int:
        hasher = xxhash.xxh64()
        src = self.src[index]
        dst = None if self.dst is None else self.dst[index]
        for src_start, dst_start, length in split_runs(self.runs, self._chunk_blocks()):
            piece = src[src_start : src_start + length]
            if dst is not None:
                piece = dst[dst_start : dst_start + length]
                np.copyto(piece, src[src_start : src_start + length])
            hasher.update(piece.data)
        return hasher.intdigest()

    def _chunk_blocks(self) -> int:
        return max(1, CHUNK_BYTES // max(1, self.block_bytes))


def _block_bytes(slabs: Slabs, side: str) -> int:
    if len(slabs) == 0:
        raise ValueError(f"no {side} slabs")
    return int(slabs[0].shape[-1])


def _check_slabs(
    slabs: Slabs, side: str, block_bytes: int, num_blocks: int, writeable: bool
) -> None:
    for index, slab in enumerate(slabs):
        if slab.ndim != 2 or slab.dtype != np.uint8 or not _has_contiguous_blocks(slab):
            raise ValueError(
                f"{side} slab {index}: need [num_blocks, {block_bytes}] uint8 with contiguous "
                f"blocks, got shape {slab.shape} {slab.dtype} strides {slab.strides}"
            )
        if slab.shape[1] != block_bytes:
            raise ValueError(
                f"{side} slab {index}: {slab.shape[1]} bytes a block, not {block_bytes}"
            )
        if slab.shape[0] < num_blocks:
            raise ValueError(
                f"{side} slab {index} has {slab.shape[0]} blocks, runs need {num_blocks}"
            )
        if writeable and not slab.flags.writeable:
            raise ValueError(f"{side} slab {index} is read-only")


def _has_contiguous_blocks(slab: np.ndarray) -> bool:
    """Rows of ``shape[1]`` bytes back to back (a stride along a dimension of size 1 or 0 is
    meaningless, and numpy may report anything there)."""
    num_blocks, block_bytes = slab.shape
    rows_ok = num_blocks <= 1 or slab.strides[0] == block_bytes
    return rows_ok and (block_bytes <= 1 or slab.strides[1] == 1)


def _base_pointers(slabs: Slabs) -> np.ndarray:
    """Each slab's address, as a C array of pointers."""
    if isinstance(slabs, np.ndarray):
        start, stride = slabs.ctypes.data, slabs.strides[0]
        return np.arange(len(slabs), dtype=np.uint64) * np.uint64(stride) + np.uint64(start)
    return np.array([slab.ctypes.data for slab in slabs], dtype=np.uint64)
