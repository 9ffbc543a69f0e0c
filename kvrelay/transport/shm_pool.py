"""A KV pool inside a named POSIX shared-memory segment, so same-host peers can map it.

Lifetime::

    creator (the runner)        SharedKvPool.create(name, layout)   registers with the tracker
    peers (decode, tests)       SharedKvPool.attach(name, layout)   not registered: its exit
                                                                    never unlinks the segment
    creator on shutdown         pool.close(unlink=True)             name gone, peers' maps stay
    every process               memory unmapped when its last tensor over the segment is freed
    `kvrelay up` on exit        cleanup_segments("kvrelay-{cluster_id}-")  leftovers of crashes

Python's ``SharedMemory`` registers every *attaching* process with its resource tracker
before 3.13, and that tracker unlinks the segment when the attacher exits. Unregistering after
the fact is no fix: children started by ``multiprocessing`` share their parent's tracker, so
it would drop the creator's registration too. So segments are opened here directly (the same
``shm_open`` + ``mmap`` that ``SharedMemory`` uses) and only the creator registers: a creator
that dies without unlinking still has its segment unlinked by its tracker.

The tensor is built over the ``mmap`` with ``torch.frombuffer``; the mapping is released when
the last tensor viewing it is freed, so ``close()`` never fails on views still held elsewhere.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any

from kvrelay.cachetier.segments import SHM_DIR, shm_room
from kvrelay.kernels import hugepages
from kvrelay.protocol.errors import LayoutMismatch
from kvrelay.transport.blocks import pool_bytes, pool_shape, torch_dtype

if TYPE_CHECKING:
    import torch

    from kvrelay.protocol.messages import KvLayout

try:
    import _posixshmem
except ImportError:  # not a POSIX platform
    _posixshmem = None

logger = logging.getLogger(__name__)

_NAME_PART = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
_MAX_NAME_LEN = 200
_TRACKER_TYPE = "shared_memory"


def segment_name(cluster_id: str, instance_id: str, kind: str) -> str:
    """``kvrelay-{cluster_id}-{instance_id}-{kind}``; raises ValueError for unsafe parts."""
    for label, part in (("cluster_id", cluster_id), ("instance_id", instance_id), ("kind", kind)):
        if not _NAME_PART.fullmatch(part):
            raise ValueError(f"{label} {part!r}: use letters, digits, '_', '.', inner '-'")
    name = f"kvrelay-{cluster_id}-{instance_id}-{kind}"
    if len(name) > _MAX_NAME_LEN:
        raise ValueError(f"segment name longer than {_MAX_NAME_LEN}: {name!r}")
    return name


def list_segments(prefix: str) -> list[str]:
    """Names of the segments under /dev/shm starting with ``prefix`` (Linux), sorted."""
    _check_prefix(prefix)
    if not SHM_DIR.is_dir():
        return []
    return sorted(entry for entry in os.listdir(SHM_DIR) if entry.startswith(prefix))


def cleanup_segments(prefix: str) -> list[str]:
    """Unlinks every segment whose name starts with ``prefix``; returns the names removed.

    Processes that still map one keep their memory until they unmap it.
    """
    removed = []
    for name in list_segments(prefix):
        try:
            _shm().shm_unlink("/" + name)
        except FileNotFoundError:
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d shared-memory segments with prefix %r", len(removed), prefix)
    return removed


class SharedKvPool:
    """One KV pool tensor (``[L, 2, blocks, block_size, heads, dim]``) in a named segment."""

    def __init__(self, name: str, layout: KvLayout, mapping: mmap.mmap, is_owner: bool) -> None:
        """Use ``create`` or ``attach``."""
        import torch

        num_bytes = pool_bytes(layout)
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)
        self._tensor: torch.Tensor | None = flat.view(torch_dtype(layout.dtype)).view(
            pool_shape(layout)
        )
        self.name = name
        self.layout = layout
        self.is_owner = is_owner
        self._is_unlinked = False

    @classmethod
    def create(cls, name: str, layout: KvLayout) -> SharedKvPool:
        """A new zero-filled segment; raises FileExistsError if ``name`` is taken."""
        size = pool_bytes(layout)
        if size <= 0:
            raise ValueError(f"empty layout {layout}")
        room = shm_room()
        if room is not None and size > room:
            # the segment is sparse: creating it would succeed, and the first write past the
            # room /dev/shm has would kill the worker with SIGBUS in the middle of serving
            raise ValueError(
                f"the KV pool needs {size / 2**20:.0f} MiB of shared memory and {SHM_DIR} has "
                f"{room / 2**20:.0f} MiB free: give it more (docker run --shm-size, compose "
                "shm_size, a Kubernetes emptyDir of medium Memory at /dev/shm), or lower "
                "--kv-cache-memory / --num-blocks, or use --transport tcp (a private pool)"
            )
        fd = _shm().shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
            hugepages.advise_mapping(mapping)  # before the zero pages are touched
        except OSError:
            _shm().shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, _TRACKER_TYPE)
        logger.debug("created segment %s (%d bytes)", name, size)
        return cls(name, layout, mapping, is_owner=True)

    @classmethod
    def attach(cls, name: str, layout: KvLayout) -> SharedKvPool:
        """Maps an existing segment (untracked: this process's exit never unlinks it).

        Raises:
            FileNotFoundError: no segment has that name.
            LayoutMismatch: the segment's size does not fit ``layout``.
        """
        fd = _shm().shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            expected = pool_bytes(layout)
            if not expected <= size < expected + mmap.PAGESIZE:
                raise LayoutMismatch(
                    f"segment {name} holds {size} bytes; {layout} needs {expected}"
                )
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, layout, mapping, is_owner=False)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._tensor

    @property
    def is_closed(self) -> bool:
        return self._tensor is None

    def unlink(self) -> None:
        """Removes the name (creator only); mappings stay valid. Idempotent."""
        if not self.is_owner:
            raise ValueError(f"segment {self.name}: only its creator unlinks it")
        if self._is_unlinked:
            return
        self._is_unlinked = True
        try:
            _shm().shm_unlink("/" + self.name)
        except FileNotFoundError:
            logger.warning("segment %s was already unlinked by someone else", self.name)
            return
        resource_tracker.unregister("/" + self.name, _TRACKER_TYPE)

    def close(self, unlink: bool = False) -> None:
        """Drops this object's view (memory is unmapped once no tensor uses it); idempotent.

        Args:
            unlink: also remove the segment's name (creator only).
        """
        if unlink:
            self.unlink()
        self._tensor = None

    def __enter__(self) -> SharedKvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(unlink=self.is_owner)

    def __repr__(self) -> str:
        state = "closed" if self.is_closed else "open"
        return f"SharedKvPool({self.name!r}, {self.layout}, owner={self.is_owner}, {state})"


def _shm() -> Any:
    """The ``_posixshmem`` module that ``multiprocessing.shared_memory`` uses."""
    if _posixshmem is None:
        raise OSError("POSIX shared memory is not available on this platform")
    return _posixshmem


def _check_prefix(prefix: str) -> None:
    if not prefix or "/" in prefix or prefix.startswith("."):
        raise ValueError(f"unsafe segment prefix {prefix!r}")
