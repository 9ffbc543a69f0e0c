"""Admission: slots, the bounded queue (by priority, then first come, first served), 429 and
503."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.router.admission import Admission
from kvrelay.router.backend import Overloaded, Unavailable


def test_no_queue_time_refuses_at_once_when_full() -> None:
    async def run() -> None:
        admission = Admission(max_inflight=2, max_queue_time=0, retry_after=3)
        await admission.acquire()
        await admission.acquire()
        with pytest.raises(Overloaded) as err:
            await admission.acquire()
        assert err.value.retry_after == 3
        admission.release()
        await admission.acquire()  # the freed slot
        assert (admission.num_admitted, admission.num_waiting) == (2, 0)

    asyncio.run(run())


def test_waiters_get_slots_in_order_and_the_queue_is_bounded() -> None:
    async def run() -> None:
        admission = Admission(max_inflight=1, max_queue_time=30, retry_after=1)
        await admission.acquire()
        order: list[int] = []

        async def wait(i: int) -> None:
            await admission.acquire()
            order.append(i)

        first = asyncio.create_task(wait(1))
        await asyncio.sleep(0)
        assert admission.num_waiting == 1
        with pytest.raises(Overloaded, match="1 queued"):  # queue holds max_inflight
            await admission.acquire()
        admission.release()
        await first
        assert order == [1] and admission.num_admitted == 1 and admission.num_waiting == 0
        admission.release()
        assert admission.num_admitted == 0

    asyncio.run(run())


def test_waiting_past_max_queue_time_is_unavailable_and_frees_its_place() -> None:
    async def run() -> None:
        admission = Admission(max_inflight=1, max_queue_time=0.05, retry_after=2)
        await admission.acquire()
        with pytest.raises(Unavailable, match="waited") as err:
            await admission.acquire()
        assert err.value.status_code == 503 and err.value.retry_after == 2
        assert admission.num_waiting == 0
        admission.release()
        assert admission.num_admitted == 0

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    async def run() -> None:
        admission = Admission(max_inflight=1, max_queue_time=30, retry_after=1)
        await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert admission.num_waiting == 0
        admission.release()
        assert admission.num_admitted == 0

    asyncio.run(run())


@pytest.mark.parametrize(("inflight", "queue_time"), [(0, 1.0), (1, -1.0)])
def test_invalid_settings_raise(inflight: int, queue_time: float) -> None:
    with pytest.raises(ValueError):
        Admission(inflight, queue_time, 1.0)


def test_a_freed_slot_goes_to_the_most_urgent_then_the_longest_waiting() -> None:
    async def run() -> None:
        admission = Admission(max_inflight=4, max_queue_time=30, retry_after=1)
        for _ in range(4):
            await admission.acquire()
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            await admission.acquire(priority)
            order.append(name)

        waits = [("low", 5), ("first", 0), ("urgent", -2), ("second", 0)]
        tasks = [asyncio.create_task(wait(name, p)) for name, p in waits]
        await asyncio.sleep(0)
        assert admission.num_waiting == 4
        for _ in waits:
            admission.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["urgent", "first", "second", "low"]
        assert (admission.num_admitted, admission.num_waiting) == (4, 0)

    asyncio.run(run())
