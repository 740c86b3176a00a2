"""A one-way flag that can be waited on together with others, at the cost of one future.

`anyio.Event` offers no way to wait for the first of several events but a task per event, and a session
call waits on three (its answer, the session's end, a kill) every time: starting those tasks and
cancelling the rest cost about 130 µs of the event loop per wait, more than the container takes to run
`1+1`. A `Latch` has `anyio.Event`'s interface, and `first_of` waits on any number of them with one
future that whichever is set first resolves.

Used from the event loop's thread only, as `anyio.Event` is. The service runs on asyncio alone (the
engine's sockets are asyncio's), and an anyio cancel scope cancels the wait like any other.
"""

from __future__ import annotations

import asyncio

import anyio


class Latch:
    """Set once, never cleared; `wait()` returns once it is set (at once if it is)."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] = []

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():  # a cancelled wait, or one that another latch woke
                waiter.set_result(None)

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        await first_of(self)


async def first_of(*latches: Latch) -> None:
    """Returns as soon as any of the latches is set. A checkpoint even when one is set already, as
    `anyio.Event.wait` is: a loop of waits still lets other tasks run, and a cancelled scope ends it."""
    if any(latch.is_set() for latch in latches):
        await anyio.lowlevel.checkpoint()
        return
    waiter = asyncio.get_running_loop().create_future()
    for latch in latches:
        latch._waiters.append(waiter)
    try:
        await waiter
    finally:
        for latch in latches:
            if waiter in latch._waiters:  # still there: this latch was not the one set
                latch._waiters.remove(waiter)
