"""A worker's settings and the pieces it builds from them (host id, tiers, KV layout)."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvrelay.cachetier.base import BlockFormat, KvTier
from kvrelay.cachetier.manager import TieredCache
from kvrelay.cachetier.param_pool import ParamPool
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.identity import model_identity
from kvrelay.engine.loader import TORCH_DTYPES
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.messages import KvLayout, Role
from kvrelay.transport.curve import SocketSecurity

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    role: Role  # prefill | decode | colocated
    model: str  # checkpoint directory
    router_addr: str  # ZMQ address(es) of the routers' control sockets, comma-separated
    cluster_id: str = "default"  # namespaces shared-memory names of one cluster
    instance_id: str = ""  # unique per cluster; default "<role>-<pid>"
    host: str = "127.0.0.1"  # address to bind
    advertise_host: str = ""  # address peers and the router use; default: host
    status_port: int = 0  # /health /ready /metrics; 0 = any free port
    peer_port: int = 0  # KV hand-off socket; 0 = any free port
    transport: str = "auto"  # auto | shm | tcp | cuda_ipc
    host_id: str = ""  # equal host ids share memory; default: this machine's id
    served_model_name: str = ""  # the name clients use; default: the directory name
    heartbeat_interval: float = 0.2  # seconds between load reports
    router_timeout: float = 2.0  # a router silent this long is gone: abort its requests
    lease_ttl: float = 30.0  # prefill keeps handed-off blocks this long without an ack
    transfer_timeout: float = 10.0  # decode's limit for one pull
    host_pool: str = "auto"  # L1 shared-memory pool name; "auto": one per host and model; "": off
    host_pool_bytes: int = 256 << 20  # L1 capacity (the first process on the host sets it)
    redis_url: str = ""  # L2 global tier, e.g. redis://host:6379/0; "": off
    redis_password_file: str = ""  # L2 AUTH password, first line of the file (wins over the URL's)
    redis_ca_file: str = ""  # L2 TLS (rediss://): CA bundle that signed the server's certificate
    redis_cert_file: str = ""  # L2 TLS: client certificate, when Redis asks for one
    redis_key_file: str = ""  # L2 TLS: the client certificate's key
    l2_encrypt: bool | None = None  # AEAD on L2 blocks; None: on when a cluster secret is set
    corrupt_transfers: int = 0  # test hook: corrupt this many received transfers
    param_peers: str = ""  # hosts serving the weights (`kvrelay pool serve`), nearest first
    param_pool: bool = True  # attach weights from the host's parameter pool (made once per host)
    drain_timeout: float = 30.0  # on SIGTERM: seconds to finish running requests before exiting
    engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    credential: ClusterCredential | None = None  # None: open sockets (--insecure-no-auth)

    def __post_init__(self) -> None:
        if not self.router_timeout > self.heartbeat_interval:
            raise ValueError(
                f"router_timeout ({self.router_timeout}) must exceed the heartbeat interval "
                f"({self.heartbeat_interval})"
            )
        if self.role not in (Role.PREFILL, Role.DECODE, Role.COLOCATED):
            raise ValueError(f"worker role must be prefill, decode or colocated, got {self.role}")
        if self.transport not in ("auto", "shm", "tcp", "cuda_ipc"):
            raise ValueError(
                f"transport must be auto, shm, tcp or cuda_ipc, got {self.transport!r}"
            )
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")


def check_transport_for_device(transport: str, device: torch.device) -> None:
    """Raises ValueError for a transport that a KV pool on ``device`` cannot serve."""
    if transport == "cuda_ipc" and device.type != "cuda":
        raise ValueError("transport cuda_ipc needs a CUDA KV pool: start with --device cuda")
    if transport == "shm" and device.type != "cpu":
        raise ValueError("transport shm needs a CPU KV pool: use auto, cuda_ipc or tcp on a GPU")


def resolve_identity(config: WorkerConfig, hostname: str, pid: int) -> WorkerConfig:
    """``config`` with its instance id and advertised address filled in when unset.

    The id defaults to ``ROLE-HOSTNAME-PID`` (the hostname keeps ids unique across
    containers, where pids repeat); the address to ``host``, or to the hostname when ``host``
    is a wildcard, which is no address for peers.
    """
    instance_id = config.instance_id or f"{config.role.value}-{hostname}-{pid}"
    public = config.advertise_host or config.host
    if public in ("0.0.0.0", "::", ""):
        public = hostname
    return dataclasses.replace(config, instance_id=instance_id, advertise_host=public)


def l1_scope(cluster_id: str, host_id: str) -> str:
    """The scope of the default L1 pool name: the cluster and the host. Two clusters on one
    machine, or two "hosts" that share /dev/shm (containers, network namespaces), get pools
    of their own; only an explicit ``--host-pool NAME`` shares one on purpose."""
    return re.sub(r"[^A-Za-z0-9_.]+", "_", f"{cluster_id}.{host_id}").strip("_") or "host"


def default_host_id() -> str:
    """Same value for every process on one machine (and one IPC namespace)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return Path(path).read_text().strip() + "@" + socket.gethostname()
        except OSError:
            continue
    return socket.gethostname()


