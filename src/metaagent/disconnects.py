"""A client that hangs up before its answer is complete is one info line in the log, never a traceback.

The ASGI server tells a route that its client is gone with an `http.disconnect` message; Starlette's body
readers turn it into `ClientDisconnect`, which would otherwise reach the error handlers as an unexpected
error (a traceback) and uvicorn after them (a second one). `LogHangUps` wraps every HTTP request, outside
the routes and the other middlewares: the first disconnect seen before the answer is complete writes one
line, in the shape of an access line, with how much of the request body had come; an exception that the
hang-up caused ends the request there, quietly, since there is nobody left to answer. When the service
itself closed the connection (a stalled body, see `metaagent.serving`), the line gives that reason.

Libraries that catch the hang-up themselves and log it with its traceback (the MCP SDK does) are kept
quiet by `DropHangUpTracebacks`, a filter on the log handler: the request's one line already says it.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("metaagent.disconnects")

# Where the server leaves its reason when it closed a connection itself, for the line to give.
CLOSED_REASON_SCOPE_KEY = "metaagent.connection_closed"


def caused_by_hang_up(exc: BaseException) -> bool:
    """Whether `exc` is a ClientDisconnect, raised from one, or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(caused_by_hang_up(inner) for inner in exc.exceptions)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ClientDisconnect):
            return True
        seen = seen.__cause__
    return False


class DropHangUpTracebacks(logging.Filter):
    """Drops a log record whose exception is a hang-up (`LogHangUps` has written the request's line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not caused_by_hang_up(exc)


def _declared_length(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return bytes(value).decode("latin-1")
    return None


class LogHangUps:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        body_done = False
        answered = False
        logged = False

        def note_hang_up() -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            if body_done:
                progress = "before the answer was complete"
            else:
                declared = _declared_length(scope)
                of = f" of {declared}" if declared is not None else ""
                progress = f"after {received}{of} request body bytes"
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            reason = scope.get(CLOSED_REASON_SCOPE_KEY)
            what = f"closed {progress}: {reason}" if reason else f"client hung up {progress}"
            log.info('%s - "%s %s HTTP/%s" %s', who, scope["method"], scope["path"], scope["http_version"], what)

        async def watching_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
            elif message["type"] == "http.disconnect" and not answered:
                note_hang_up()
            return message

        async def watching_send(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True  # before the send: the server may report the disconnect that follows at once
            await send(message)

        try:
            await self.app(scope, watching_receive, watching_send)
        except Exception as exc:
            if not caused_by_hang_up(exc):
                raise
            note_hang_up()
