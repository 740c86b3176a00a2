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

Limits per execution:

- concurrent tunnels (a connection counts from accept, so idle connections count too; as many again may
  wait a few seconds for a free slot, the rest are refused);
- the bytes moved in both directions together (past that limit every tunnel is cut and new ones are
  refused);
- the service's work, in three token buckets (`budget.py`), so that one execution cannot take the
  event loop from the others:
  - check: new tunnels per second (`tunnel_rate`, bursts of twice that). A connection past the rate
    waits for its turn if no more than `max_tunnels` already do (the runner never has more in flight,
    so ordinary code is slowed, not refused); past that it is refused with `ERR_METAAGENT_TUNNEL_RATE`,
    unread, counted, and summed up in one log line when the execution ends;
  - accept: connections accepted per second, four times the tunnel rate (at least 20). Past it the service stops
    calling accept(): further connections wait in the socket's small backlog, in the kernel, or fail
    in the sandbox (EAGAIN) at the sandbox's own cost;
  - relay: chunks relayed per second, all tunnels and both directions together. Past it the pumps
    wait; data piles up in the socket buffers, so the next chunk is larger and throughput stays high.

Refusals by policy (host, address, a failed DNS lookup, a limit) are logged and recorded up to
`MAX_REFUSALS`; past that every tunnel is refused unheard. Leaving `serving()` closes every tunnel.
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

from metaagent import metrics
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard, escape_for_log
from metaagent.egress.url import parse_host
from metaagent.errors import EgressRefused, HostBlocked, UpstreamError, UpstreamTimeout, sole_error
from metaagent.sandbox.budget import TokenBucket

log = logging.getLogger("metaagent.tunnel")

TOOL = "code_interpreter"
MAX_REQUEST_LINE = 512
REQUEST_LINE_TIMEOUT_S = 10.0
CHUNK = 64 * 1024
# Refusals an execution may provoke: each host refusal writes a [SECURITY] line and an egress.blocked
# record, so past this every request is refused unheard (and only counted). The execution's own audit
# record lists the refusals that were heard.
MAX_REFUSALS = 50
DEFAULT_TUNNEL_RATE = 50.0  # new tunnels per second per execution
BURST_S = 2.0  # each bucket holds this many seconds of its rate
SLOT_WAIT_S = 5.0  # how long a connection past max_tunnels waits for a free slot before it is refused
ACCEPTS_PER_TUNNEL = 4  # the accept budget: room for refusals, still bounded
MIN_ACCEPTS_PER_S = 20.0  # so that a low tunnel rate still refuses at once rather than leave connections hanging
RELAY_CHUNKS_PER_S = 2000.0  # up to 64 KiB each: ample for one sandbox at 0.5 CPU
BACKLOG_PER_TUNNEL = 2  # connections the kernel holds for the socket while accept() waits

HOST_BLOCKED = "ERR_METAAGENT_HOST_BLOCKED"
TUNNEL_LIMIT = "ERR_METAAGENT_TUNNEL_LIMIT"
TUNNEL_RATE = "ERR_METAAGENT_TUNNEL_RATE"
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
    slot_wait_s: float = SLOT_WAIT_S
    tunnel_rate: float = DEFAULT_TUNNEL_RATE


@dataclass
class TunnelStats:
    """What an execution's tunnels did, for its audit record."""

    accepted: int = 0  # connections the service accepted
    checked: int = 0  # tunnel requests read and decided
    relayed: int = 0  # chunks relayed, both directions
    opened: int = 0
    refused: int = 0  # by policy (host, address, DNS, a limit) and past the rate
    rate_refused: int = 0  # of which past the rate: never logged one by one
    failed: int = 0  # allowed, but the upstream could not be reached
    bytes_to_upstream: int = 0
    bytes_from_upstream: int = 0
    byte_limit_reached: bool = False
    refusals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        return self.bytes_to_upstream + self.bytes_from_upstream

    @property
    def capped(self) -> int:
        """Refusals that count against MAX_REFUSALS (all but those past the rate)."""
        return self.refused - self.rate_refused

    def refuse(self, host: str | None, port: int | None, code: str, message: str) -> None:
        self.refused += 1
        if len(self.refusals) < MAX_REFUSALS:
            self.refusals.append({"host": host, "port": port, "code": code, "reason": message})

    def record(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "opened": self.opened,
            "refused": self.refused,
            "rate_refused": self.rate_refused,
            "failed": self.failed,
            "bytes_to_upstream": self.bytes_to_upstream,
            "bytes_from_upstream": self.bytes_from_upstream,
            "byte_limit_reached": self.byte_limit_reached,
            "refusals": list(self.refusals),
        }


