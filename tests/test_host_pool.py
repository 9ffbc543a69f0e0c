"""The L1 host pool: exact bytes, exact LRU victims, real processes, crashes, corruption.

Every key's payload is a function of the key (``payload_of``), so any process can check any
byte it reads. Each test uses a pool name of its own and asserts that nothing under that name
is left in /dev/shm afterwards.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

from kvrelay.cachetier.base import BlockFormat
from kvrelay.cachetier.block_hash import BlockHash
from kvrelay.cachetier.host_ops import (
    HostPoolInfo,
    PoolInUse,
    default_pool_name,
    list_host_pools,
    remove_host_pool,
    unlink_pool,
)
from kvrelay.cachetier.host_pool import HostPool
from kvrelay.cachetier.host_segment import NUM_WAYS
from kvrelay.cachetier.segments import SHM_DIR

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")

FMT = BlockFormat(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
SLOT = 576  # 64-byte header + 512-byte payload, already a multiple of 64
FOUR_SETS = 4 * NUM_WAYS * SLOT
# The concurrency test moves 16 KiB blocks so that copies take long enough to overlap.
BIG_FMT = BlockFormat(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
SPAWN = mp.get_context("spawn")


def make_key(label: str) -> BlockHash:
    return BlockHash(hashlib.blake2b(label.encode(), digest_size=16).digest())


def payload_of(key: bytes, fmt: BlockFormat = FMT) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return rng.integers(0, 256, fmt.payload_bytes, dtype=np.uint8)


def keys_in_set(pool: HostPool, s: int, count: int, tag: str = "") -> list[BlockHash]:
    """The first ``count`` keys ``{tag}{j}`` that map to set ``s``."""
    out: list[BlockHash] = []
    j = 0
    while len(out) < count:
        key = make_key(f"{tag}{j}")
        if pool.set_index(key) == s:
            out.append(key)
        j += 1
    return out


def items(keys: list[BlockHash], fmt: BlockFormat = FMT) -> list[tuple[BlockHash, np.ndarray]]:
    return [(key, payload_of(key, fmt)) for key in keys]


def present(pool: HostPool, keys: list[BlockHash]) -> list[bool]:
    return [pool.lookup([key]) == 1 for key in keys]


def leftovers(name: str) -> list[str]:
    return sorted(entry for entry in os.listdir(SHM_DIR) if entry.startswith(name))


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"kvrelay-l1-test-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_pool(name)
    assert leftovers(name) == []


def test_round_trip_exact_bytes_and_prefix_semantics(pool_name: str) -> None:
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        keys = [make_key(f"k{j}") for j in range(3)]
        missing = make_key("missing")
        assert pool.put(items(keys)) == 3
        assert pool.put(items(keys)) == 0  # present: nothing new
        assert pool.lookup(keys) == 3
        assert pool.lookup([keys[0], missing, keys[2]]) == 1
        assert pool.lookup([missing, *keys]) == 0

        got = pool.get([keys[0], keys[1], missing, keys[2]])
        assert [g.tobytes() for g in got] == [payload_of(k).tobytes() for k in keys[:2]]
        assert all(g.dtype == np.uint8 and g.shape == (FMT.payload_bytes,) for g in got)
        got[0][:] = 0  # a copy: the pool is unchanged
        assert pool.get(keys[:1])[0].tobytes() == payload_of(keys[0]).tobytes()
        assert pool.get([missing]) == []

        stats = pool.stats()
        assert {k: stats[k] for k in ("lookups", "query_blocks", "hit_blocks")} == {
            "lookups": 6,
            "query_blocks": 6,
            "hit_blocks": 3,
        }
        assert stats["put_blocks"] == 3
        assert stats["bytes_written"] == 3 * FMT.payload_bytes
        assert stats["bytes_read"] == 3 * FMT.payload_bytes
        assert (stats["evictions"], stats["errors"], stats["dropped_puts"]) == (0, 0, 0)
        assert stats["name"] == "host" and stats["pool_name"] == pool_name
        assert (stats["capacity_blocks"], stats["used_blocks"]) == (32, 3)
        assert (stats["capacity_bytes"], stats["used_bytes"]) == (FOUR_SETS, 3 * SLOT)
        assert pool.check_integrity() == 3


def test_lru_evicts_the_least_recently_used_way_of_the_set(pool_name: str) -> None:
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        other = keys_in_set(pool, 0, 1, "other")
        keys = keys_in_set(pool, 1, NUM_WAYS + 2)
        assert pool.put(items(other + keys[:NUM_WAYS])) == 1 + NUM_WAYS
        assert len(pool.get([keys[0]])) == 1  # a hit makes k0 the most recent
        assert pool.put(items([keys[8]])) == 1
        assert present(pool, keys) == [True, False] + [True] * 7 + [False]

        assert pool.put(items([keys[2]])) == 0  # a put of a present key is a use too
        assert pool.put(items([keys[9]])) == 1
        assert present(pool, keys) == [True, False, True, False] + [True] * 6
        assert present(pool, other) == [True]  # other sets are untouched
        assert pool.stats()["evictions"] == 2
        assert pool.check_integrity() == 1 + NUM_WAYS


def test_change_log_names_what_this_writer_stored_and_evicted(pool_name: str) -> None:
    """The placement feed: each put's new key and its victim, the later change of a key
    winning; another writer's changes are its own to report; off unless asked for."""
    with (
        HostPool.open(pool_name, FOUR_SETS, FMT, record_changes=True) as pool,
        HostPool.open(pool_name, FOUR_SETS, FMT, record_changes=True) as other,
        HostPool.open(pool_name, FOUR_SETS, FMT) as silent,
    ):
        keys = keys_in_set(pool, 1, NUM_WAYS + 2)

        def changes(writer: HostPool, stored: list[int], evicted: list[int]) -> None:
            taken = writer.take_changes()
            assert taken is not None
            got = (
                {keys.index(BlockHash(k)) for k in taken.stored},
                {keys.index(BlockHash(k)) for k in taken.evicted},
            )
            assert got == (set(stored), set(evicted))

        changes(pool, [], [])
        pool.put(items(keys[:NUM_WAYS]))
        pool.put(items(keys[6:NUM_WAYS]))  # present: no change (a use: k6, k7 most recent)
        changes(pool, list(range(NUM_WAYS)), [])
        changes(pool, [], [])  # taken: forgotten

        other.put(items(keys[8:9]))  # evicts k0, the least recent
        changes(other, [8], [0])
        changes(pool, [], [])  # not this writer's change

        pool.put(items(keys[:1]))  # k0 back (evicts k1), then k9 evicts k2
        pool.put(items(keys[9:]))
        changes(pool, [0, 9], [1, 2])
        pool.put(items([keys[1]]))  # k1 back, evicting k3; then k3 back, evicting k4
        pool.put(items([keys[3]]))
        changes(pool, [1, 3], [4])  # k3's later change wins
        silent.put(items(keys[4:5]))
        assert silent.take_changes() is None
        assert present(pool, keys) == [True, True, False, True, True, False] + [True] * 4


