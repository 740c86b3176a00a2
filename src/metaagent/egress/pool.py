"""The one outbound connection pool of the HTTP, search and embeddings tools, shared fairly by destination.

A pool shared by every caller is a shared resource an attacker can hold: with httpcore's default of 10
connections, ten requests to a silent host made every other request wait for a free connection. So:

- each destination (scheme, host, port) may use at most `per_host` connections at once, so hung
  requests to one host hold only that host's share, never the connections other hosts need;
- the whole pool holds at most `total` connections (idle ones to other hosts are closed to make room);
- a request waits for a connection at most `max_wait_s`, and never longer than its own pool timeout
  (the HTTP tool's `timeout_s`, the upstream tools' deadline); past that it fails with a PoolTimeout
  that names the limit, which the tools answer as a 504.

A destination's share is taken before the request reaches the pool and given back when its response
is closed, so it counts requests in flight, whatever they are waiting for (connect, headers, body).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpcore2


@dataclass(frozen=True)
class ConnectionLimits:
    per_host: int = 8
    total: int = 64
    max_wait_s: float = 5.0
    keepalive_expiry_s: float = 5.0


class _Destination:
    def __init__(self, limit: int) -> None:
        self.slots = anyio.Semaphore(limit)
        self.users = 0  # requests holding or waiting for a slot; the entry goes when none is left


class _ReleasingStream:
    """The response body; closing it gives the destination's slot back (once)."""

    def __init__(self, stream: AsyncIterable[bytes], release: Callable[[], None]) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            closer = getattr(self._stream, "aclose", None)
            if closer is not None:
                await closer()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class FairPool:
    """An httpcore connection pool behind per-destination shares; `handle_async_request` as httpcore's."""

    def __init__(self, network_backend: httpcore2.AsyncNetworkBackend, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._pool = httpcore2.AsyncConnectionPool(
            # Same TLS as httpx's default: the system trust store, verification on.
            ssl_context=ssl.create_default_context(),
            max_connections=limits.total,
            max_keepalive_connections=limits.total,
            keepalive_expiry=limits.keepalive_expiry_s,
            network_backend=network_backend,
        )
        self._destinations: dict[tuple[bytes, bytes, int | None], _Destination] = {}

    def in_flight(self, scheme: str, host: str, port: int) -> int:
        """Requests to this destination holding a slot now (for tests and metrics)."""
        entry = self._destinations.get((scheme.encode(), host.encode(), port))
        return self.limits.per_host - entry.slots.value if entry else 0

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response:
        origin = request.url.origin
        key = (origin.scheme, origin.host, origin.port)
        timeouts: dict[str, Any] = dict(request.extensions.get("timeout", {}))
        asked = timeouts.get("pool")
        wait_s = self.limits.max_wait_s if asked is None else min(float(asked), self.limits.max_wait_s)
        entry = self._destinations.setdefault(key, _Destination(self.limits.per_host))
        entry.users += 1
        started = time.monotonic()
        try:
            with anyio.fail_after(wait_s):
                await entry.slots.acquire()
        except TimeoutError:
            self._leave(key, entry)
            host = origin.host.decode("ascii", "replace")
            raise httpcore2.PoolTimeout(
                f"no connection to {host} became free within {wait_s:g} s: {self.limits.per_host} requests to it "
                "are already in flight (the limit per destination, METAAGENT_EGRESS_CONNECTIONS_PER_HOST)"
            ) from None
        except BaseException:
            self._leave(key, entry)
            raise

        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                entry.slots.release()
                self._leave(key, entry)

        timeouts["pool"] = max(0.0, wait_s - (time.monotonic() - started))
        request.extensions = {**request.extensions, "timeout": timeouts}
        try:
            response = await self._pool.handle_async_request(request)
        except httpcore2.PoolTimeout:
            release()
            raise httpcore2.PoolTimeout(
                f"no connection became free within {wait_s:g} s: all {self.limits.total} connections of the "
                "service are in use (METAAGENT_EGRESS_MAX_CONNECTIONS)"
            ) from None
        except BaseException:
            release()
            raise
        response.stream = _ReleasingStream(_iterable(response.stream), release)
        return response

    def _leave(self, key: tuple[bytes, bytes, int | None], entry: _Destination) -> None:
        entry.users -= 1
        if entry.users == 0 and self._destinations.get(key) is entry:
            del self._destinations[key]

    async def aclose(self) -> None:
        await self._pool.aclose()


def _iterable(stream: Any) -> AsyncIterable[bytes]:
    if not hasattr(stream, "__aiter__"):
        raise TypeError("an async connection pool answered with a synchronous stream")
    result: AsyncIterable[bytes] = stream
    return result
