"""The egress guard: the one gate in front of every outbound connection of every tool.

Two checks, in this order, for every request and every redirect hop:

1. `check_url`: the URL is http(s) and its host (read as `egress.url` reads it) is on the allow-list. A
   host that cannot be read is blocked the same way (`Blocked host: <host>`, the reason in `reason`).
2. At connect time, inside the HTTP client's network backend: the guard resolves the host itself and
   refuses every address the IANA special-purpose registries do not mark globally reachable
   (`egress.addresses`: loopback, private-use, link-local, documentation, IPv4-mapped, 6to4, the NAT64
   form of any of these, multicast, ...), unless the address is itself an exact allow-list entry or
   private networks are allowed. It then connects to the very address it checked, so a DNS answer that
   changes between check and use (rebinding) changes nothing. TLS still verifies the host name, and the
   Host header is the URL's, because the HTTP client never learns that the address was pinned.

Proxy variables are ignored, TLS is always verified, and every refusal logs the seed's `[SECURITY]` line
and an `egress.blocked` audit record.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

import anyio
import httpcore2
import httpx2
from httpcore2._backends.anyio import AnyIOBackend

from metaagent import metrics
from metaagent.audit import AuditLog
from metaagent.egress.addresses import refusal
from metaagent.egress.allowlist import AllowList, canonical_ip
from metaagent.egress.pool import ConnectionLimits, FairPool
from metaagent.egress.url import InvalidHost, SchemeRefused, Target, parse_url
from metaagent.errors import EgressRefused, HostBlocked, UpstreamError, UpstreamTimeout
from metaagent.logs import escape_for_log as escape_for_log  # re-exported: the tunnel escapes its wire text with it

security_log = logging.getLogger("metaagent.security")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_class(address: IPAddress) -> str | None:
    """Why an address is off-limits by default ("loopback", "private-use", ...), or None if it is globally
    reachable: by the IANA special-purpose registries' table in `egress.addresses`."""
    found = refusal(address)
    return None if found is None else found.kind