def test_capacity_is_respected(pool_name: str) -> None:
    with pytest.raises(ValueError, match="holds no set"):
        HostPool.open(pool_name, NUM_WAYS * SLOT - 1, FMT)
    capacity = 3 * NUM_WAYS * SLOT + SLOT + 7  # rounds down to 3 sets
    with HostPool.open(pool_name, capacity, FMT) as pool:
        keys = [make_key(f"fill{j}") for j in range(100)]
        assert pool.put(items(keys)) == 100
        per_set = np.bincount([pool.set_index(k) for k in keys], minlength=3)
        stats = pool.stats()
        assert stats["capacity_blocks"] == stats["used_blocks"] == 3 * NUM_WAYS
        assert stats["used_bytes"] == 3 * NUM_WAYS * SLOT <= capacity
        assert stats["evictions"] == int(np.maximum(per_set - NUM_WAYS, 0).sum())
        assert sum(present(pool, keys)) == 3 * NUM_WAYS
        assert pool.check_integrity() == 3 * NUM_WAYS
        # the segment is exactly the tables plus the slots: fixed size
        assert os.stat(SHM_DIR / pool_name).st_size == 8192 + 3 * NUM_WAYS * SLOT


def test_attach_checks_format_and_capacity(pool_name: str) -> None:
    with pytest.raises(FileNotFoundError):
        HostPool.open(pool_name, FOUR_SETS, FMT, create=False)
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        pool.put(items([make_key("a")]))
        other_fmt = BlockFormat(2, 4, 2, 8, "bfloat16")
        with pytest.raises(ValueError, match="dtype 2 \\(expected 1\\)"):
            HostPool.open(pool_name, FOUR_SETS, other_fmt)
        with pytest.raises(ValueError, match="capacity_bytes"):
            HostPool.open(pool_name, 2 * FOUR_SETS, FMT)
        with HostPool.open(pool_name, FOUR_SETS, FMT, create=False) as again:
            assert again.get([make_key("a")])[0].tobytes() == payload_of(make_key("a")).tobytes()
    with pytest.raises(ValueError, match="pool name"):
        HostPool.open("../etc/passwd", FOUR_SETS, FMT)


