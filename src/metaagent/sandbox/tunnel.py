"""Tunnels out of a sandbox that has no network: one Unix socket per execution, served by the service.

The container keeps `--network=none`; its only way out is this socket, mounted into it. One tunnel per
connection:

    sandbox -> service   host:port\\n                at most 512 bytes; IPv6 in brackets: [2001:db8::1]:443
    service -> sandbox   OK\\n                       then bytes flow both ways, untouched, until either ends
                     or  ERR <CODE> <message>\\n     and the connection closes

`<CODE>` is a Node.js-style error code (`ERR_METAAGENT_HOST_BLOCKED`, `ENOTFOUND`...) that the runner
puts on the error it raises. The service never sends anything after `OK` before the upstream does, so
the sandbox may start TLS at once.

Every tunnel is decided by the egress guard as an HTTP tool request is: the host must be on the
execution's own allow-list and on `ALLOW_HTTP_HOSTS` (a refusal logs the seed's `[SECURITY]` line and
writes an `egress.blocked` audit record), the guard resolves the name itself, applies the private-address
policy and connects to the address it checked. TLS is not terminated here: the sandbox speaks TLS end to
end and verifies the server itself.

Limits per execution: concurrent tunnels (a connection counts from accept, so idle connections count
too; as many again may wait a few seconds for a free slot, the rest are refused) and the bytes moved in
both directions together (past that limit every tunnel is cut and new ones are refused). Leaving
`serving()` closes every tunnel.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard, escape_for_log
from metaagent.egress.url import parse_host
from metaagent.errors import EgressRefused, HostBlocked, UpstreamError, UpstreamTimeout, sole_error

log = logging.getLogger("metaagent.tunnel")

TOOL = "code_interpreter"
MAX_REQUEST_LINE = 512
REQUEST_LINE_TIMEOUT_S = 10.0
CHUNK = 64 * 1024
# Refusals an execution may provoke: each host refusal writes a [SECURITY] line and an egress.blocked
# record, so past this every request is refused unheard (and only counted). The execution's own audit
# record lists the refusals that were heard.
MAX_REFUSALS = 50

HOST_BLOCKED = "ERR_METAAGENT_HOST_BLOCKED"
TUNNEL_LIMIT = "ERR_METAAGENT_TUNNEL_LIMIT"
BAD_REQUEST = "ERR_METAAGENT_BAD_TUNNEL_REQUEST"

_TARGET = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s\[\]:/@\\]+):(?P<port>[0-9]{1,5})$")


@dataclass(frozen=True)
class TunnelPolicy:
    execution_id: str
    allowlist: AllowList  # the execution's own, already checked to lie within the guard's
    guard: EgressGuard  # the service's: ALLOW_HTTP_HOSTS, the private-address policy, the audit log
    max_tunnels: int
    max_bytes: int
    connect_timeout_s: float = 10.0
    slot_wait_s: float = 5.0


@dataclass
class TunnelStats:
    """What an execution's tunnels did, for its audit record."""

    opened: int = 0
    refused: int = 0  # by policy: host, address or limit
    failed: int = 0  # allowed, but the upstream could not be reached
    bytes_to_upstream: int = 0
    bytes_from_upstream: int = 0
    byte_limit_reached: bool = False
    refusals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        return self.bytes_to_upstream + self.bytes_from_upstream

    def refuse(self, host: str | None, port: int | None, code: str, message: str) -> None:
        self.refused += 1
        if len(self.refusals) < MAX_REFUSALS:
            self.refusals.append({"host": host, "port": port, "code": code, "reason": message})

    def record(self) -> dict[str, Any]:
        return {
            "opened": self.opened,
            "refused": self.refused,
            "failed": self.failed,
            "bytes_to_upstream": self.bytes_to_upstream,
            "bytes_from_upstream": self.bytes_from_upstream,
            "byte_limit_reached": self.byte_limit_reached,
            "refusals": list(self.refusals),
        }


