"""Peer transfer in a chain (``kvrelay.transport.chain``): real processes, real TCP sockets.

The origin is a ``ChainServer`` in the test process; every receiver ("host") is a spawned
process (``_hop_main``) that fetches with forwarding on, reports its server address, writes
what it received to a file and keeps serving until told to stop. Where the test must control
when chunks exist, the origin is still "arriving": the test marks its chunks available.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvrelay.protocol.credential import ClusterCredential
from kvrelay.transport.chain_fetch import fetch
from kvrelay.transport.chain_server import ChainServer
from kvrelay.transport.chain_wire import (
    ChainError,
    ChainMeta,
    chunk_checksums,
    create_meta,
    plan_chain,
)
from kvrelay.transport.curve import SocketSecurity
from kvrelay.transport.rate_limit import TokenBucket, mbps_to_bytes_per_s

SPAWN = mp.get_context("spawn")
TOTAL_BYTES = 64 << 20
CHUNK_BYTES = 4 << 20
NUM_CHUNKS = TOTAL_BYTES // CHUNK_BYTES
CREDENTIAL = ClusterCredential(bytes(range(32)))  # hops are other processes: a fixed one
SECURITY = SocketSecurity(CREDENTIAL)
TIMEOUT = 2.0  # a hop's silence limit; the kill test waits this long once


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, TOTAL_BYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def meta(data: np.ndarray) -> ChainMeta:
    return create_meta("tiny-llama@0", b"header: tensor table", data, CHUNK_BYTES)


@pytest.fixture(autouse=True)
def no_leaked_servers() -> Iterator[None]:
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("chain-server")]
    assert alive == []


def _hop_main(sources_q: Any, reports: Any, stop: Any, out_path: str, forward: bool) -> None:
    """A host: fetch, report, write the bytes out, serve until ``stop``, report server stats."""
    sources = sources_q.get(timeout=30)
    buffers: list[np.ndarray] = []

    def make_buffer(meta: ChainMeta) -> np.ndarray:
        buffers.append(np.empty(meta.total_bytes, dtype=np.uint8))
        return buffers[0]

    def on_serving(server: ChainServer) -> None:
        reports.put(("serving", server.addr))

    try:
        result = fetch(
            sources,
            make_buffer,
            forward=forward,
            timeout=TIMEOUT,
            on_serving=on_serving,
            security=SECURITY,
        )
    except ChainError as e:
        reports.put(("failed", str(e)))
        return
    Path(out_path).write_bytes(buffers[0])
    summary = result._replace(server=None, meta=None)._asdict()
    reports.put(("fetched", summary))
    stop.wait(60)
    if result.server is not None:
        reports.put(("stats", result.server.stats()._asdict()))
        result.server.close()


class Hop:
    """One receiver process; ``start(sources)`` makes it fetch."""

    def __init__(self, tmp_path: Path, name: str, forward: bool = True) -> None:
        self.out = tmp_path / f"{name}.bin"
        self._sources_q, self._reports, self._stop = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
        args = (self._sources_q, self._reports, self._stop, str(self.out), forward)
        self.process = SPAWN.Process(target=_hop_main, args=args, daemon=True)
        self.process.start()

    def start(self, sources: list[str]) -> None:
        self._sources_q.put(sources)

    def expect(self, kind: str) -> Any:
        got, value = self._reports.get(timeout=30)
        assert got == kind, value
        return value

    def stop(self) -> dict[str, Any]:
        """Stops serving; returns the server's stats."""
        self._stop.set()
        stats = self.expect("stats")
        self.process.join(10)
        return stats

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        assert self.process.exitcode == -signal.SIGKILL


@pytest.fixture
def hops(tmp_path: Path) -> Iterator[Any]:
    """``hops(name, forward=True) -> Hop``; every process is killed at teardown."""
    started: list[Hop] = []

    def create(name: str, forward: bool = True) -> Hop:
        started.append(Hop(tmp_path, name, forward))
        return started[-1]

    yield create
    for hop in started:
        if hop.process.is_alive():
            hop.process.kill()
            hop.process.join(10)


