"""Token buckets: how much work one execution may make the service do per second.

A bucket holds up to `capacity` tokens and gains `rate` per second. Taking a token when the bucket is
empty reserves a future one: the taker learns how long to wait for it, so waiting callers are served
in order and the long-run rate never exceeds `rate`, however many ask. `max_debt` bounds how many
tokens may be reserved ahead; past it a reservation is refused, and nothing is taken.

Over any interval of T seconds a bucket hands out at most `capacity + rate * T` tokens (plus the
reservations outstanding when it starts, at most `max_debt`): the bound the tunnel tests check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import anyio


class TokenBucket:
    def __init__(self, rate: float, capacity: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or capacity < 1:
            raise ValueError("a token bucket needs a positive rate and room for at least one token")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def reserve(self, max_debt: float = 0) -> float | None:
        """Takes one token: the seconds until it is due (0.0 when it is there now), or None, taking
        nothing, when that would leave more than `max_debt` tokens reserved ahead."""
        self._refill()
        if self._tokens - 1 < -max_debt:
            return None
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def take(self) -> bool:
        """Takes one token, sleeping until it is due; True when it had to wait."""
        delay = self.reserve(max_debt=math.inf)
        assert delay is not None  # noqa: S101 -- an unbounded reservation always succeeds
        if delay == 0:
            return False
        await anyio.sleep(delay)
        return True
