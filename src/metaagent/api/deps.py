"""What route handlers take from the running app."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request

from metaagent.errors import ClientGone
from metaagent.services import Services

T = TypeVar("T")


def services(request: Request) -> Services:
    """The running service's parts, built by the lifespan."""
    found: Services = request.app.state.services
    return found


async def until_disconnect(request: Request, call: Callable[[], Awaitable[T]]) -> T:
    """Runs `call()` after the body was read; a caller that hangs up cancels it (an execution's container
    is then killed and removed; a session call is interrupted). Errors come out unwrapped."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch_disconnect() -> None:
            # The body is read already, so the next ASGI message can only be the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch_disconnect)
        try:
            result.append(await call())
        except Exception as exc:  # carried out of the task group unwrapped, for the error handlers
            failure.append(exc)
        group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        raise ClientGone("The client disconnected before the answer was ready")
    return result[0]
