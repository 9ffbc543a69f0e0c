"""A token bucket: the pace of one sender's link (a host's NIC), in bytes per second.

Tokens accrue at ``bytes_per_s`` up to ``burst_bytes``; a send of ``n`` bytes takes ``n``
tokens and may go out when the balance is back to zero or above. The balance may go
negative (a send larger than the burst waits for its own bytes to accrue), so a reservation
is never refused, only delayed::

    balance  burst ......................                 cap: an idle link saves at most this
               |        /            /
             0 +-------/------------/-----  time   each send may leave when the balance
               |      /            /               (after taking its bytes) is back to 0
            -n + take/  take n    /                ready_at = now + debt / bytes_per_s

With ``burst_bytes = 0`` (the default) this is a serial link: a send of ``n`` bytes leaves
``n / bytes_per_s`` after the previous one left (or after it was asked for, if the link was
idle), so the bytes released in any window of ``t`` seconds are at most
``t * bytes_per_s + burst_bytes + the largest single send``.

The clock is injected (``time.monotonic`` by default) so tests check the arithmetic exactly.
Not thread-safe: one owner (the sending thread) calls ``reserve``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(
        self,
        bytes_per_s: float,
        burst_bytes: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not bytes_per_s > 0 or burst_bytes < 0:
            raise ValueError(
                f"need bytes_per_s > 0, burst_bytes >= 0: {bytes_per_s}, {burst_bytes}"
            )
        self.bytes_per_s = float(bytes_per_s)
        self.burst_bytes = float(burst_bytes)
        self._clock = clock
        self._balance = self.burst_bytes  # starts full: an idle link
        self._updated = clock()

    def reserve(self, num_bytes: int) -> float:
        """Takes ``num_bytes`` tokens; returns the clock time at which they may be sent.

        Times returned by successive calls never decrease, so sends queued in call order
        leave in that order.
        """
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        now = self._clock()
        accrued = (now - self._updated) * self.bytes_per_s
        self._balance = min(self.burst_bytes, self._balance + accrued) - num_bytes
        self._updated = now
        return now + max(0.0, -self._balance) / self.bytes_per_s


def mbps_to_bytes_per_s(mbps: float) -> float:
    """Megabits per second (10^6 bits, as links are rated) to bytes per second."""
    if mbps < 0:
        raise ValueError(f"link rate must be >= 0 Mbps, got {mbps}")
    return mbps * 1e6 / 8
