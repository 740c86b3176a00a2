"""`Latch` and `first_of`: the first of several flags, waited on with one future instead of a task per flag."""

from __future__ import annotations

import anyio
import pytest

from metaagent.latch import Latch, first_of


async def test_first_of_returns_when_any_latch_is_set_and_leaves_the_others_without_waiters() -> None:
    answer, ended, killed = Latch(), Latch(), Latch()
    async with anyio.create_task_group() as group:
        group.start_soon(first_of, answer, ended, killed)
        await anyio.wait_all_tasks_blocked()
        assert [len(latch._waiters) for latch in (answer, ended, killed)] == [1, 1, 1]
        ended.set()
    assert [latch.is_set() for latch in (answer, ended, killed)] == [False, True, False]
    assert [len(latch._waiters) for latch in (answer, ended, killed)] == [0, 0, 0]


async def test_a_latch_set_before_the_wait_returns_at_once_but_still_checkpoints() -> None:
    done = Latch()
    done.set()
    done.set()  # setting twice is setting once
    with anyio.fail_after(1):
        await first_of(Latch(), done)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await done.wait()  # a checkpoint: the cancelled scope ends here
        pytest.fail("a wait on a set latch did not checkpoint")


async def test_a_cancelled_wait_leaves_no_waiter_behind_and_a_later_set_wakes_only_live_waits() -> None:
    shared = Latch()
    with anyio.move_on_after(0.01):
        await first_of(shared, Latch())
    assert shared._waiters == []
    woken: list[str] = []

    async def wait(name: str) -> None:
        await shared.wait()
        woken.append(name)

    async with anyio.create_task_group() as group:
        group.start_soon(wait, "a")
        group.start_soon(wait, "b")
        await anyio.wait_all_tasks_blocked()
        shared.set()
    assert sorted(woken) == ["a", "b"]
