"""What route handlers take from the running app."""

from __future__ import annotations

import asyncio
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
    is then killed and removed; a session call is interrupted). Errors come out unwrapped.

    The hang-up is watched by a bare asyncio task that cancels the call's scope: an anyio task group here
    (its task handle, its cancellation, its exit) was a tenth of the service's CPU for a session call."""
    with anyio.CancelScope() as scope:
        watcher = asyncio.get_running_loop().create_task(_cancel_at_hang_up(request, scope))
        try:
            return await call()
        finally:
            watcher.cancel()
    raise ClientGone("The client disconnected before the answer was ready")


async def _cancel_at_hang_up(request: Request, scope: anyio.CancelScope) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
