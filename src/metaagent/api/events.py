"""Server-Sent Events for any call whose output comes while it runs (`Accept: text/event-stream`).

    event_stream(call)    call: an awaitable function that takes an `OutputSink` and returns the
                          response model; the answer is an ASGI response that runs it and streams

The call runs in the response's own task group. Until it says `sink.started()` nothing is sent, so a
refusal it raises before then (400, 404, 410, 422, 429, 503) is answered as it would be without
streaming: its status and JSON body. From then on the answer is 200 `text/event-stream`:

    event: stdout | stderr    data: {"text": "..."}    output as it came, whole characters only
    event: dropped            data: {"message": ...}   once, if the client fell behind (see below)
    event: result             data: the JSON body the call would have answered without streaming
    event: error              data: {"error": ..., "status": N}   a failure after the start

and exactly one `result` or `error` ends it. A call that returns without having started (a runner that
failed to start) streams from then on. A keep-alive comment goes out after `KEEPALIVE_S` of silence. A
client that disconnects cancels the call (an execution's container is then killed and removed).

A slow client never makes the service hold more than `MAX_PENDING_CHARS` of its output (plus the
chunk that crossed the bound): past it, output events stop and one `dropped` event says so; the result
still carries the output, capped as usual. Framing is FastAPI's (`format_sse_event`), streaming
Starlette's `StreamingResponse`; the disconnect watch is this module's, one for the whole answer, so it
holds before the start too and whichever ASGI version the server speaks.
"""

from __future__ import annotations

import json
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from metaagent.api.errors import error_response, error_status_and_body
from metaagent.sandbox.output import SinkCall, Stream

MEDIA_TYPE = "text/event-stream"
KEEPALIVE_S = 15.0
# Output waiting for a client that reads slower than the program writes. The caps (75 KiB of a one-shot
# execution's output in all) keep it small anyway; the bound holds whatever a call's caps are.
MAX_PENDING_CHARS = 64 * 1024
DROPPED_MESSAGE = (
    "This client read the stream too slowly, so the service stopped sending output events; "
    "the result event carries the output (capped as usual)"
)

OPENAPI_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer; with `Accept: text/event-stream`, Server-Sent Events: `stdout` and "
        '`stderr` (`{"text": ...}`) as the output comes, then one `result` (this body) or one `error`.',
        "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
    }
}


def wants_event_stream(accept: str) -> bool:
    """Whether an Accept header prefers `text/event-stream` to JSON; JSON, the default, wins a tie."""
    weights: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (item.strip() for item in part.split(";"))
        weight = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weights[media.lower()] = max(weights.get(media.lower(), 0.0), weight)
    events = weights.get(MEDIA_TYPE, 0.0)
    return events > 0 and events > weights.get("application/json", 0.0)


@dataclass
class _Output:
    stream: Stream | None  # None: the one `dropped` notice
    pieces: list[str] = field(default_factory=list)


class OutputEvents:
    """The `OutputSink` of one event stream: output waits here for the client, up to a bound.

    Consecutive pieces of one stream that wait together go out as one event; a client that keeps up
    gets each piece as its own event, at once.
    """

    def __init__(self, max_pending: int = MAX_PENDING_CHARS) -> None:
        self.max_pending = max_pending
        self.pending = 0  # characters waiting
        self.dropping = False
        self.started_event = anyio.Event()
        self.closed_event = anyio.Event()
        self._queue: deque[_Output] = deque()
        self._wake = anyio.Event()

    def started(self) -> None:
        self.started_event.set()

    def output(self, stream: Stream, text: str) -> None:
        if self.dropping or not text:
            return
        if self.pending > self.max_pending:  # the client is behind by more than the bound
            self.dropping = True
            self._queue.append(_Output(None))
        elif self._queue and self._queue[-1].stream == stream:
            self._queue[-1].pieces.append(text)
            self.pending += len(text)
        else:
            self._queue.append(_Output(stream, [text]))
            self.pending += len(text)
        self._wake.set()

    def close(self) -> None:
        """No more output: `next()` answers None once the queue is empty."""
        self.closed_event.set()
        self._wake.set()

    async def wait_started_or_closed(self) -> None:
        async with anyio.create_task_group() as group:
            for event in (self.started_event, self.closed_event):
                group.start_soon(_set_then_cancel, event, group.cancel_scope)

    async def next(self) -> tuple[Stream | None, str] | None:
        """The next output event (stream None: the dropped notice), waiting for one; None at the end."""
        while not self._queue:
            if self.closed_event.is_set():
                return None
            self._wake = anyio.Event()
            await self._wake.wait()
        item = self._queue.popleft()
        text = "".join(item.pieces)
        self.pending -= len(text)
        return item.stream, text


async def _set_then_cancel(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _event(name: str, data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return format_sse_event(data_str=text, event=name)


class _EventIterator:
    """The body of the stream: output events as they come (keep-alive comments in silences), then the end."""

    def __init__(self, events: OutputEvents, outcome: list[BaseModel | Exception]) -> None:
        self._events = events
        self._outcome = outcome
        self._done = False

    def __aiter__(self) -> _EventIterator:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        item: tuple[Stream | None, str] | None = None
        with anyio.move_on_after(KEEPALIVE_S) as silence:
            item = await self._events.next()
        if silence.cancelled_caught:
            return KEEPALIVE_COMMENT
        if item is not None:
            stream, text = item
            return _event("dropped", {"message": DROPPED_MESSAGE}) if stream is None else _event(stream, {"text": text})
        self._done = True
        if not self._outcome:  # the call was cancelled: nobody is listening any more
            raise StopAsyncIteration
        outcome = self._outcome[0]
        if isinstance(outcome, BaseModel):
            return _event("result", outcome.model_dump_json())
        status, body = error_status_and_body(outcome)
        return _event("error", {**body, "status": status})


class EventStreamResponse(Response):
    """Runs `call` with an `OutputEvents` sink and answers as the module says."""

    def __init__(self, call: SinkCall, *, max_pending: int = MAX_PENDING_CHARS) -> None:
        # No body of its own (the base class would render one): headers and body come in __call__.
        self.call = call
        self.max_pending = max_pending
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = OutputEvents(self.max_pending)
        outcome: list[BaseModel | Exception] = []
        async with anyio.create_task_group() as group:

            async def run() -> None:
                try:
                    outcome.append(await self.call(events))
                except Exception as exc:  # answered below: as JSON before the start, as the error event after
                    outcome.append(exc)
                finally:
                    events.close()

            async def cancel_when_gone() -> None:
                # The body is read already, so the next ASGI message can only be the disconnect. This is the
                # one reader of `receive`, whatever the ASGI version: the responses below get none.
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()  # the caller hung up: cancel the call, answer nobody

            group.start_soon(run)
            group.start_soon(cancel_when_gone)
            await events.wait_started_or_closed()
            response: Response
            if not events.started_event.is_set() and outcome and isinstance(outcome[0], Exception):
                response = error_response(outcome[0])  # a refusal: no stream
            else:
                iterator = _EventIterator(events, outcome)
                response = StreamingResponse(iterator, headers=dict(self.headers), media_type=MEDIA_TYPE)
            with suppress(OSError, ClientDisconnect):  # the connection broke under a send: nobody to answer
                await response(scope, _no_message, send)
            group.cancel_scope.cancel()  # after the last event the call has ended; otherwise this ends it


async def _no_message() -> Message:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


def event_stream(call: SinkCall, *, max_pending: int = MAX_PENDING_CHARS) -> EventStreamResponse:
    """The event-stream answer of `call` (see the module's docstring)."""
    return EventStreamResponse(call, max_pending=max_pending)
