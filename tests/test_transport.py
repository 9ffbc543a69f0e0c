"""KV transports: real processes, real shared memory, real sockets, exact bytes.

The source side runs in a spawned process (``_source_main``): it creates its pool (in shared
memory, or a plain tensor), fills it from a seed, serves ``KvPull`` through ``KvSource`` on a
ROUTER socket and leases block ids on command. The test process regenerates the same pool
from the seed to know every expected byte. Each test that creates segments uses its own name
prefix and asserts that none remain under /dev/shm afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
import zmq

from kvrelay.cachetier.segments import SHM_DIR
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.errors import (
    ChecksumMismatch,
    FingerprintMismatch,
    LayoutMismatch,
    ProtocolError,
    SourceGone,
    TransferError,
)
from kvrelay.protocol.messages import KvData, KvLayout, KvPull, PeerInfo, Role, decode, encode
from kvrelay.transport import slabhash
from kvrelay.transport.base import PullSpec
from kvrelay.transport.blocks import Run, block_runs, paired_runs, pool_shape, torch_dtype
from kvrelay.transport.checksum import kv_checksum, pool_slabs
from kvrelay.transport.copier import SlabCopier
from kvrelay.transport.curve import SocketSecurity
from kvrelay.transport.registry import (
    TRANSPORT_NAMES,
    available_transports,
    choose_transport,
    create_transport,
)
from kvrelay.transport.shm_pool import (
    SharedKvPool,
    cleanup_segments,
    list_segments,
    segment_name,
)
from kvrelay.transport.tcp import KvSource

REPO_ROOT = Path(__file__).resolve().parent.parent
FINGERPRINT = b"model-under-test"
# 16 KiB blocks: a 5-block frame is past ZMQ's zero-copy threshold (64 KiB).
SRC_LAYOUT = KvLayout(3, 40, 16, 4, 64, "float32")
DST_LAYOUT = dataclasses.replace(SRC_LAYOUT, num_blocks=32)
SRC_IDS = [7, 3, 4, 5, 30, 12]  # a run (3, 4, 5) among single blocks
DST_IDS = [0, 9, 10, 11, 2, 25]
SEED = 1234
PULL_TIMEOUT = 10.0
CREDENTIAL = ClusterCredential(bytes(range(32)))  # the source (another process) shares it

needs_shm = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


# -- pools and byte comparisons -----------------------------------------------------------------


def make_pool(layout: KvLayout, seed: int) -> torch.Tensor:
    """Deterministic random pool contents (the same in every process)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(pool_shape(layout), generator=generator)
    return values.to(torch_dtype(layout.dtype))


def block_bytes_of(pool: torch.Tensor, block_id: int) -> bytes:
    """Every layer's K and V bytes of one block."""
    flat = pool.view(torch.uint8).view(pool.shape[0], 2, pool.shape[2], -1)
    return flat[:, :, block_id].contiguous().numpy().tobytes()


def assert_pulled(
    dst: torch.Tensor,
    before: torch.Tensor,
    dst_ids: list[int],
    src: torch.Tensor,
    src_ids: list[int],
) -> None:
    """Target blocks equal the source's, byte for byte; every other block is untouched."""
    for s, d in zip(src_ids, dst_ids):
        assert block_bytes_of(dst, d) == block_bytes_of(src, s), (s, d)
    for d in set(range(dst.shape[2])) - set(dst_ids):
        assert block_bytes_of(dst, d) == block_bytes_of(before, d), d


