"""Admission: at most ``max_inflight`` requests on the workers; the rest wait, bounded.

::

    a slot free                    -> admitted at once
    all slots taken, queue < limit -> waits (by priority, then first come, first served) up
                                      to max_queue_time
    all slots taken, queue full    -> Overloaded (429, Retry-After)
    waited max_queue_time          -> Unavailable (503, Retry-After)

The queue holds at most ``max_inflight`` waiting requests, so the router holds at most twice
``max_inflight``; ``max_queue_time=0`` means no queue (429 as soon as every slot is taken).
Single-threaded: every method runs on the event loop. A freed slot goes to the waiter of
the lowest ``priority`` (the request's, vLLM's: 0 unless given), the longest-waiting among
equals; workers started with ``--scheduling-policy priority`` order their queues the same way.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools

from kvrelay.router.backend import Overloaded, Unavailable


class Admission:
    def __init__(self, max_inflight: int, max_queue_time: float, retry_after: float) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_queue_time < 0:
            raise ValueError(f"max_queue_time must be >= 0, got {max_queue_time}")
        self.max_inflight = max_inflight
        self.max_queue_time = max_queue_time
        self.retry_after = retry_after
        self.num_admitted = 0
        # (priority, arrival, future), kept sorted: the first gets the next slot
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, priority: int = 0) -> None:
        """Takes a slot, waiting up to ``max_queue_time`` (behind every waiter of a lower
        ``priority``, and those of the same that came first); raises Overloaded /
        Unavailable.

        The caller must ``release()`` once for every ``acquire()`` that returned.
        """
        if self.num_admitted < self.max_inflight and not self._waiters:
            self.num_admitted += 1
            return
        if self.max_queue_time == 0 or len(self._waiters) >= self.max_inflight:
            raise Overloaded(
                f"too many requests: {self.num_admitted} in flight, {len(self._waiters)} queued",
                self.retry_after,
            )
        waiter = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), waiter)
        bisect.insort(self._waiters, entry, key=lambda e: e[:2])
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_queue_time)
        except TimeoutError:
            if waiter.done():  # the slot came with the timeout: pass it on
                self.release()
            raise Unavailable(
                f"no capacity: waited {self.max_queue_time:g} s for a slot", self.retry_after
            ) from None
        except asyncio.CancelledError:
            if waiter.done():
                self.release()
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def release(self) -> None:
        """Frees a slot: the most urgent, then longest-waiting, request gets it."""
        while self._waiters:
            _, _, waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; num_admitted is unchanged
                return
        self.num_admitted -= 1
        assert self.num_admitted >= 0, "release() without acquire()"