def start_chain(origin: ChainServer, chain: list[Hop]) -> list[str]:
    """Starts each hop pulling from its predecessors (``plan_chain``); returns their addresses."""
    addrs: list[str] = []
    for hop in chain:
        hop.start(plan_chain(origin.addr, [*addrs, "next"])["next"])
        addrs.append(hop.expect("serving"))
    return addrs


def release_slowly(origin: ChainServer, up_to: int) -> None:
    """Marks the origin's chunks available one by one, so downstream hops overlap."""
    for num_chunks in range(origin.num_available + 1, up_to + 1):
        origin.mark_available(num_chunks)
        time.sleep(0.03)


def wait_until_has(addr: str, index: int) -> None:
    """Asks ``addr`` for chunk ``index`` on the raw wire: a hop answers once it has it."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    SECURITY.client(socket)  # a cluster member's raw socket
    socket.connect(addr)
    try:
        socket.send_multipart([b"C", struct.pack("<Q", index)])
        while True:  # b"W" heartbeats come first while the chunk is on its way
            assert socket.poll(30_000), f"{addr} never served chunk {index}"
            if socket.recv_multipart()[0] == b"C":
                return
    finally:
        socket.close()
        context.term()


def assert_same_bytes(path: Path, data: np.ndarray) -> None:
    received = np.fromfile(path, dtype=np.uint8)
    assert received.size == data.size
    assert np.array_equal(received, data)


def test_plan_chain() -> None:
    assert plan_chain("A", ["B", "C", "D"]) == {"B": ["A"], "C": ["B", "A"], "D": ["C", "B", "A"]}
    with pytest.raises(ValueError):
        plan_chain("A", ["B", "A"])


def test_meta_validates_its_sizes() -> None:
    assert create_meta("x", b"", b"abcde", chunk_bytes=2).num_chunks == 3
    assert create_meta("x", b"", b"abcde", chunk_bytes=2).chunk_span(2) == (4, 5)
    with pytest.raises(ValueError):
        ChainMeta("x", b"", total_bytes=5, chunk_bytes=2, checksums=[1, 2])


def test_one_receiver_from_complete_source(data, meta, hops) -> None:
    with ChainServer(data, meta, complete=True, security=SECURITY) as origin:
        hop = hops("b", forward=False)
        hop.start([origin.addr])
        summary = hop.expect("fetched")
        assert origin.stats().num_chunks_served == NUM_CHUNKS
    assert summary["num_bytes"] == TOTAL_BYTES
    assert summary["num_retries"] == 0
    assert summary["sources_used"] == (origin.addr,)
    assert summary["num_chunks_per_source"] == (NUM_CHUNKS,)
    assert chunk_checksums(np.fromfile(hop.out, dtype=np.uint8), CHUNK_BYTES) == list(
        meta.checksums
    )
    assert_same_bytes(hop.out, data)


def test_chain_of_three_forwards_as_chunks_arrive(data, meta, hops) -> None:
    with ChainServer(
        data, meta, security=SECURITY
    ) as origin:  # still arriving: nothing available yet
        chain = [hops("b"), hops("c"), hops("d")]
        addrs = start_chain(origin, chain)
        release_slowly(origin, NUM_CHUNKS)
        summaries = [hop.expect("fetched") for hop in chain]
        stats = [hop.stop() for hop in chain]
        assert origin.stats().num_chunks_served == NUM_CHUNKS  # the origin sent it once
    for hop, summary, sources in zip(chain, summaries, [origin.addr, *addrs]):
        assert summary["sources_used"] == (sources,)
        assert summary["num_retries"] == 0
        assert_same_bytes(hop.out, data)
    for middle in stats[:2]:  # b and c served their first chunk before they had them all
        assert middle["available_at_first_serve"] < NUM_CHUNKS
        assert middle["num_chunks_served"] == NUM_CHUNKS
    assert stats[2]["num_chunks_served"] == 0


def test_killed_middle_hop_next_resumes_from_previous(data, meta, hops) -> None:
    with ChainServer(data, meta, security=SECURITY) as origin:
        b, c, d = hops("b"), hops("c"), hops("d")
        b_addr, c_addr, d_addr = start_chain(origin, [b, c, d])
        release_slowly(origin, 6)
        wait_until_has(d_addr, 5)  # six chunks went down to d; c dies holding d's requests
        c.kill()
        release_slowly(origin, NUM_CHUNKS)
        b_summary, d_summary = b.expect("fetched"), d.expect("fetched")
        b.stop()
        d.stop()
    assert b_summary["sources_used"] == (origin.addr,)  # b never noticed
    assert d_summary["sources_used"] == (c_addr, b_addr)
    from_c, from_b = d_summary["num_chunks_per_source"]
    assert (from_c, from_b) == (6, NUM_CHUNKS - 6)  # resumed, did not start over
    assert d_summary["num_retries"] == 4  # the window of requests c held when it died
    assert_same_bytes(b.out, data)
    assert_same_bytes(d.out, data)


class CorruptOnce(ChainServer):
    """Serves chunk ``bad_index`` with one byte flipped, the first ``num_bad`` times."""

    def __init__(self, *args: Any, bad_index: int, num_bad: int = 1, **kwargs: Any) -> None:
        self.bad_index, self.num_bad = bad_index, num_bad
        super().__init__(*args, **kwargs)

    def _payload(self, index: int) -> memoryview:
        payload = super()._payload(index)
        if index != self.bad_index or self.num_bad == 0:
            return payload
        self.num_bad -= 1
        corrupt = bytearray(payload)
        corrupt[12345] ^= 0x01
        return memoryview(corrupt)


def test_corrupted_chunk_is_refetched(data, meta, hops) -> None:
    with CorruptOnce(data, meta, complete=True, bad_index=3, security=SECURITY) as origin:
        hop = hops("b", forward=False)
        hop.start([origin.addr])
        summary = hop.expect("fetched")
        assert origin.num_bad == 0
    assert summary["num_retries"] == 1
    assert summary["sources_used"] == (origin.addr,)
    assert_same_bytes(hop.out, data)


def test_always_corrupt_source_is_abandoned(data, meta) -> None:
    received = np.empty(TOTAL_BYTES, dtype=np.uint8)
    with (
        CorruptOnce(data, meta, complete=True, bad_index=5, num_bad=100, security=SECURITY) as bad,
        ChainServer(data, meta, complete=True, security=SECURITY) as good,
    ):
        result = fetch(
            [bad.addr, good.addr],
            lambda _: received,
            forward=False,
            timeout=TIMEOUT,
            security=SECURITY,
        )
    assert result.sources_used == (bad.addr, good.addr)
    assert result.num_retries >= 3
    assert np.array_equal(received, data)


def test_no_source_reachable_raises_within_timeout(meta) -> None:
    context = zmq.Context()
    dead = []
    for _ in range(2):  # ports that were free a moment ago: nothing listens there now
        socket = context.socket(zmq.ROUTER)
        socket.bind("tcp://127.0.0.1:0")
        dead.append(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        socket.close(linger=0)
    context.term()
    start = time.monotonic()
    with pytest.raises(ChainError, match="no source answered"):
        fetch(dead, lambda m: bytearray(m.total_bytes), timeout=1.0, security=SECURITY)
    assert time.monotonic() - start < 1.0 + 2.0  # one timeout for all sources, not one each


def test_malformed_source_address_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="bad source address"):
        fetch(
            ["tcp://127.0.0.1:notaport"],
            lambda m: bytearray(m.total_bytes),
            timeout=1.0,
            security=SECURITY,
        )


# -- link pacing (a ChainServer sending at most link_bytes_per_s) --------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_without_burst_is_a_serial_link() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)  # 1000 B/s, no burst
    assert bucket.reserve(500) == 100.5  # an idle link: the bytes take 0.5 s to go out
    assert bucket.reserve(1000) == 101.5  # queued behind the first
    clock.now = 101.0
    assert bucket.reserve(250) == 101.75
    clock.now = 110.0  # idle for 8 s: no credit is saved (no burst)
    assert bucket.reserve(100) == 110.1
    assert bucket.reserve(0) == 110.1


def test_token_bucket_burst_is_the_most_an_idle_link_saves() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst_bytes=300, clock=clock)  # starts full
    assert bucket.reserve(200) == 100.0
    assert bucket.reserve(200) == 100.1  # 100 B of credit left, 100 B of debt
    clock.now = 200.0  # a long idle: the balance is capped at the burst
    assert bucket.reserve(300) == 200.0
    assert bucket.reserve(1000) == 201.0
    with pytest.raises(ValueError):
        TokenBucket(0.0)
    with pytest.raises(ValueError):
        TokenBucket(10.0, burst_bytes=-1)
    assert mbps_to_bytes_per_s(800) == 100e6
    with pytest.raises(ValueError):
        mbps_to_bytes_per_s(-1)


def test_token_bucket_never_exceeds_its_rate_over_any_window() -> None:
    """A sender that takes the next send's tokens after each send (as ChainServer does),
    with sends that run late by random amounts: in every window the bytes sent are at most
    rate * window + the first send in it."""
    rng = np.random.default_rng(1)
    clock, rate = FakeClock(), 5000.0
    bucket = TokenBucket(rate, clock=clock)
    sent: list[tuple[float, int]] = []
    for size in rng.integers(1, 4000, 200):
        ready = bucket.reserve(int(size))
        clock.now = ready + float(rng.choice([0.0, rng.exponential(0.5)]))  # the thread is late
        sent.append((clock.now, int(size)))
        clock.now += float(rng.choice([0.0, rng.exponential(0.2)]))  # idle before the next
    for i in range(len(sent)):
        for j in range(i, len(sent)):
            num_bytes = sum(size for _, size in sent[i : j + 1])
            assert num_bytes <= rate * (sent[j][0] - sent[i][0]) + sent[i][1] + 1e-6


class RecordingServer(ChainServer):
    """Records when each chunk was handed to the socket (the server thread's clock)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sends: list[tuple[float, int]] = []
        super().__init__(*args, **kwargs)

    def _put_chunk(self, identity: bytes, index: int, payload: memoryview) -> None:
        self.sends.append((time.monotonic(), len(payload)))
        super()._put_chunk(identity, index, payload)


def test_paced_server_never_sends_faster_than_its_link(data, meta) -> None:
    """Two receivers share the server's link: chunk k leaves at least bytes(k) / rate after
    chunk k - 1, whatever the machine's load (only lower bounds on time are asserted)."""
    rate = 512 * 2**20  # bytes/s: 2 x 64 MiB take at least 0.25 s minus one chunk
    buffers = [bytearray(TOTAL_BYTES) for _ in range(2)]
    results: list[Any] = []
    with RecordingServer(
        data, meta, complete=True, link_bytes_per_s=rate, security=SECURITY
    ) as origin:
        start = time.monotonic()
        threads = [
            threading.Thread(
                target=lambda b=b: results.append(
                    fetch(
                        [origin.addr],
                        lambda m: b,
                        forward=False,
                        timeout=TIMEOUT,
                        security=SECURITY,
                    )
                )
            )
            for b in buffers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        elapsed = time.monotonic() - start
        stats = origin.stats()
    assert len(results) == 2 and all(r.num_retries == 0 for r in results)
    assert all(bytes(b) == data.tobytes() for b in buffers)
    assert stats.num_bytes_served == 2 * TOTAL_BYTES == sum(n for _, n in origin.sends)
    for (before, _), (after, size) in zip(origin.sends, origin.sends[1:]):
        assert after - before >= size / rate - 1e-9
    assert elapsed >= (2 * TOTAL_BYTES - CHUNK_BYTES) / rate


def test_link_rate_must_not_be_negative(data, meta) -> None:
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        ChainServer(data, meta, complete=True, link_bytes_per_s=-1.0, security=SECURITY)


@pytest.mark.parametrize("rogue", ["no_credential", "another_secret"])
def test_fetch_without_the_cluster_secret_gets_nothing(data, meta, rogue: str) -> None:
    other = None if rogue == "no_credential" else ClusterCredential.generate()
    with ChainServer(data, meta, complete=True, security=SECURITY) as origin:
        with pytest.raises(ChainError, match="no source answered"):
            fetch(
                [origin.addr],
                lambda m: bytearray(m.total_bytes),
                forward=False,
                timeout=1.0,
                security=SocketSecurity(other),
            )
        assert origin.stats().num_chunks_served == 0
        received = np.empty(TOTAL_BYTES, dtype=np.uint8)
        fetch([origin.addr], lambda _: received, forward=False, timeout=TIMEOUT, security=SECURITY)
    assert np.array_equal(received, data)  # a member still gets every byte