class EgressGuard:
    def __init__(
        self,
        allowlist: AllowList,
        *,
        allow_private_networks: bool = False,
        audit: AuditLog | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.allowlist = allowlist
        self.allow_private_networks = allow_private_networks
        self.audit = audit
        self.limits = limits or ConnectionLimits()
        self._pool: FairPool | None = None

    def _refuse(self, line: str, tool: str, **fields: Any) -> None:
        security_log.warning("[SECURITY] %s", line)
        metrics.egress_blocked(tool)
        if self.audit is not None:
            self.audit.append("egress.blocked", tool=tool, **fields)

    def check_url(self, url: str, method: str = "GET", *, tool: str = "http") -> Target:
        """Parses the URL and checks its scheme and host; raises EgressRefused or HostBlocked."""
        shown = f"({method} {url})"  # the log formatter escapes what a caller controls
        try:
            target = parse_url(url)
        except InvalidHost as exc:  # a host that cannot be read is blocked as one not on the list
            self._refuse(
                f"Blocked HTTP request to disallowed host: {exc.host} {shown}",
                tool,
                host=exc.host,
                url=url,
                method=method,
                reason=exc.message,
            )
            raise HostBlocked(exc.host, reason=exc.message) from None
        except SchemeRefused as exc:
            self._refuse(
                f"Blocked HTTP request with disallowed scheme: {exc.scheme} {shown}",
                tool,
                url=url,
                method=method,
                reason="scheme",
            )
            raise
        match = self.allowlist.match(target.host)
        if not match.allowed:
            self._refuse(
                f"Blocked HTTP request to disallowed host: {target.host} {shown}",
                tool,
                host=target.host,
                url=url,
                method=method,
                reason=match.reason,
            )
            raise HostBlocked(target.host)
        if target.has_userinfo:
            raise EgressRefused("Credentials in the URL are not supported: send an Authorization header instead")
        return target

    def check_host(self, host: str, port: int, *, tool: str, **context: Any) -> None:
        """Checks a bare (normalised) host for a tunnel, which has no URL; raises HostBlocked.

        The log line has the seed's shape, with the tunnel's request target where a URL would be.
        """
        match = self.allowlist.match(host)
        if not match.allowed:
            self._refuse(
                f"Blocked HTTP request to disallowed host: {host} (CONNECT {host}:{port})",
                tool,
                host=host,
                port=port,
                method="CONNECT",
                reason=match.reason,
                **context,
            )
            raise HostBlocked(host)

    async def resolve(
        self,
        host: str,
        port: int,
        *,
        tool: str = "http",
        timeout: float | None = None,  # noqa: ASYNC109 -- passed down from httpcore
        **context: Any,
    ) -> list[str]:
        """The addresses to connect to for an allowed host, after the address policy; raises otherwise."""
        if canonical_ip(host) is not None and self.allowlist.match(host).allowed:
            return [host]  # an exact IP entry is an explicit decision of the operator
        try:
            with anyio.fail_after(timeout):
                infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise UpstreamTimeout(f"DNS lookup of {host} timed out") from None
        except OSError as exc:
            raise UpstreamError(f"DNS lookup of {host} failed: {exc.strerror or exc}") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for text in addresses:
            address = ipaddress.ip_address(text.split("%", 1)[0])
            found = refusal(address)
            if found and not self.allow_private_networks and not self.allowlist.match(str(address)).allowed:
                self._refuse(
                    f"Blocked HTTP request to {found.kind} address: {host} resolves to {address}",
                    tool,
                    host=host,
                    port=port,
                    address=str(address),
                    reason=found.kind,
                    **context,
                )
                raise EgressRefused(
                    f"{host} resolves to {address}: {found.describe()}, which the egress policy forbids; "
                    "list that exact address in ALLOW_HTTP_HOSTS or set METAAGENT_ALLOW_PRIVATE_NETWORKS=true",
                    host=host,
                    address=str(address),
                    address_class=found.kind,
                )
        return addresses

    def transport(self, *, tool: str = "http") -> httpx2.AsyncHTTPTransport:
        """A transport for one tool's client; every tool's transport shares the guard's one fair pool."""
        if self._pool is None:
            self._pool = FairPool(_GuardedBackend(self), self.limits)
        return _GuardedTransport(self._pool, tool)

    async def aclose(self) -> None:
        """Closes the connection pool (at shutdown, after the tools' clients)."""
        if self._pool is not None:
            await self._pool.aclose()


# The tool a connection is being made for: the pool is shared, so its backend learns the tool from the
# request's own task (httpcore connects in the task that sends the request).
_connecting_for: ContextVar[str] = ContextVar("metaagent_egress_tool", default="http")


class _GuardedBackend(AnyIOBackend):
    """Resolves through the guard and connects only to the addresses it approved."""

    def __init__(self, guard: EgressGuard) -> None:
        self._guard = guard

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 -- httpcore's interface, not ours
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        addresses = await self._guard.resolve(host, port, tool=_connecting_for.get(), timeout=timeout)
        last_error: Exception | None = None
        for address in addresses:
            try:
                return await super().connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                last_error = exc
        assert last_error is not None  # noqa: S101 -- resolve() never returns an empty list
        raise last_error


class _GuardedTransport(httpx2.AsyncHTTPTransport):
    """httpx's transport around the guard's shared pool: proxies ignored, TLS verified, the tool named."""

    def __init__(self, pool: FairPool, tool: str) -> None:
        super().__init__(trust_env=False)
        # httpx does not expose the network backend, so its pool is replaced by the guard's, which is
        # built around ours; only the way of connecting and the sharing differ.
        self._pool = pool  # type: ignore[assignment]  # the same handle_async_request interface
        self._tool = tool

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        token = _connecting_for.set(self._tool)
        try:
            return await super().handle_async_request(request)
        finally:
            _connecting_for.reset(token)

    async def __aexit__(self, *_exc: object) -> None:
        pass  # the pool is the guard's, closed by `EgressGuard.aclose`

    async def aclose(self) -> None:
        pass  # the pool is the guard's, closed by `EgressGuard.aclose`
