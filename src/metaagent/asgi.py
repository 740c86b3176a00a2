"""The JSON error answer of the service's ASGI middlewares (which answer before any route runs)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import Send


async def send_json_error(send: Send, status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answers `{"error": message}` with `status`, as every error of the service is answered."""
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