def test_open_finishes_a_pool_whose_creator_died_before_ready(pool_name: str) -> None:
    for path in (SHM_DIR / pool_name, SHM_DIR / f"{pool_name}.lock"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 12345)  # sized, but no magic: the creator died here
        os.close(fd)
    with pytest.raises(FileNotFoundError, match="never initialised"):
        HostPool.open(pool_name, FOUR_SETS, FMT, create=False)
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        assert pool.put(items([make_key("a")])) == 1
        assert pool.check_integrity() == 1


def test_default_pool_name_depends_on_model_and_format() -> None:
    name = default_pool_name(FMT, b"fp-1")
    assert name == default_pool_name(FMT, b"fp-1")
    assert name.startswith("kvrelay-l1-host-") and len(name) == len("kvrelay-l1-host-") + 16
    assert default_pool_name(FMT, b"fp-2") != name
    assert default_pool_name(BIG_FMT, b"fp-1") != name
    assert default_pool_name(FMT, b"fp-1", scope="ci-7").startswith("kvrelay-l1-ci-7-")
    with pytest.raises(ValueError, match="scope"):
        default_pool_name(FMT, b"fp-1", scope="a/b")


def test_two_instances_in_one_process_exclude_each_other(pool_name: str) -> None:
    with (
        HostPool.open(pool_name, FOUR_SETS, FMT, lock_timeout_s=0.01) as a,
        HostPool.open(pool_name, FOUR_SETS, FMT, lock_timeout_s=0.01) as b,
    ):
        key = make_key("x")
        s = a.set_index(key)
        assert a._acquire(s)
        assert b.put(items([key])) == 0
        assert b.stats()["dropped_puts"] == 1
        a._release(s)
        assert b.put(items([key])) == 1
        assert a.get([key])[0].tobytes() == payload_of(key).tobytes()


def test_forked_child_takes_locks_of_its_own(pool_name: str) -> None:
    with HostPool.open(pool_name, FOUR_SETS, FMT, lock_timeout_s=0.01) as pool:
        key = make_key("f")
        s = pool.set_index(key)
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child uses the instance it inherited
            code = 1
            try:
                os.read(go_read, 1)  # the parent holds the set's lock now
                code = 0 if pool.put(items([key])) == 0 else 2
            finally:
                os._exit(code)
        assert pool._acquire(s)
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        pool._release(s)
        os.close(go_read)
        os.close(go_write)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.put(items([key])) == 1


# -- real processes ------------------------------------------------------------------------------


def _writer_main(name: str, labels: list[str]) -> None:
    with HostPool.open(name, FOUR_SETS, FMT) as pool:
        assert pool.put(items([make_key(label) for label in labels])) == len(labels)


def test_another_process_reads_what_one_wrote(pool_name: str) -> None:
    labels = [f"w{j}" for j in range(6)]
    child = SPAWN.Process(target=_writer_main, args=(pool_name, labels))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    with HostPool.open(pool_name, FOUR_SETS, FMT, create=False) as pool:
        keys = [make_key(label) for label in labels]
        got = pool.get(keys)
        assert [g.tobytes() for g in got] == [payload_of(k).tobytes() for k in keys]
        assert pool.check_integrity() == 6