class TunnelRefused(Exception):
    """Ends one tunnel request with `ERR <code> <message>`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_target(line: bytes) -> tuple[str, int]:
    """`host:port` as the sandbox sent it, the host in the allow-list's normal form; raises TunnelRefused."""
    if len(line) > MAX_REQUEST_LINE:
        raise TunnelRefused(BAD_REQUEST, f"the tunnel request is longer than {MAX_REQUEST_LINE} bytes")
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise TunnelRefused(BAD_REQUEST, "the tunnel request must be ASCII host:port") from None
    match = _TARGET.match(text)
    if match is None:
        raise TunnelRefused(BAD_REQUEST, f"the tunnel request must be host:port, not {escape_for_log(text[:100])!r}")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise TunnelRefused(BAD_REQUEST, f"port {port} is out of range")
    try:
        host = parse_host(match["host"])
    except EgressRefused as exc:
        raise TunnelRefused(BAD_REQUEST, exc.message) from None
    return host, port


class _Tunnels:
    """The connections of one execution's socket."""

    def __init__(self, policy: TunnelPolicy, stats: TunnelStats) -> None:
        self.policy = policy
        self.stats = stats
        # The execution's list, with the service's address policy: an address exempt from the private
        # address rule must be an exact entry of the execution's list, not only of ALLOW_HTTP_HOSTS.
        self.narrow_guard = EgressGuard(
            policy.allowlist, allow_private_networks=policy.guard.allow_private_networks, audit=policy.guard.audit
        )
        self.slots = anyio.Semaphore(policy.max_tunnels)
        self.waiting = 0
        self.scopes: set[anyio.CancelScope] = set()

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        # The top of a connection's task: nothing may escape into the server's task group, which would
        # end every tunnel of the execution.
        try:
            async with client:
                if not await self._take_slot():
                    limit = TunnelRefused(
                        TUNNEL_LIMIT, f"too many connections at once (at most {self.policy.max_tunnels})"
                    )
                    await self._reply_refused(client, None, None, limit)
                    return
                try:
                    await self._tunnel(client)
                finally:
                    self.slots.release()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError):
            pass  # the sandbox went away mid-answer
        except Exception:
            log.exception("tunnel of execution %s failed", self.policy.execution_id)

    async def _take_slot(self) -> bool:
        """Waits a little for a free slot: the sandbox may reconnect before this side has seen its last
        connection close. As many connections may wait as may be open; past that, or after the wait, no."""
        if self.slots.value == 0 and self.waiting >= self.policy.max_tunnels:
            return False
        self.waiting += 1
        try:
            with anyio.move_on_after(self.policy.slot_wait_s):
                await self.slots.acquire()
                return True
            return False
        finally:
            self.waiting -= 1

    async def _tunnel(self, client: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(client)
        host: str | None = None
        port: int | None = None
        try:
            try:
                with anyio.fail_after(REQUEST_LINE_TIMEOUT_S):
                    line = await reader.receive_until(b"\n", MAX_REQUEST_LINE)
            except (anyio.DelimiterNotFound, anyio.IncompleteRead, TimeoutError):
                raise TunnelRefused(BAD_REQUEST, "no host:port line") from None
            host, port = parse_target(line)
            if self.stats.refused >= MAX_REFUSALS:
                raise TunnelRefused(
                    TUNNEL_LIMIT, f"{MAX_REFUSALS} connections of this execution were refused; no more tunnels"
                )
            if self.stats.byte_limit_reached:
                raise TunnelRefused(TUNNEL_LIMIT, f"the execution moved its {self.policy.max_bytes} bytes already")
            upstream = await self._connect(host, port)
        except TunnelRefused as refused:
            await self._reply_refused(client, host, port, refused)
            return
        except (UpstreamError, OSError) as exc:
            self.stats.failed += 1
            code, message = _failure(exc, host or "", port or 0)
            await client.send(f"ERR {code} {message}\n".encode())
            return
        async with upstream:
            self.stats.opened += 1
            await client.send(b"OK\n")
            await self._splice(client, reader, upstream)

    async def _connect(self, host: str, port: int) -> anyio.abc.SocketStream:
        context = {"execution_id": self.policy.execution_id}
        try:
            self.narrow_guard.check_host(host, port, tool=TOOL, **context)
            self.policy.guard.check_host(host, port, tool=TOOL, **context)  # depth: the list covers it already
            addresses = await self.narrow_guard.resolve(
                host, port, tool=TOOL, timeout=self.policy.connect_timeout_s, **context
            )
        except HostBlocked:
            raise TunnelRefused(
                HOST_BLOCKED, f"Host {host} is not allowed: it is not on this execution's network allow-list"
            ) from None
        except EgressRefused as exc:  # the address policy: the name resolves to a forbidden address
            raise TunnelRefused(HOST_BLOCKED, f"Host {host} is not allowed: {exc.message}") from None
        last_error: OSError | None = None
        with anyio.fail_after(self.policy.connect_timeout_s):
            for address in addresses:
                try:
                    return await anyio.connect_tcp(address, port)
                except OSError as exc:
                    last_error = exc
        assert last_error is not None  # noqa: S101 -- resolve() never returns an empty list
        raise last_error

    async def _reply_refused(
        self, client: anyio.abc.SocketStream, host: str | None, port: int | None, refused: TunnelRefused
    ) -> None:
        self.stats.refuse(host, port, refused.code, refused.message)
        # The guard logged host refusals with the [SECURITY] line; past the cap nothing more is logged,
        # so a program that hammers blocked hosts cannot flood the log or the audit trail.
        if refused.code != HOST_BLOCKED and self.stats.refused <= MAX_REFUSALS:
            log.warning("execution %s: tunnel refused: %s", self.policy.execution_id, refused.message)
        await client.send(f"ERR {refused.code} {escape_for_log(refused.message)}\n".encode())

    async def _splice(
        self,
        client: anyio.abc.SocketStream,
        client_reader: BufferedByteReceiveStream,
        upstream: anyio.abc.SocketStream,
    ) -> None:
        with anyio.CancelScope() as scope:
            self.scopes.add(scope)
            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._pump, client_reader, upstream, True, scope)
                    group.start_soon(self._pump, upstream, client, False, scope)
            finally:
                self.scopes.discard(scope)

    async def _pump(
        self,
        source: anyio.abc.ByteReceiveStream,
        sink: anyio.abc.SocketStream,
        to_upstream: bool,
        scope: anyio.CancelScope,
    ) -> None:
        try:
            while True:
                data = await source.receive(CHUNK)
                if not self._count(len(data), to_upstream):
                    return
                await sink.send(data)
        except anyio.EndOfStream:
            pass
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            scope.cancel()  # a reset on either side ends the tunnel
            return
        # A clean end of one direction is passed on (half close); the tunnel ends when both are done.
        try:
            await sink.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            scope.cancel()

    def _count(self, size: int, to_upstream: bool) -> bool:
        """Counts moved bytes; past the limit, cuts every tunnel and answers False."""
        if self.stats.bytes_total + size > self.policy.max_bytes:
            if not self.stats.byte_limit_reached:
                log.warning(
                    "execution %s: tunnels cut at the byte limit (%d bytes)",
                    self.policy.execution_id,
                    self.policy.max_bytes,
                )
            self.stats.byte_limit_reached = True
            for scope in list(self.scopes):
                scope.cancel()
            return False
        if to_upstream:
            self.stats.bytes_to_upstream += size
        else:
            self.stats.bytes_from_upstream += size
        return True


def _failure(exc: Exception, host: str, port: int) -> tuple[str, str]:
    """The Node.js error code and message for an allowed tunnel whose upstream could not be reached."""
    if isinstance(exc, UpstreamTimeout | TimeoutError):
        return "ETIMEDOUT", f"connecting to {host}:{port} timed out"
    if isinstance(exc, UpstreamError):
        return "ENOTFOUND", escape_for_log(exc.message)
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return "ECONNREFUSED", f"connecting to {host}:{port} failed: {escape_for_log(reason)}"


@asynccontextmanager
async def serving(socket_path: Path, policy: TunnelPolicy) -> AsyncIterator[TunnelStats]:
    """Serves tunnels on a new Unix socket (mode 0666: the sandbox's uid connects) until the block ends."""
    stats = TunnelStats()
    tunnels = _Tunnels(policy, stats)
    listener = await anyio.create_unix_listener(socket_path, mode=0o666)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, tunnels.handle, group)
            try:
                yield stats
            finally:
                group.cancel_scope.cancel()
    except BaseExceptionGroup as group_error:  # the execution's own error, not wrapped by this task group
        raise sole_error(group_error) from None
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
            await anyio.Path(socket_path).unlink(missing_ok=True)