def fresh_dst(layout: KvLayout = DST_LAYOUT, seed: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
    dst = make_pool(layout, seed)
    return dst, dst.clone()


def peer_info(addr: str, segment: str | None, layout: KvLayout, **changes: Any) -> PeerInfo:
    info = PeerInfo("p0", Role.PREFILL, "host-a", addr, "", segment, layout, FINGERPRINT)
    return dataclasses.replace(info, **changes)


# -- the source process -------------------------------------------------------------------------


def _receive_pull(router: zmq.Socket) -> tuple[bytes, KvPull] | None:
    """The next ``[identity, KvPull]``; anything else (a stray peer on a reused port) is None."""
    parts = router.recv_multipart()
    if len(parts) != 2:
        return None
    try:
        return parts[0], decode(parts[1], KvPull)
    except ProtocolError:
        return None


def _source_main(conn: Connection, name: str | None, layout: KvLayout, seed: int) -> None:
    """Source process: a pool (shared when ``name``) served through KvSource on a ROUTER."""
    shared = SharedKvPool.create(name, layout) if name else None
    pool = (
        shared.tensor
        if shared
        else torch.empty(pool_shape(layout), dtype=torch_dtype(layout.dtype))
    )
    pool.copy_(make_pool(layout, seed))
    leases: dict[str, list[int]] = {}
    delays: dict[str, float] = {}
    context = zmq.Context()
    security = SocketSecurity(CREDENTIAL)  # a worker's peer socket is a CURVE server
    router = context.socket(zmq.ROUTER)
    security.server(router)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    source = KvSource(pool, leases.get)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    conn.send(f"tcp://127.0.0.1:{port}")
    try:
        while True:
            for sock, _ in poller.poll(1000):
                if sock is router:
                    pull = _receive_pull(router)
                    if pull is not None:
                        time.sleep(delays.pop(pull[1].request_id, 0.0))
                        source.reply(router, *pull)
                    continue
                command, *args = conn.recv()
                if command == "stop":
                    return
                if command == "lease":
                    leases[args[0]] = args[1]
                    conn.send(kv_checksum(pool, args[1]))
                elif command == "delay":
                    delays[args[0]] = args[1]
                    conn.send(None)
    except EOFError:
        return
    finally:
        router.close()
        security.stop(context)
        context.term()
        if shared is not None:
            shared.close(unlink=True)


@dataclasses.dataclass
class SourceProcess:
    process: Any
    conn: Connection
    info: PeerInfo
    expected: torch.Tensor  # the source pool's contents, regenerated here

    def call(self, *command: Any) -> Any:
        self.conn.send(command)
        assert self.conn.poll(30), f"source did not answer {command[0]}"
        return self.conn.recv()

    def lease(self, request_id: str, block_ids: list[int], lease_s: float = 60.0) -> PullSpec:
        checksum = self.call("lease", request_id, block_ids)
        return PullSpec(request_id, self.info, block_ids, checksum, time.time() + lease_s)


def _stop(process: Any, conn: Connection) -> None:
    if process.is_alive():
        conn.send(("stop",))
        process.join(timeout=20)
    if process.is_alive():
        process.kill()
        process.join(timeout=20)


@contextmanager
def source_process(name: str | None, layout: KvLayout = SRC_LAYOUT) -> Iterator[SourceProcess]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_source_main, args=(child, name, layout, SEED), daemon=True)
    process.start()
    child.close()
    try:
        assert parent.poll(120), "source process did not start"
        addr = parent.recv()
        info = peer_info(addr, name, layout)
        yield SourceProcess(process, parent, info, make_pool(layout, SEED))
    finally:
        _stop(process, parent)


def _unique_cluster() -> str:
    return f"test{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def source() -> Iterator[SourceProcess]:
    """One shared-memory source process for the module; its segment is checked at the end."""
    if not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm (Linux)")
    cluster = _unique_cluster()
    with source_process(segment_name(cluster, "p0", "kv")) as proc:
        yield proc
    assert list_segments(f"kvrelay-{cluster}-") == []


@pytest.fixture
def prefix() -> Iterator[str]:
    """A cluster id of this test's own; no segment with its prefix may outlive the test."""
    cluster = _unique_cluster()
    yield cluster
    assert list_segments(f"kvrelay-{cluster}-") == []


@pytest.fixture
def transport_factory() -> Iterator[Any]:
    made: list[Any] = []

    def make(name: str) -> Any:
        kwargs = {"security": SocketSecurity(CREDENTIAL)} if name == "tcp" else {}
        made.append(create_transport(name, **kwargs))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


