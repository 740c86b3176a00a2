"""Network for sandboxed code, without a network in the container.

An execution that asks for `network: {"allow": [...]}` gets:

- its own allow-list: each pattern is validated like `ALLOW_HTTP_HOSTS` and must be covered by it, so a
  request can narrow the service's egress policy but never widen it;
- a named volume `metaagent-<execution id>` mounted read-only at `/run/metaagent`, holding only the Unix
  socket of its tunnel server (`tunnel.py`). A named volume rather than a bind mount, because its folder
  lies under the engine's data root, which containers see anyway through Docker's own `/etc/hosts`
  mounts: no path of the service's shows in the container's mountinfo. The container still runs with
  `--network=none`: it has no interface but `lo` and no address;
- the socket's path and the operator's extra CA certificates in the runner's payload header, so that
  the runner routes node's `http`, `https` and `fetch` through the socket.

The volume is removed when the execution ends, on every path, after the container (a volume in use
cannot be removed); volumes of a service that died are removed at the next start, with its containers.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio

from metaagent.egress.allowlist import AllowList, PatternError, normalize_pattern
from metaagent.egress.guard import EgressGuard
from metaagent.errors import ConfigError, RequestRefused, Unavailable
from metaagent.sandbox.engine import (
    EXECUTION_LABEL,
    MAX_UNIX_SOCKET_PATH,
    OWNER_PID_LABEL,
    SERVICE_LABEL,
    Engine,
    EngineUnavailable,
    Mount,
)
from metaagent.sandbox.execute import RunnerEgress
from metaagent.sandbox.tunnel import DEFAULT_TUNNEL_RATE, TunnelPolicy, TunnelStats, serving

log = logging.getLogger("metaagent.network")

SOCKET_DIR = "/run/metaagent"  # in the container
SOCKET_NAME = "egress.sock"
EXTRA_CA_SETTING = "METAAGENT_SANDBOX_EXTRA_CA_CERTS"
MAX_EXTRA_CA_BYTES = 1024 * 1024
_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----")


def read_extra_ca_certs(path: Path | None) -> bytes:
    """The certificates of the operator's PEM bundle, or b"" without one; raises ConfigError.

    Only the CERTIFICATE blocks are kept: anything else in the file (a private key kept next to its
    CA, say) never reaches a sandbox.
    """
    if path is None:
        return b""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{EXTRA_CA_SETTING}: cannot read {path} ({exc.strerror or exc})",
            ["point it at a readable PEM file of CA certificates, or unset it"],
        ) from None
    if len(data) > MAX_EXTRA_CA_BYTES:
        raise ConfigError(f"{EXTRA_CA_SETTING}: {path} is larger than 1 MiB", ["keep only the CAs the sandbox needs"])
    blocks = _CERTIFICATE.findall(data)
    if not blocks:
        raise ConfigError(
            f"{EXTRA_CA_SETTING}: {path} holds no PEM certificate",
            ["it must contain -----BEGIN CERTIFICATE----- blocks"],
        )
    pem = b"\n".join(blocks) + b"\n"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"{EXTRA_CA_SETTING}: {path} holds a certificate that does not load ({exc})", ["check the file"]
        ) from None
    return pem


@dataclass(frozen=True)
class NetworkLimits:
    max_tunnels: int
    max_bytes: int
    connect_timeout_s: float = 10.0
    tunnel_rate: float = DEFAULT_TUNNEL_RATE  # new tunnels per second per execution


class SandboxNetwork:
    """The service's side: validates requests and opens each execution's tunnel."""

    def __init__(self, engine: Engine, guard: EgressGuard, limits: NetworkLimits, extra_ca_pem: bytes = b"") -> None:
        self.engine = engine
        self.guard = guard
        self.limits = limits
        self.extra_ca_pem = extra_ca_pem

    def allowlist_for(self, patterns: list[str]) -> AllowList:
        """The execution's allow-list; a 400 names the first pattern that is malformed or would widen the policy."""
        for pattern in patterns:
            try:
                normal = normalize_pattern(pattern)
            except PatternError as exc:
                raise RequestRefused(
                    f"Invalid network.allow entry {exc.entry!r}: {exc.reason}; {exc.fix}", pattern=pattern
                ) from None
            if not self.guard.allowlist.covers(normal):
                raise RequestRefused(
                    f"Network pattern not allowed: {pattern} would widen the service's egress policy "
                    "(ALLOW_HTTP_HOSTS does not allow every host it matches); list only hosts ALLOW_HTTP_HOSTS allows",
                    pattern=pattern,
                )
        return AllowList(patterns)

    def for_execution(self, execution_id: str, allowlist: AllowList) -> ExecutionNetwork:
        return ExecutionNetwork(self, execution_id, allowlist)


class ExecutionNetwork:
    """One execution's volume and tunnel server: `async with` it around the container's whole life."""

    def __init__(self, network: SandboxNetwork, execution_id: str, allowlist: AllowList) -> None:
        self.network = network
        self.execution_id = execution_id
        self.allowlist = allowlist
        self.volume = f"metaagent-{execution_id}"
        self.mounts = (Mount(target=SOCKET_DIR, source=self.volume, kind="volume", read_only=True),)
        self.runner = RunnerEgress(
            socket_path=f"{SOCKET_DIR}/{SOCKET_NAME}",
            max_tunnels=network.limits.max_tunnels,
            extra_ca_pem=network.extra_ca_pem,
        )
        self.stats = TunnelStats()
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> ExecutionNetwork:
        engine = self.network.engine
        labels = {SERVICE_LABEL: "metaagent", EXECUTION_LABEL: self.execution_id, OWNER_PID_LABEL: str(os.getpid())}
        await self._stack.__aenter__()
        try:
            self._stack.push_async_callback(self._remove_volume)
            # Shielded: a creation abandoned at a hang-up could finish after the removal above ran.
            with anyio.CancelScope(shield=True):
                folder = Path(await engine.create_volume(self.volume, labels))
            if not await anyio.Path(folder).is_dir():
                raise Unavailable(
                    f"Network for sandboxed code needs the container engine on this machine: its volume folder "
                    f"{folder} is not reachable from the service"
                )
            socket_path = folder / SOCKET_NAME
            if len(os.fsencode(socket_path)) > MAX_UNIX_SOCKET_PATH:
                raise Unavailable(
                    "Network for sandboxed code needs a Unix socket in the engine's volume folder, and that "
                    f"path is longer than the {MAX_UNIX_SOCKET_PATH} bytes Linux allows; give the container "
                    "engine a shorter data root (dockerd --data-root)"
                )
            policy = TunnelPolicy(
                execution_id=self.execution_id,
                allowlist=self.allowlist,
                guard=self.network.guard,
                max_tunnels=self.network.limits.max_tunnels,
                max_bytes=self.network.limits.max_bytes,
                connect_timeout_s=self.network.limits.connect_timeout_s,
                tunnel_rate=self.network.limits.tunnel_rate,
            )
            self.stats = await self._stack.enter_async_context(serving(socket_path, policy))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self._stack.__aexit__(exc_type, exc, tb)

    async def _remove_volume(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.network.engine.remove_volume(self.volume)
            except EngineUnavailable as exc:
                # Not raised over the execution's own outcome; the next start removes it as an orphan.
                log.warning("volume %s of execution %s was not removed: %s", self.volume, self.execution_id, exc)

    def audit_record(self) -> dict[str, object]:
        return {"allow": list(self.allowlist.patterns), "tunnels": self.stats.record()}
