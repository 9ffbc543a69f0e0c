"""The one lazy registry of KV transports, and the per-peer-pair choice between them.

A transport's module is imported only when it is created, so a CPU machine never imports
CUDA and the router (``choose_transport``) never imports torch or zmq.

``choose_transport(src, dst, forced)``, first match wins:

======================================================  ==========
condition                                               transport
======================================================  ==========
``forced`` is not ``"auto"``                             ``forced``
same ``host_id``, both peers ask for ``cuda_ipc``       ``cuda_ipc``
either peer asks for ``tcp``                            ``tcp``
same ``host_id``, source has a ``kv_segment``, and      ``shm``
neither peer asks for ``cuda_ipc``
otherwise                                               ``tcp``
======================================================  ==========

A peer's ``PeerInfo.transport`` is what it asks for: ``cuda_ipc`` means its pool is on a GPU
(and ``kv_segment`` holds its CUDA IPC handle). Pools on different device kinds (one GPU, one
CPU), or GPUs on different hosts, use ``tcp``, which stages GPU blocks through host memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.protocol.messages import PeerInfo
    from kvrelay.transport.base import KvTransport

_REGISTRY: dict[str, tuple[str, str]] = {
    "shm": ("kvrelay.transport.shm", "ShmTransport"),
    "tcp": ("kvrelay.transport.tcp", "TcpTransport"),
    "cuda_ipc": ("kvrelay.transport.cuda_ipc", "CudaIpcTransport"),
}
TRANSPORT_NAMES: tuple[str, ...] = tuple(_REGISTRY)
AUTO = "auto"


def create_transport(name: str, **kwargs: Any) -> KvTransport:
    """A new transport by name; ``kwargs`` go to its constructor. Unknown name: ValueError."""
    module_name, class_name = _REGISTRY[_check_name(name, allow_auto=False)]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)


def available_transports() -> tuple[str, ...]:
    """The names that can run on this machine (``cuda_ipc`` needs a CUDA device; imports torch)."""
    import torch

    from kvrelay.transport import shm_pool

    names = ["tcp"]
    if shm_pool._posixshmem is not None:
        names.insert(0, "shm")
    if torch.cuda.is_available():
        names.append("cuda_ipc")
    return tuple(names)


def choose_transport(src: PeerInfo, dst: PeerInfo, forced: str = AUTO) -> str:
    """The transport for pulling ``src``'s KV into ``dst``; see the module's table."""
    if _check_name(forced, allow_auto=True) != AUTO:
        return forced
    asked = {
        _check_name(src.transport, allow_auto=True),
        _check_name(dst.transport, allow_auto=True),
    }
    same_host = src.host_id == dst.host_id
    if same_host and asked == {"cuda_ipc"}:
        return "cuda_ipc"
    if "tcp" in asked:
        return "tcp"
    if same_host and src.kv_segment and "cuda_ipc" not in asked:
        return "shm"
    return "tcp"


def _check_name(name: str, allow_auto: bool) -> str:
    valid = (AUTO, *TRANSPORT_NAMES) if allow_auto else TRANSPORT_NAMES
    if name not in valid:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(valid)}")
    return name
