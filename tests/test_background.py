"""The service's background tasks are supervised: a task that raises is logged with its cause, restarted
after a back-off, and named by /health while it is not running (issue 22, finding 5)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import httpx2
import pytest

from metaagent.background import BackgroundTasks, held_in, logged
from metaagent.sessions.service import Sessions
from tests.conftest import ServiceFactory


async def health_until(
    client: httpx2.AsyncClient, check: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        report: dict[str, Any] = (await client.get("/health")).json()
        if check(report):
            return report
        assert time.monotonic() < deadline, f"{what}: {report}"
        await anyio.sleep(0.02)


def reaper(report: dict[str, Any]) -> dict[str, Any]:
    task: dict[str, Any] = report["checks"]["background_tasks"]["tasks"]["session_reaper"]
    return task


async def test_a_background_task_that_raises_is_logged_restarted_and_named_by_health_until_it_runs_again(
    service: ServiceFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The fault is injected in-process (no HTTP route reaches it): the reaper raises while `failing`.
    failing, reaps = True, 0
    reap = Sessions._reap

    def faulty_reap(self: Sessions) -> None:
        nonlocal reaps
        reaps += 1
        if failing:
            raise RuntimeError("an injected fault in the reaper")
        reap(self)

    monkeypatch.setattr(Sessions, "_reap", faulty_reap)
    caplog.set_level(logging.ERROR, logger="metaagent.background")
    async with service(pool_enabled=False) as client:
        down = await health_until(
            client, lambda r: not r["checks"]["background_tasks"]["ok"], "the failed reaper was not reported"
        )
        assert down["status"] == "degraded"
        assert down["checks"]["background_tasks"]["not_running"] == ["session_reaper"]
        assert reaper(down)["running"] is False
        assert reaper(down)["last_error"] == "RuntimeError"  # the type only: the log has its words
        assert down["checks"]["background_tasks"]["tasks"]["sessions"]["running"] is True

        failing = False
        up = await health_until(
            client,
            lambda r: r["checks"]["background_tasks"]["ok"] and reaper(r)["running"] and reaper(r)["restarts"] >= 1,
            "the reaper was not restarted",
        )
        assert "not_running" not in up["checks"]["background_tasks"]
        restarted_at = reaps
        await health_until(client, lambda r: reaps > restarted_at, "the restarted reaper does not reap")
    failures = [r for r in caplog.records if "background task session_reaper failed" in r.getMessage()]
    assert failures
    assert failures[0].exc_info is not None
    assert "an injected fault in the reaper" in str(failures[0].exc_info[1])


async def test_the_back_off_doubles_with_each_failure_up_to_its_cap() -> None:
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        await anyio.lowlevel.checkpoint()

    tasks = BackgroundTasks(min_backoff_s=0.5, max_backoff_s=4.0, sleep=sleep)
    runs = 0

    async def fails_five_times() -> None:
        nonlocal runs
        runs += 1
        if runs <= 5:
            raise ValueError("again")
        await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        tasks.start(group, "flaky", fails_five_times)
        while runs <= 5:
            await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        assert tasks.check()["ok"] is True
        assert tasks.tasks["flaky"].restarts == 5
        group.cancel_scope.cancel()
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]


async def test_a_task_that_finishes_its_work_is_not_restarted_and_counts_as_healthy() -> None:
    tasks = BackgroundTasks()
    runs = 0

    async def once() -> None:
        nonlocal runs
        runs += 1

    async with anyio.create_task_group() as group:
        tasks.start(group, "setup", once)
    assert runs == 1
    assert tasks.check() == {"ok": True, "tasks": {"setup": {"running": False, "restarts": 0, "finished": True}}}


async def test_a_one_off_job_that_fails_is_logged_and_never_ends_its_task_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise OSError("the engine went away")

    survivor_ran = anyio.Event()

    async def survivor() -> None:
        await anyio.sleep(0.05)
        survivor_ran.set()

    with caplog.at_level(logging.ERROR, logger="metaagent.background"):
        async with anyio.create_task_group() as group:
            group.start_soon(logged, "the end of session ses_x", fails)
            group.start_soon(survivor)
    assert survivor_ran.is_set()
    assert any("the end of session ses_x failed" in r.getMessage() and r.exc_info for r in caplog.records)


@asynccontextmanager
async def a_task_group_held_open(fail_on_exit: bool) -> AsyncIterator[str]:
    """What a session's network is: a task group kept open across the block (anyio's must be left by the
    task that entered it)."""
    async with anyio.create_task_group() as group:
        group.start_soon(anyio.sleep_forever)
        yield "entered"
        group.cancel_scope.cancel()
    if fail_on_exit:
        raise RuntimeError("the exit failed")


async def test_held_in_lets_another_task_leave_what_one_task_entered(caplog: pytest.LogCaptureFixture) -> None:
    async with anyio.create_task_group() as group:
        value, leave = await held_in(group, a_task_group_held_open(fail_on_exit=False), "a resource")
        assert value == "entered"
        async with anyio.create_task_group() as others:
            others.start_soon(leave)  # another task: no "cancel scope in a different task" error
        await leave()  # a second call waits for the same exit
        value, leave = await held_in(group, a_task_group_held_open(fail_on_exit=True), "a failing resource")
        await leave()  # its failure is logged, never raised into `group`
    assert "leaving a failing resource failed" in caplog.text


async def test_held_in_raises_a_failure_to_enter_to_its_caller() -> None:
    @asynccontextmanager
    async def refused() -> AsyncIterator[None]:
        raise ValueError("no volume")
        yield

    async with anyio.create_task_group() as group:
        with pytest.raises(ValueError, match="no volume"):
            await held_in(group, refused(), "a refused resource")