# -- pulls across processes ---------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_pull_across_processes(source: SourceProcess, transport_factory: Any, name: str) -> None:
    transport = transport_factory(name)
    dst, before = fresh_dst()
    spec = source.lease(f"{name}-r1", SRC_IDS)
    stats = transport.pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    assert_pulled(dst, before, DST_IDS, source.expected, SRC_IDS)
    assert stats.num_bytes == 3 * 2 * len(SRC_IDS) * 16 * 4 * 64 * 4
    # a second pull on the cached attachment / socket: one run on both sides (zero-copy frames)
    before = dst.clone()
    spec = source.lease(f"{name}-r2", [20, 21, 22, 23, 24])
    transport.pull(spec, dst, [12, 13, 14, 15, 16], DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    assert_pulled(dst, before, [12, 13, 14, 15, 16], source.expected, [20, 21, 22, 23, 24])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_wrong_checksum_is_a_mismatch(
    source: SourceProcess, transport_factory: Any, name: str
) -> None:
    spec = source.lease(f"{name}-bad-sum", SRC_IDS)
    spec = dataclasses.replace(spec, checksum=spec.checksum ^ 1)
    dst, _ = fresh_dst()
    with pytest.raises(ChecksumMismatch):
        transport_factory(name).pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_source_changed_after_checksum_is_a_mismatch(
    source: SourceProcess, transport_factory: Any, name: str
) -> None:
    """The source's blocks change between KvReady and the pull (recycled): caught, not used."""
    spec = source.lease(f"{name}-recycled", SRC_IDS)
    peer = SharedKvPool.attach(source.info.kv_segment, SRC_LAYOUT)  # type: ignore[arg-type]
    try:
        block = peer.tensor[1, 0, SRC_IDS[-1]]
        original = block.clone()
        block.add_(1.0)
        dst, _ = fresh_dst()
        transport = transport_factory(name)
        with pytest.raises(ChecksumMismatch):
            transport.pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
        block.copy_(original)
        dst, before = fresh_dst()
        transport.pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
        assert_pulled(dst, before, DST_IDS, source.expected, SRC_IDS)
    finally:
        peer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_layout_and_fingerprint_mismatch(
    source: SourceProcess, transport_factory: Any, name: str
) -> None:
    transport = transport_factory(name)
    spec = source.lease(f"{name}-checks", SRC_IDS)
    dst, before = fresh_dst()
    other_layout = dataclasses.replace(DST_LAYOUT, head_dim=32)
    other_src = dataclasses.replace(spec, src=peer_info("tcp://x:1", None, other_layout))
    with pytest.raises(LayoutMismatch):
        transport.pull(other_src, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    bf16 = dataclasses.replace(
        spec,
        src=dataclasses.replace(spec.src, layout=dataclasses.replace(SRC_LAYOUT, dtype="bfloat16")),
    )
    with pytest.raises(LayoutMismatch):
        transport.pull(bf16, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    with pytest.raises(FingerprintMismatch):
        transport.pull(spec, dst, DST_IDS, DST_LAYOUT, b"another model", PULL_TIMEOUT)
    out_of_range = dataclasses.replace(spec, src_block_ids=[*SRC_IDS[:-1], SRC_LAYOUT.num_blocks])
    with pytest.raises(LayoutMismatch):
        transport.pull(out_of_range, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    with pytest.raises(ValueError, match="destination blocks"):
        transport.pull(spec, dst, DST_IDS[:-1], DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    assert torch.equal(dst, before), "a rejected pull wrote to the destination"


@pytest.mark.timeout(120)
def test_shm_expired_lease_is_source_gone(source: SourceProcess, transport_factory: Any) -> None:
    spec = source.lease("shm-expired", SRC_IDS, lease_s=-1.0)
    dst, before = fresh_dst()
    with pytest.raises(SourceGone, match="lease expired"):
        transport_factory("shm").pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    assert torch.equal(dst, before)


@pytest.mark.timeout(120)
def test_shm_missing_segment_is_source_gone(transport_factory: Any, prefix: str) -> None:
    info = peer_info("tcp://x:1", segment_name(prefix, "gone", "kv"), SRC_LAYOUT)
    spec = PullSpec("r", info, SRC_IDS, 0, time.time() + 60)
    dst, _ = fresh_dst()
    with pytest.raises(SourceGone, match="no longer exists"):
        transport_factory("shm").pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)


@pytest.mark.timeout(120)
def test_tcp_unknown_request_is_source_gone(source: SourceProcess, transport_factory: Any) -> None:
    spec = PullSpec("never-leased", source.info, SRC_IDS, 0, time.time() + 60)
    dst, _ = fresh_dst()
    with pytest.raises(SourceGone, match="refused"):
        transport_factory("tcp").pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)


@pytest.mark.timeout(120)
def test_tcp_late_reply_is_not_taken_for_the_next_pull(
    source: SourceProcess, transport_factory: Any
) -> None:
    transport = transport_factory("tcp")
    slow = source.lease("tcp-slow", SRC_IDS)
    source.call("delay", "tcp-slow", 1.5)
    dst, _ = fresh_dst()
    with pytest.raises(SourceGone, match="no reply"):
        transport.pull(slow, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, 0.3)
    # the late reply to tcp-slow (other blocks) arrives while this pull waits; it must be dropped
    spec = source.lease("tcp-next", [1, 2])
    dst, before = fresh_dst()
    transport.pull(spec, dst, [30, 31], DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    assert_pulled(dst, before, [30, 31], source.expected, [1, 2])


@pytest.mark.timeout(120)
def test_tcp_dead_peer_is_source_gone(transport_factory: Any) -> None:
    transport = transport_factory("tcp")
    with source_process(None) as peer:  # a plain (unshared) pool: nothing left behind
        spec = peer.lease("doomed", SRC_IDS)
        dst, before = fresh_dst()
        transport.pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
        peer.process.kill()
        peer.process.join(timeout=20)
        dst, before = fresh_dst()
        with pytest.raises(SourceGone, match="no reply"):
            transport.pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, 1.0)
    assert torch.equal(dst, before)


@contextmanager
def serving_thread(
    pool: torch.Tensor, leases: dict[str, list[int]], stale_first: bool = False
) -> Iterator[str]:
    """A ROUTER + KvSource in a thread of this process; optionally sends a stale reply first."""
    context = zmq.Context()
    security = SocketSecurity(CREDENTIAL)  # a worker's peer socket is a CURVE server
    router = context.socket(zmq.ROUTER)
    security.server(router)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    source = KvSource(pool, leases.get)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            pull = _receive_pull(router) if router.poll(50) else None
            if pull is not None:
                if stale_first:
                    stale = KvData("an-older-request", ok=True, num_frames=0)
                    router.send_multipart([pull[0], encode(stale)])
                source.reply(router, *pull)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(timeout=10)
        router.close()
        security.stop(context)
        context.term()


@pytest.mark.timeout(60)
def test_tcp_reply_for_another_request_is_dropped(transport_factory: Any) -> None:
    pool = make_pool(SRC_LAYOUT, SEED)
    with serving_thread(pool, {"r": SRC_IDS}, stale_first=True) as addr:
        spec = PullSpec(
            "r",
            peer_info(addr, None, SRC_LAYOUT),
            SRC_IDS,
            kv_checksum(pool, SRC_IDS),
            time.time() + 60,
        )
        dst, before = fresh_dst()
        transport_factory("tcp").pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
    assert_pulled(dst, before, DST_IDS, pool, SRC_IDS)


# -- bfloat16 and the checksum ------------------------------------------------------------------


@pytest.mark.timeout(60)
@needs_shm
def test_bfloat16_pools(transport_factory: Any, prefix: str) -> None:
    src_layout = dataclasses.replace(SRC_LAYOUT, dtype="bfloat16")
    dst_layout = dataclasses.replace(DST_LAYOUT, dtype="bfloat16")
    with SharedKvPool.create(segment_name(prefix, "p0", "kv"), src_layout) as shared:
        shared.tensor.copy_(make_pool(src_layout, SEED))
        checksum = kv_checksum(shared.tensor, SRC_IDS)
        with serving_thread(shared.tensor, {"r": SRC_IDS}) as addr:
            info = peer_info(addr, shared.name, src_layout)
            spec = PullSpec("r", info, SRC_IDS, checksum, time.time() + 60)
            for name in ("shm", "tcp"):
                dst, before = fresh_dst(dst_layout)
                transport_factory(name).pull(spec, dst, DST_IDS, dst_layout, FINGERPRINT, 10.0)
                assert_pulled(dst, before, DST_IDS, shared.tensor, SRC_IDS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checksum_is_xxh64_of_slab_digests_in_order(dtype: str) -> None:
    layout = KvLayout(2, 12, 4, 2, 8, dtype)
    pool = make_pool(layout, 7)
    ids = [5, 6, 7, 1, 9, 10]
    assert kv_checksum(pool, ids) == reference_checksum(pool, ids)
    assert kv_checksum(pool, ids) != kv_checksum(pool, [6, 5, 7, 1, 9, 10])  # block order
    swapped = pool.clone()
    swapped[0, 0], swapped[0, 1] = pool[0, 1], pool[0, 0]
    assert kv_checksum(swapped, ids) != kv_checksum(pool, ids)  # slab order
    empty = xxhash.xxh64_intdigest(b"")
    assert kv_checksum(pool, []) == xxhash.xxh64_intdigest(struct.pack("<4Q", *[empty] * 4))


def test_checksum_on_a_long_lived_copier_is_the_same() -> None:
    """Workers pass their own copier (threads kept between hand-offs); the value is the
    definition's, call after call, and the copier's threads are reused, not restarted."""
    layout = KvLayout(2, 24, 16, 2, 64, "float32")
    pool = make_pool(layout, 11)
    copier = SlabCopier(2, min_bytes_per_thread=1 << 10)  # a second thread for small pools

    def pool_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kv-copy")}

    try:
        for ids in ([3, 4, 5, 6], [23, 0, 17], list(range(24))):
            assert kv_checksum(pool, ids, copier=copier) == reference_checksum(pool, ids)
        workers = pool_threads()
        assert workers, "the copier ran a second thread"
        assert kv_checksum(pool, [1, 2], copier=copier) == reference_checksum(pool, [1, 2])
        assert pool_threads() == workers
    finally:
        copier.close()


def reference_checksum(pool: torch.Tensor, ids: list[int]) -> int:
    """The checksum definition, straight from python-xxhash over each block's bytes."""
    num_layers, _, num_blocks = pool.shape[:3]
    flat = pool.view(torch.uint8).view(num_layers, 2, num_blocks, -1).numpy()
    digests = [
        xxhash.xxh64_intdigest(b"".join(flat[layer, kv, b].tobytes() for b in ids))
        for layer in range(num_layers)
        for kv in range(2)
    ]
    return xxhash.xxh64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


COPY_CASES = {
    "contiguous": (list(range(4, 28)), list(range(6, 30))),
    "scattered": ([9, 2, 31, 17, 5, 22, 0, 38], [3, 30, 12, 7, 25, 1, 19, 8]),
    "mixed": (SRC_IDS, DST_IDS),
}


@pytest.mark.parametrize("case", sorted(COPY_CASES))
@pytest.mark.parametrize("num_threads", [1, 2, 3, 8])  # 8 > the 6 slabs: capped
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("stacked", [True, False], ids=["pools", "frames"])
def test_threaded_copy_equals_the_checksum_definition(
    case: str, num_threads: int, native: bool, stacked: bool, monkeypatch: Any
) -> None:
    if not native:
        monkeypatch.setattr(slabhash, "load_library", lambda: None)
    src_ids, dst_ids = COPY_CASES[case]
    src = make_pool(SRC_LAYOUT, SEED)
    dst, before = fresh_dst()
    src_slabs, dst_slabs = pool_slabs(src), pool_slabs(dst)
    copier = SlabCopier(num_threads, min_bytes_per_thread=0)
    try:
        if stacked:
            actual = copier.copy_and_checksum(src_slabs, dst_slabs, paired_runs(src_ids, dst_ids))
        else:
            runs = paired_runs(range(len(src_ids)), dst_ids)  # tcp: frames of the leased blocks
            frames = [slab[src_ids] for slab in src_slabs]
            actual = copier.copy_and_checksum(frames, list(dst_slabs), runs)
    finally:
        copier.close()
    assert actual == reference_checksum(src, src_ids)
    assert actual == kv_checksum(src, src_ids) == kv_checksum(dst, dst_ids)
    assert_pulled(dst, before, dst_ids, src, src_ids)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_threaded_copy_detects_a_corrupted_byte_in_any_slab(num_threads: int) -> None:
    src = make_pool(SRC_LAYOUT, SEED)
    expected = kv_checksum(src, SRC_IDS)
    runs = paired_runs(SRC_IDS, DST_IDS)
    copier = SlabCopier(num_threads, min_bytes_per_thread=0)
    try:
        for slab in range(2 * SRC_LAYOUT.num_layers):
            bad = src.clone()
            bad_bytes = pool_slabs(bad)[slab, SRC_IDS[slab % len(SRC_IDS)]]
            bad_bytes[(slab * 4099) % bad_bytes.size] ^= 1
            dst, _ = fresh_dst()
            actual = copier.copy_and_checksum(pool_slabs(bad), pool_slabs(dst), runs)
            assert actual != expected, slab
            assert actual == kv_checksum(dst, DST_IDS)
    finally:
        copier.close()


def test_copier_rejects_mismatched_slabs() -> None:
    copier = SlabCopier(2)
    src, dst = pool_slabs(make_pool(SRC_LAYOUT, SEED)), pool_slabs(fresh_dst()[0])
    with pytest.raises(ValueError):
        copier.copy_and_checksum(src[:4], dst, paired_runs(SRC_IDS, DST_IDS))
    with pytest.raises(ValueError):
        SlabCopier(0)
    copier.close()


def test_block_runs_and_paired_runs() -> None:
    assert block_runs([7, 8, 9, 2, 3, 5]) == [(7, 3), (2, 2), (5, 1)]
    assert block_runs([]) == []
    assert paired_runs([7, 8, 9, 2, 3], [0, 1, 5, 6, 7]) == [
        Run(7, 0, 2),
        Run(9, 5, 1),
        Run(2, 6, 2),
    ]
    assert paired_runs(range(3), [4, 5, 6]) == [Run(0, 4, 3)]
    with pytest.raises(ValueError):
        paired_runs([1, 2], [1])


# -- shared-memory lifetime ---------------------------------------------------------------------

_ATTACH_AND_EXIT = """
import sys, torch
from kvrelay.protocol.messages import KvLayout
from kvrelay.transport.shm_pool import SharedKvPool
layout = KvLayout(2, 4, 4, 2, 8, "float32")
pool = SharedKvPool.attach(sys.argv[1], layout)
assert pool.tensor[1, 1, 3, 0, 0, 0].item() == 42.0
pool.tensor[0, 0, 0, 0, 0, 0] = 7.0
pool.close()
"""


@needs_shm
def test_a_pool_larger_than_dev_shm_has_room_for_is_refused(prefix: str, monkeypatch) -> None:
    """The segment is sparse: made anyway, the first write past /dev/shm's room would kill
    the worker with SIGBUS mid-serving (a container's 64 MiB default against a 1 GiB pool)."""
    from kvrelay.transport import shm_pool

    layout = KvLayout(2, 4, 4, 2, 8, "float32")  # 4 KiB
    monkeypatch.setattr(shm_pool, "shm_room", lambda: 4095)
    with pytest.raises(ValueError, match=r"needs 0 MiB of shared memory .* --transport tcp"):
        SharedKvPool.create(segment_name(prefix, "p0", "kv"), layout)
    assert list_segments(f"kvrelay-{prefix}-") == []  # refused before the segment is made
    monkeypatch.setattr(shm_pool, "shm_room", lambda: 4096)
    with SharedKvPool.create(segment_name(prefix, "p0", "kv"), layout) as pool:
        assert pool.tensor.nbytes == 4096  # exactly the room: taken


def test_dev_shm_room_is_what_statvfs_says(monkeypatch) -> None:
    from kvrelay.transport import shm_pool

    assert (shm_pool.shm_room() or 0) >= 0
    monkeypatch.setattr(shm_pool.os, "statvfs", lambda _: (_ for _ in ()).throw(OSError(2, "x")))
    assert shm_pool.shm_room() is None  # no /dev/shm to ask: no check


@pytest.mark.timeout(60)
@needs_shm
def test_attaching_process_exit_does_not_unlink(prefix: str) -> None:
    """A fresh interpreter (its own resource tracker) attaches, writes, exits: segment stays."""
    layout = KvLayout(2, 4, 4, 2, 8, "float32")
    name = segment_name(prefix, "p0", "kv")
    pool = SharedKvPool.create(name, layout)
    try:
        assert torch.count_nonzero(pool.tensor) == 0  # zero-filled
        pool.tensor[1, 1, 3, 0, 0, 0] = 42.0
        proc = subprocess.run(
            [sys.executable, "-c", _ATTACH_AND_EXIT, name],
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert proc.returncode == 0, proc.stderr
        assert "leaked" not in proc.stderr, proc.stderr
        assert list_segments(name) == [name]
        assert pool.tensor[0, 0, 0, 0, 0, 0].item() == 7.0
        again = SharedKvPool.attach(name, layout)
        assert again.tensor[1, 1, 3, 0, 0, 0].item() == 42.0
        again.close()
    finally:
        pool.close(unlink=True)
    assert list_segments(name) == []
    pool.close(unlink=True)  # idempotent


@needs_shm
def test_attach_checks_size_and_existence(prefix: str) -> None:
    layout = KvLayout(2, 4, 4, 2, 8, "float32")
    name = segment_name(prefix, "p0", "kv")
    with SharedKvPool.create(name, layout) as pool:
        with pytest.raises(FileExistsError):
            SharedKvPool.create(name, layout)
        with pytest.raises(LayoutMismatch):
            SharedKvPool.attach(name, dataclasses.replace(layout, num_blocks=8))
        view = pool.tensor[0, 1]
    assert pool.is_closed
    view.fill_(1.0)  # a view outlives close(): the mapping goes with the last tensor
    with pytest.raises(FileNotFoundError):
        SharedKvPool.attach(name, layout)


@needs_shm
def test_cleanup_segments_removes_leftovers(prefix: str) -> None:
    ours = [segment_name(prefix, f"w{i}", "kv") for i in range(3)]
    other = segment_name(_unique_cluster(), "w0", "kv")
    for name in [*ours, other]:
        (SHM_DIR / name).write_bytes(b"\0" * 4096)  # what a killed worker leaves behind
    try:
        assert cleanup_segments(f"kvrelay-{prefix}-") == sorted(ours)
        assert list_segments(other) == [other]
        assert cleanup_segments(f"kvrelay-{prefix}-") == []
    finally:
        cleanup_segments(other)
    with pytest.raises(ValueError):
        cleanup_segments("")


def test_segment_names() -> None:
    assert segment_name("c1", "prefill-0", "kv") == "kvrelay-c1-prefill-0-kv"
    for bad in ("a/b", "", "-x", "a b", "../x"):
        with pytest.raises(ValueError):
            segment_name(bad, "p0", "kv")


# -- choosing and creating transports -----------------------------------------------------------


def _peer(host: str, segment: str | None = "seg", transport: str = "auto") -> PeerInfo:
    return dataclasses.replace(
        peer_info("tcp://h:1", segment, SRC_LAYOUT), host_id=host, transport=transport
    )


@pytest.mark.parametrize(
    ("src", "dst", "forced", "expected"),
    [
        (_peer("a"), _peer("a"), "auto", "shm"),
        (_peer("a", segment=None), _peer("a"), "auto", "tcp"),
        (_peer("a"), _peer("b"), "auto", "tcp"),
        (_peer("a"), _peer("b"), "shm", "shm"),  # forced wins
        (_peer("a"), _peer("a"), "tcp", "tcp"),
        (_peer("a", "cuda-ipc:x", "cuda_ipc"), _peer("a", None, "cuda_ipc"), "auto", "cuda_ipc"),
        (_peer("a", "cuda-ipc:x", "cuda_ipc"), _peer("b", None, "cuda_ipc"), "auto", "tcp"),
        (_peer("a", "cuda-ipc:x", "cuda_ipc"), _peer("a"), "auto", "tcp"),  # mixed devices
        (_peer("a"), _peer("a", transport="tcp"), "auto", "tcp"),  # a peer asks for tcp
        (_peer("a", transport="shm"), _peer("a"), "auto", "shm"),
    ],
)
def test_choose_transport(src: PeerInfo, dst: PeerInfo, forced: str, expected: str) -> None:
    assert choose_transport(src, dst, forced) == expected


def test_unknown_transport_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="shm, tcp, cuda_ipc"):
        create_transport("rdma")
    with pytest.raises(ValueError, match="auto, shm, tcp, cuda_ipc"):
        choose_transport(_peer("a"), _peer("a"), "rdma")
    with pytest.raises(ValueError):
        choose_transport(_peer("a", transport="carrier-pigeon"), _peer("a"))
    assert TRANSPORT_NAMES == ("shm", "tcp", "cuda_ipc")
    names = available_transports()
    assert "tcp" in names and ("cuda_ipc" in names) == torch.cuda.is_available()


def test_import_is_light() -> None:
    code = (
        "import sys, kvrelay.transport as t; "
        "heavy = [m for m in ('torch', 'zmq', 'kvrelay.transport.tcp', 'kvrelay.transport.shm', "
        "'kvrelay.transport.cuda_ipc') if m in sys.modules]; assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- CUDA IPC -----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_ipc_without_cuda_says_why() -> None:
    with pytest.raises(TransferError, match="CUDA IPC needs a CUDA device"):
        create_transport("cuda_ipc")


def test_cuda_ipc_handles_are_validated() -> None:
    """Handle parsing runs anywhere: malformed text and a mismatched pool are refused."""
    import base64

    import msgpack

    from kvrelay.transport.cuda_ipc import import_cuda_pool, is_cuda_handle

    assert not is_cuda_handle("kvrelay-c-p0-kv") and not is_cuda_handle(None)
    with pytest.raises(TransferError, match="malformed"):
        import_cuda_pool("cuda-ipc:not base64!", SRC_LAYOUT)
    with pytest.raises(TransferError, match="wrong fields"):
        import_cuda_pool(
            "cuda-ipc:" + base64.b64encode(msgpack.packb({"x": 1})).decode(), SRC_LAYOUT
        )
    from kvrelay.transport.cuda_ipc import _FIELDS

    fields: dict[str, Any] = dict.fromkeys(_FIELDS, 0)
    fields.update(size=[1, 2, 3], dtype="float32")
    handle = "cuda-ipc:" + base64.b64encode(msgpack.packb(fields)).decode()
    with pytest.raises(LayoutMismatch):
        import_cuda_pool(handle, SRC_LAYOUT)
    with pytest.raises(ValueError, match="CUDA tensor"):
        from kvrelay.transport.cuda_ipc import export_cuda_pool

        export_cuda_pool(torch.zeros(pool_shape(SRC_LAYOUT)))


def _cuda_source_main(conn: Connection, layout: KvLayout, seed: int, block_ids: list[int]) -> None:
    from kvrelay.transport.cuda_ipc import export_cuda_pool

    pool = make_pool(layout, seed).cuda()
    conn.send((export_cuda_pool(pool), kv_checksum(pool, block_ids)))
    conn.recv()  # keep the pool alive until the test is done


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")
def test_cuda_ipc_pull_across_processes() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_cuda_source_main, args=(child, SRC_LAYOUT, SEED, SRC_IDS))
    process.start()
    try:
        assert parent.poll(120)
        handle, checksum = parent.recv()
        info = peer_info("tcp://x:1", handle, SRC_LAYOUT, transport="cuda_ipc")
        spec = PullSpec("r", info, SRC_IDS, checksum, time.time() + 60)
        dst = make_pool(DST_LAYOUT, 99).cuda()
        before = dst.cpu()
        transport = create_transport("cuda_ipc")
        try:
            transport.pull(spec, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
            with pytest.raises(ChecksumMismatch):
                bad = dataclasses.replace(spec, checksum=checksum ^ 1)
                transport.pull(bad, dst, DST_IDS, DST_LAYOUT, FINGERPRINT, PULL_TIMEOUT)
        finally:
            transport.close()
        assert_pulled(dst.cpu(), before, DST_IDS, make_pool(SRC_LAYOUT, SEED), SRC_IDS)
    finally:
        parent.send("done")
        process.join(timeout=30)


# -- the benchmark script -----------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_transfer_benchmark_quick(tmp_path: Path) -> None:
    out_json = tmp_path / "transfer.json"
    benchmarks_md = REPO_ROOT / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    script = REPO_ROOT / "benchmarks" / "transfer.py"
    cmd = [
        sys.executable,
        str(script),
        "--quick",
        "--no-write",
        "--repeats",
        "1",
        "--json",
        str(out_json),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["tokens"], r["pattern"]) for r in rows} == {
        (t, p) for t in (16, 256) for p in ("contiguous", "scattered")
    }
    assert all(r["shm_gbps"] > 0 and r["tcp_gbps"] > 0 and r["memcpy_gbps"] > 0 for r in rows)
    assert "shm / memcpy" in proc.stdout
    after = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    assert after == before, "--no-write must leave BENCHMARKS.md alone"
