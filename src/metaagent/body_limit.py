"""The request body limit: 413 for bodies larger than `METAAGENT_MAX_REQUEST_BODY_BYTES`.

A declared `Content-Length` past the limit is refused before a byte of the body is read; a body without
one (chunked) is counted while it streams in and refused as soon as it passes the limit, so no caller
can make the service hold more than the limit in memory for one request.
"""

from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metaagent.asgi import send_json_error


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-stream. An HTTPException, so FastAPI's body reader passes it on untouched
    to the app's error handler (which renders it as JSON); other apps (MCP) are answered by the middleware."""

    def __init__(self, limit: int, setting: str = "METAAGENT_MAX_REQUEST_BODY_BYTES") -> None:
        super().__init__(413, _message(limit, setting))


def _message(limit: int, setting: str) -> str:
    return f"Request body too large: the limit is {limit} bytes ({setting})"


# The session file uploads, whose bodies are files: their limit is the file size limit.
_FILE_ROUTE = re.compile(r"^/sessions/[^/]+/files/")


class LimitRequestBody:
    def __init__(self, app: ASGIApp, max_bytes: int, max_file_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_file_bytes = max_file_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.max_bytes, "METAAGENT_MAX_REQUEST_BODY_BYTES"
        if self.max_file_bytes is not None and _FILE_ROUTE.match(scope["path"]):
            limit, setting = self.max_file_bytes, "METAAGENT_SESSION_MAX_FILE_MB"
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await send_json_error(send, 413, _message(limit, setting))
            return

        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, setting)
            return message

        async def watching_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge:
            if not response_started:
                await send_json_error(send, 413, _message(limit, setting))


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit():
            # Past 18 digits it is past any limit; Python refuses to convert more than 4300 (ValueError).
            return int(value) if len(value) <= _MAX_LENGTH_DIGITS else 10**_MAX_LENGTH_DIGITS
    return None


_MAX_LENGTH_DIGITS = 18