class TunnelRefused(Exception):
    """Ends one tunnel request with `ERR <code> <message>`; `reason` labels it in /metrics."""

    def __init__(self, code: str, message: str, reason: str = "request") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


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
        rate = policy.tunnel_rate
        self.checks = TokenBucket(rate, max(1.0, rate * BURST_S))
        accept_rate = max(MIN_ACCEPTS_PER_S, rate * ACCEPTS_PER_TUNNEL)
        self.accepts = TokenBucket(accept_rate, accept_rate * BURST_S)
        self.relays = TokenBucket(RELAY_CHUNKS_PER_S, RELAY_CHUNKS_PER_S * BURST_S)

    async def accept_all(self, listener: anyio.abc.SocketListener, group: anyio.abc.TaskGroup) -> None:
        """Accepts connections within the accept budget, each served by a task of its own."""
        while True:
            waited = await self.accepts.take()
            client = await listener.accept()
            self.stats.accepted += 1
            metrics.tunnel_operation("accept", waited)
            group.start_soon(self.handle, client)

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        # The top of a connection's task: nothing may escape into the server's task group, which would
        # end every tunnel of the execution.
        try:
            async with client:
                refusal = await self._admit()
                if refusal is not None:
                    await self._reply_refused(client, None, None, refusal)
                    return
                try:
                    await self._tunnel(client)
                finally:
                    self.slots.release()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError):
            pass  # the sandbox went away mid-answer
        except Exception:
            log.exception("tunnel of execution %s failed", self.policy.execution_id)

    async def _admit(self) -> TunnelRefused | None:
        """Waits for the connection's turn under the tunnel rate, then for a slot; a refusal, or None
        with a slot taken."""
        delay = self.checks.reserve(max_debt=self.policy.max_tunnels)
        if delay is None:
            return TunnelRefused(
                TUNNEL_RATE, f"too many new connections (at most {self.policy.tunnel_rate:g} per second)", "rate"
            )
        self.stats.checked += 1
        metrics.tunnel_operation("check", waited=delay > 0)
        if delay > 0:
            await anyio.sleep(delay)
        if not await self._take_slot():
            return TunnelRefused(
                TUNNEL_LIMIT, f"too many connections at once (at most {self.policy.max_tunnels})", "limit"
            )
        return None

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
            if self.stats.capped >= MAX_REFUSALS:
                raise TunnelRefused(
                    TUNNEL_LIMIT, f"{MAX_REFUSALS} connections of this execution were refused; no more tunnels", "limit"
                )
            if self.stats.byte_limit_reached:
                raise TunnelRefused(
                    TUNNEL_LIMIT, f"the execution moved its {self.policy.max_bytes} bytes already", "bytes"
                )
            upstream = await self._connect(host, port)
        except TunnelRefused as refused:
            await self._reply_refused(client, host, port, refused)
            return
        except OSError as exc:  # TimeoutError included
            self.stats.failed += 1
            code, message = _failure(exc, host or "", port or 0)
            await client.send(f"ERR {code} {message}\n".encode())
            return
        async with upstream:
            self.stats.opened += 1
            await client.send(b"OK\n")
            metrics.TUNNELS_OPEN.inc()
            try:
                await self._splice(client, reader, upstream)
            finally:
                metrics.TUNNELS_OPEN.dec()

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
                HOST_BLOCKED, f"Host {host} is not allowed: it is not on this execution's network allow-list", "host"
            ) from None
        except EgressRefused as exc:  # the address policy: the name resolves to a forbidden address
            raise TunnelRefused(HOST_BLOCKED, f"Host {host} is not allowed: {exc.message}", "address") from None
        except UpstreamTimeout as exc:  # a failed lookup is a refusal: counted, capped and logged
            raise TunnelRefused("EAI_AGAIN", exc.message, "dns") from None
        except UpstreamError as exc:
            raise TunnelRefused("ENOTFOUND", exc.message, "dns") from None
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
        metrics.tunnel_refused(refused.reason)
        if refused.reason == "rate":
            # Counted only: one line at the end sums them up, so a flood writes no flood of lines.
            self.stats.refused += 1
            self.stats.rate_refused += 1
        else:
            self.stats.refuse(host, port, refused.code, refused.message)
            # The guard logged host and address refusals with the [SECURITY] line; past the cap nothing
            # more is logged, so a program that hammers refused hosts cannot flood the log or the audit trail.
            if refused.code != HOST_BLOCKED and self.stats.capped <= MAX_REFUSALS:
                log.warning(
                    "execution %s: tunnel refused: %s", self.policy.execution_id, escape_for_log(refused.message)
                )
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
                waited = await self.relays.take()
                if not self._count(len(data), to_upstream):
                    return
                self.stats.relayed += 1
                metrics.tunnel_relayed(len(data), to_upstream, waited)
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

    def finish(self) -> None:
        """The execution's tunnel work into /metrics, and one line for the refusals nobody heard."""
        stats = self.stats
        metrics.tunnel_execution_ended(stats.accepted, stats.checked, stats.relayed)
        past_cap = max(0, stats.capped - MAX_REFUSALS)
        if stats.rate_refused or past_cap:
            log.warning(
                "execution %s: %d tunnel connections were refused without a line each: %d past the rate of "
                "%g new tunnels per second, %d after its first %d refusals",
                self.policy.execution_id,
                stats.rate_refused + past_cap,
                stats.rate_refused,
                self.policy.tunnel_rate,
                past_cap,
                MAX_REFUSALS,
            )


def _failure(exc: OSError, host: str, port: int) -> tuple[str, str]:
    """The Node.js error code and message for an allowed tunnel whose upstream could not be reached."""
    if isinstance(exc, TimeoutError):
        return "ETIMEDOUT", f"connecting to {host}:{port} timed out"
    reason = exc.strerror or str(exc)
    return "ECONNREFUSED", f"connecting to {host}:{port} failed: {escape_for_log(reason)}"


@asynccontextmanager
async def serving(socket_path: Path, policy: TunnelPolicy) -> AsyncIterator[TunnelStats]:
    """Serves tunnels on a new Unix socket (mode 0666: the sandbox's uid connects) until the block ends."""
    stats = TunnelStats()
    tunnels = _Tunnels(policy, stats)
    backlog = BACKLOG_PER_TUNNEL * policy.max_tunnels
    listener = await anyio.create_unix_listener(socket_path, mode=0o666, backlog=backlog)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(tunnels.accept_all, listener, group)
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
        tunnels.finish()
