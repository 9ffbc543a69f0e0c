"""A prefill worker's leases: a re-run's lease never overwrites an older one's references."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from kvrelay.prefill.worker import Lease, PrefillWorker


def _worker(released: list[list[int]]) -> PrefillWorker:
    worker = object.__new__(PrefillWorker)  # the lease bookkeeping alone, no sockets or engine
    worker.leases = {}
    manager = SimpleNamespace(release=lambda ids: released.append(list(ids)))
    worker.engine = cast(Any, SimpleNamespace(block_manager=manager))
    return worker


def test_a_new_attempts_lease_releases_the_old_one_of_the_same_request() -> None:
    released: list[list[int]] = []
    worker = _worker(released)
    worker._lease(Lease("r1", [4, 5, 6], 1e12, "decode-0"))  # handed to a decode that died
    worker._lease(Lease("r2", [9], 1e12, "decode-1"))
    worker._lease(Lease("r1", [4, 5, 7], 1e12, "decode-1"))  # the router re-ran r1 here
    assert released == [[4, 5, 6]]  # the old references go back, once
    lease = worker.leases["r1"]
    assert (lease.block_ids, lease.decode_id) == ([4, 5, 7], "decode-1")
    assert worker.num_role_held_refs() == 4  # r1's new three and r2's one
    worker._release("r1")
    worker._release("r1")  # an ack after an abort: nothing left to release
    assert released == [[4, 5, 6], [4, 5, 7]]
