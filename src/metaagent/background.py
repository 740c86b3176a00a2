"""The service's background tasks, kept running: a task that fails is logged with its cause and restarted
after a back-off, and `/health` names a task that is not running (`BackgroundTasks.check`).

`logged` is for one-off background jobs (a kill the reaper starts): a failure is logged and goes no
further, so it never ends the task group that holds the others.

`held_in` enters an async context manager in a task of its own, so that any task may end it: anyio's task
groups and cancel scopes must be left by the task that entered them, and a session's resources are entered
by the request that opens it and left by the task that serves it (or by a close, or the reaper).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.abc

from metaagent.errors import MetaAgentError

log = logging.getLogger("metaagent.background")

T = TypeVar("T")

MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# A task that ran this long before it failed starts again from the shortest back-off.
_HEALTHY_AFTER_S = 60.0


@dataclass
class TaskState:
    name: str
    running: bool = False
    finished: bool = False  # returned by itself: its work is done (it is not restarted)
    restarts: int = 0
    error: str | None = None  # the last failure, in the service's words (the log has the traceback)

    def view(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "restarts": self.restarts,
            **({"finished": True} if self.finished else {}),
            **({"last_error": self.error} if self.error else {}),
        }


class BackgroundTasks:
    """Starts named background tasks in a task group and restarts each one that raises."""

    def __init__(
        self,
        *,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self.tasks: dict[str, TaskState] = {}

    def start(self, group: anyio.abc.TaskGroup, name: str, run: Callable[[], Awaitable[object]]) -> None:
        state = self.tasks[name] = TaskState(name)
        group.start_soon(self._keep, state, run, name=f"supervised {name}")

    async def _keep(self, state: TaskState, run: Callable[[], Awaitable[object]]) -> None:
        failures = 0
        while True:
            state.running = True
            began = time.monotonic()
            try:
                await run()
            except Exception as exc:  # the top of a background task: whatever it raised is logged, and it restarts
                state.running = False
                state.restarts += 1
                state.error = _describe(exc)
                failures = 1 if time.monotonic() - began >= _HEALTHY_AFTER_S else failures + 1
                delay = min(self.max_backoff_s, self.min_backoff_s * 2 ** (failures - 1))
                log.error(
                    "background task %s failed (%s); restarting it in %.1f s", state.name, state.error, delay,
                    exc_info=exc,
                )  # fmt: skip
                await self._sleep(delay)
                continue
            finally:
                if state.running:  # returned or cancelled (the service stops)
                    state.running = False
            state.finished = True
            return

    def check(self) -> dict[str, Any]:
        """The health check: ok while every task runs (or finished its work); else it names the others."""
        down = sorted(name for name, state in self.tasks.items() if not state.running and not state.finished)
        return {
            "ok": not down,
            **({"not_running": down} if down else {}),
            "tasks": {name: state.view() for name, state in sorted(self.tasks.items())},
        }


def _describe(exc: BaseException) -> str:
    # An unexpected error's own words may hold anything: its type only (the log has the rest).
    text = exc.message if isinstance(exc, MetaAgentError) else type(exc).__name__
    return text[:300]


async def logged(what: str, job: Callable[..., Awaitable[object]], *args: Any) -> None:
    """Runs a one-off background job; if it fails, the failure is logged with its cause, and that is all."""
    try:
        await job(*args)
    except Exception:  # the top of a one-off background job: logged, never raised into its group
        log.exception("%s failed", what)


async def held_in(
    group: anyio.abc.TaskGroup, manager: AbstractAsyncContextManager[T], what: str
) -> tuple[T, Callable[[], Awaitable[None]]]:
    """Enters `manager` in a new task of `group`; returns what it gave and `leave`, which any task may await
    to exit it (once; later calls wait for the same exit). A failure to enter is raised here; a failure on
    the way out is logged, and goes no further, as `logged`'s. If `group` is cancelled first (a shutdown),
    the manager is left then, and `leave` returns at once."""
    release, left = anyio.Event(), anyio.Event()

    async def hold(*, task_status: anyio.abc.TaskStatus[T]) -> None:
        entered = False
        try:
            async with manager as value:
                entered = True
                task_status.started(value)
                await release.wait()
        except Exception:
            if not entered:
                raise  # the caller's error: `start` raises it
            log.exception("leaving %s failed", what)
        finally:
            left.set()

    async def leave() -> None:
        release.set()
        await left.wait()

    value: T = await group.start(hold)
    return value, leave


__all__ = ["BackgroundTasks", "TaskState", "held_in", "logged"]