CONCURRENT_SETS = 4
NUM_KEYS = 3 * CONCURRENT_SETS * NUM_WAYS  # three keys for every way: constant evictions


def _mixed_main(name: str, seed: int, iterations: int) -> dict[str, int]:
    """Random puts and gets over a small key space; returns counts, checking every byte."""
    keys = [make_key(f"c{j}") for j in range(NUM_KEYS)]
    payloads = {key: payload_of(key, BIG_FMT) for key in keys}
    rng = np.random.default_rng(seed)
    counts = {"hits": 0, "misses": 0, "wrong": 0}
    with HostPool.open(name, CONCURRENT_SETS * NUM_WAYS * 16448, BIG_FMT, lock_timeout_s=5) as pool:
        for _ in range(iterations):
            batch = [keys[j] for j in rng.integers(0, NUM_KEYS, int(rng.integers(1, 5)))]
            if rng.random() < 0.5:
                pool.put([(key, payloads[key]) for key in batch])
                continue
            got = pool.get(batch)
            counts["hits"] += len(got)
            counts["misses"] += len(got) < len(batch)
            counts["wrong"] += sum(g.tobytes() != payloads[k].tobytes() for k, g in zip(batch, got))
        stats = pool.stats()
    counts.update({k: stats[k] for k in ("evictions", "errors", "dropped_puts", "put_blocks")})
    return counts


def test_concurrent_readers_and_writers_see_exact_bytes_or_misses(pool_name: str) -> None:
    with SPAWN.Pool(4) as workers:
        results = workers.starmap(_mixed_main, [(pool_name, seed, 3000) for seed in range(4)])
    total = {k: sum(r[k] for r in results) for k in results[0]}
    assert total["wrong"] == 0
    assert (total["errors"], total["dropped_puts"]) == (0, 0)
    assert total["hits"] > 0 and total["misses"] > 0 and total["evictions"] > 0
    with HostPool.open(pool_name, CONCURRENT_SETS * NUM_WAYS * 16448, BIG_FMT) as pool:
        assert pool.check_integrity() == pool.stats()["used_blocks"] == CONCURRENT_SETS * NUM_WAYS