def create_tiers(config: WorkerConfig, engine_config: EngineConfig) -> TieredCache | None:
    """The tiers below the device pool this worker uses: L1 host pool, then L2 Redis."""
    mc = engine_config.model_config
    fmt = BlockFormat(
        mc.num_layers, engine_config.cache.block_size, mc.num_kv_heads, mc.head_dim,
        engine_config.dtype,
    )  # fmt: skip
    tiers: list[Any] = []
    if config.host_pool:
        from kvrelay.cachetier.host_ops import default_pool_name
        from kvrelay.cachetier.host_pool import HostPool

        name = config.host_pool
        if name == "auto":  # one per cluster, host and model: never shared by accident
            scope = l1_scope(config.cluster_id, config.host_id or default_host_id())
            name = default_pool_name(fmt, model_identity(config.model, engine_config.dtype), scope)
        tiers.append(HostPool.open(name, config.host_pool_bytes, fmt, record_changes=True))
    if config.redis_url:
        tiers.append(create_redis_tier(config, fmt))
    return TieredCache(tiers) if tiers else None


def create_redis_tier(config: WorkerConfig, fmt: BlockFormat) -> KvTier:
    """The L2 tier: sealed with the cluster's keys (encrypted unless ``l2_encrypt`` is
    False); unkeyed, with a warning, when there is no cluster secret."""
    from kvrelay.cachetier.redis_conn import RedisEndpoint
    from kvrelay.cachetier.redis_tier import RedisTier

    endpoint = RedisEndpoint(
        config.redis_url,
        password_file=config.redis_password_file,
        ca_file=config.redis_ca_file,
        cert_file=config.redis_cert_file,
        key_file=config.redis_key_file,
    )
    credential = config.credential  # the one that secures the sockets too
    encrypt = credential is not None if config.l2_encrypt is None else config.l2_encrypt
    return RedisTier(endpoint, fmt, credential=credential, encrypt=encrypt)


def layout_from_shape(shape: tuple[int, ...], dtype: torch.dtype) -> KvLayout:
    names = {v: k for k, v in TORCH_DTYPES.items()}
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = shape
    return KvLayout(num_layers, num_blocks, block_size, num_kv_heads, head_dim, names[dtype])


def open_param_pool(config: WorkerConfig, dtype: str, security: SocketSecurity) -> ParamPool:
    """This host's parameter pool: attached if ready, else filled from ``param_peers``
    (a chain), else built from the checkpoint on disk."""
    from kvrelay.cachetier.param_locks import interest
    from kvrelay.cachetier.param_ops import list_pools, pool_name
    from kvrelay.cachetier.param_pool import ParamPool
    from kvrelay.cachetier.param_transfer import fetch_pool
    from kvrelay.transport.chain_wire import ChainError

    peers = [a.strip() for a in config.param_peers.split(",") if a.strip()]
    fingerprint = model_identity(config.model, dtype)
    name = pool_name(fingerprint, dtype)
    with interest(name):  # no gc frees a pool found ready here before the attach below
        if peers and not any(p.name == name and p.state == "ready" for p in list_pools()):
            try:
                return fetch_pool(fingerprint, dtype, peers, security=security).pool
            # no peer, another process fills it, or a peer serves other weights (ValueError)
            except (ChainError, FileExistsError, ValueError) as e:
                logger.warning("weights from peers failed (%s); using the host pool or disk", e)
        return ParamPool.attach_or_create(config.model, dtype)


def pool_weights(pool: ParamPool, device: torch.device) -> Mapping[str, torch.Tensor]:
    """The weights an engine on ``device`` gets from the pool: on CPU the pool's zero-copy
    views themselves; on CUDA a device copy from the pinned segment (``param_device``)."""
    if device.type == "cpu":
        return pool.weights
    from kvrelay.cachetier.param_device import copy_to_device

    copied = copy_to_device(pool, device)
    logger.info(
        "weights of pool %s copied to %s in %.2f s (%s)",
        pool.name,
        device,
        copied.seconds,
        "pinned" if copied.is_pinned else "pageable",
    )
    return copied.weights
