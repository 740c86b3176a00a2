"""A call's output as MCP progress notifications: `with_progress(call, report)` runs a call that takes an
`OutputSink` (as `metaagent.api.events.event_stream` does) and sends what it prints through `report`.

Each notification carries the text that came since the last one (stdout and stderr in the order they
arrived) as `message`, and the bytes of output sent so far as `progress`, so that it grows with every
notification as MCP requires; there is no `total`. Pieces are coalesced: at most one notification per
`MIN_INTERVAL_S`, and the last one goes out before the call's result. A notification that cannot be
sent stops the reporting, never the call.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from pydantic import BaseModel

from metaagent.sandbox.output import SinkCall, Stream

log = logging.getLogger("metaagent.mcp")

MIN_INTERVAL_S = 0.1  # about 10 notifications a second at most
# Sends one notification: (bytes of output so far, the text since the last one).
Report = Callable[[float, str], Awaitable[None]]


class ProgressReporter:
    def __init__(self, report: Report, interval_s: float = MIN_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.sent_bytes = 0
        self._report = report
        self._pending: list[str] = []
        self._wake = anyio.Event()
        self._closed = anyio.Event()
        self._failed = False

    def started(self) -> None:
        pass  # nothing to say: MCP has no refusals that must come before the first notification

    def output(self, _stream: Stream, text: str) -> None:
        if text and not self._failed:
            self._pending.append(text)
            self._wake.set()

    def close(self) -> None:
        """No more output: `run()` sends what is pending and returns."""
        self._closed.set()
        self._wake.set()

    async def run(self) -> None:
        while True:
            while not self._pending and not self._closed.is_set():
                self._wake = anyio.Event()
                await self._wake.wait()
            if self._pending:
                await self._send()
            if self._closed.is_set() and not self._pending:
                return
            with anyio.move_on_after(self.interval_s):  # the rate limit; the end of the call skips it
                await self._closed.wait()

    async def _send(self) -> None:
        text = "".join(self._pending)
        self._pending.clear()
        if self._failed:
            return
        self.sent_bytes += len(text.encode("utf-8"))
        try:
            await self._report(self.sent_bytes, text)
        except Exception as exc:  # the client's side of progress is not the call's business
            log.warning("MCP progress notifications stopped: %s", exc)
            self._failed = True


async def with_progress(call: SinkCall, report: Report, interval_s: float = MIN_INTERVAL_S) -> BaseModel:
    """`call`'s answer, its output going out through `report` meanwhile; the last notification comes first.

    A failure of `call` is raised as it is (not in a task group's exception group), so that a refusal
    is the same tool error with or without a `progressToken`.
    """
    reporter = ProgressReporter(report, interval_s)
    answer: list[BaseModel] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(reporter.run)
        try:
            answer.append(await call(reporter))
        except Exception as exc:  # raised below, once the reporter has sent what it holds
            failure.append(exc)
        finally:
            reporter.close()
    if failure:
        raise failure[0]
    return answer[0]