def _die_mid_write_main(name: str, label: str, conn: Connection) -> None:
    """Takes the key's set lock, writes half its value, reports, and waits to be killed."""
    pool = HostPool.open(name, FOUR_SETS, FMT)
    key = make_key(label)
    s = pool.set_index(key)
    assert pool._acquire(s)
    i, _ = pool._claim(s, key)
    pool._begin_write(i, key)
    pool._data[i, : SLOT // 2] = 7
    conn.send(i)
    conn.recv()  # never comes


def test_writer_killed_mid_write_leaves_no_held_lock_or_entry(pool_name: str) -> None:
    with HostPool.open(pool_name, FOUR_SETS, FMT, lock_timeout_s=0.05) as pool:
        victim = make_key("victim")
        s = pool.set_index(victim)
        neighbours = keys_in_set(pool, s, NUM_WAYS, "n")
        assert pool.put(items(neighbours[:3])) == 3  # ways 0-2; the dying write takes way 3
        parent, child_end = SPAWN.Pipe()
        child = SPAWN.Process(target=_die_mid_write_main, args=(pool_name, "victim", child_end))
        child.start()
        assert parent.poll(60), "the writer did not start"
        way = parent.recv()
        assert way == s * NUM_WAYS + 3
        assert pool.lookup([victim]) == 0 and pool.get([victim]) == []  # never half a block
        assert pool.put(items(neighbours[3:4])) == 0  # the set's lock is held: dropped
        assert pool.stats()["dropped_puts"] == 1

        os.kill(child.pid, signal.SIGKILL)
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        assert pool.lookup([victim]) == 0 and pool.get([victim]) == []
        with pytest.raises(AssertionError, match="left WRITING"):
            pool.check_integrity()
        assert pool.check_integrity(allow_dead_writes=True) == 3

        assert pool.put(items(neighbours[3:4])) == 1  # the kernel released the lock
        assert pool.lookup(neighbours[3:4]) == 1
        assert pool.stats()["evictions"] == 0  # the dead write's way was reclaimed, not evicted
        assert pool.check_integrity() == 4
        assert pool.put(items([victim])) == 1
        assert pool.get([victim])[0].tobytes() == payload_of(victim).tobytes()
        assert pool.check_integrity() == 5


def test_corrupted_value_is_a_miss_counted_as_an_error(pool_name: str) -> None:
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        keys = [make_key(f"k{j}") for j in range(3)]
        pool.put(items(keys))
        i = pool._locate(pool.set_index(keys[1]), keys[1])
        pool._data[i, 64 + 100] ^= 0xFF  # one payload byte, behind the checksum's back
        assert len(pool.get(keys)) == 1  # the prefix stops at the corrupt block
        stats = pool.stats()
        assert (stats["errors"], stats["hit_blocks"], stats["used_blocks"]) == (1, 1, 2)
        assert pool.lookup(keys) == 1  # invalidated: not offered again
        assert pool.put(items(keys[1:2])) == 1  # and its way is rewritten
        assert [g.tobytes() for g in pool.get(keys)] == [payload_of(k).tobytes() for k in keys]
        assert pool.check_integrity() == 3


def _listed(name: str) -> HostPoolInfo | None:
    return next((p for p in list_host_pools() if p.name == name), None)


def test_list_and_remove_for_operators(pool_name: str) -> None:
    """`kvrelay cache ls|rm`: what a pool holds, who maps it; no removal under a live user."""
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        assert pool.put(items([make_key(f"ls{j}") for j in range(5)])) == 5
        info = _listed(pool_name)
        assert info is not None
        assert info.fmt == FMT and info.num_slots == 4 * NUM_WAYS and info.valid_slots == 5
        assert os.getpid() in info.pids
        assert info.total_bytes == (SHM_DIR / pool_name).stat().st_size
        with pytest.raises(PoolInUse, match=str(os.getpid())):
            remove_host_pool(pool_name)
        assert leftovers(pool_name) == [pool_name, f"{pool_name}.lock"]
        cli = [sys.executable, "-m", "kvrelay", "cache"]
        ls = subprocess.run([*cli, "ls"], capture_output=True, text=True, check=True)
        line = next(row for row in ls.stdout.splitlines() if row.startswith(pool_name))
        assert line.split()[2:4] == ["2,4,2,8,float16", f"5/{4 * NUM_WAYS}"]
        refused = subprocess.run([*cli, "rm", pool_name], capture_output=True, text=True)
        assert refused.returncode == 1 and "mapped by live processes" in refused.stderr
        assert _listed(pool_name) is not None
    info = _listed(pool_name)
    assert info is not None and os.getpid() not in info.pids  # closed: unmapped
    removed = subprocess.run([*cli, "rm", pool_name], capture_output=True, text=True, check=True)
    assert removed.stdout.strip() == pool_name
    assert leftovers(pool_name) == [] and _listed(pool_name) is None
    assert remove_host_pool(pool_name) is False  # gone: nothing to remove


def test_force_removes_a_mapped_pool_and_the_user_keeps_its_mapping(pool_name: str) -> None:
    with HostPool.open(pool_name, FOUR_SETS, FMT) as pool:
        key = make_key("kept")
        pool.put(items([key]))
        assert remove_host_pool(pool_name, force=True) is True
        assert leftovers(pool_name) == []
        assert pool.get([key])[0].tobytes() == payload_of(key).tobytes()


def test_the_default_pool_is_scoped_to_the_cluster_and_the_host() -> None:
    """Two clusters on one machine, or two hosts sharing /dev/shm, never share an L1 pool
    unless told to (an explicit ``--host-pool NAME``)."""
    from kvrelay.worker.config import l1_scope

    names = {
        default_pool_name(FMT, b"fp-1", l1_scope(cluster, host))
        for cluster in ("default", "c2")
        for host in ("hostA", "hostB", "3f9a/odd:id")
    }
    assert len(names) == 6
    assert l1_scope("default", "hostA") == l1_scope("default", "hostA")
    assert default_pool_name(FMT, b"fp-1", l1_scope("c2", "3f9a/odd:id")).startswith(
        "kvrelay-l1-c2.3f9a_odd_id-"
    )
