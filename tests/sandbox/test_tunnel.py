"""The tunnel server on its own: a real Unix socket, real upstream servers on 127.0.0.1, the real guard."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from metaagent.audit import AuditLog
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard
from metaagent.errors import Unavailable
from metaagent.sandbox.network import NetworkLimits, SandboxNetwork
from metaagent.sandbox.tunnel import MAX_REFUSALS, TunnelPolicy, TunnelRefused, TunnelStats, parse_target, serving
from tests.test_metrics import samples

pytestmark = pytest.mark.security

EXECUTION = "exe_tunneltest"


def guard_for(tmp_path: Path, *patterns: str) -> EgressGuard:
    return EgressGuard(AllowList.of(*patterns), audit=AuditLog(tmp_path / "audit.jsonl"))


def audit_records(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@asynccontextmanager
async def tunnel_server(
    tmp_path: Path,
    allow: tuple[str, ...] = ("127.0.0.1",),
    service_allow: tuple[str, ...] = ("127.0.0.1", "127.0.0.2", "localhost"),
    **limits: float,
) -> AsyncIterator[tuple[Path, TunnelStats]]:
    path = tmp_path / "egress.sock"
    policy = TunnelPolicy(
        execution_id=EXECUTION,
        allowlist=AllowList.of(*allow),
        guard=guard_for(tmp_path, *service_allow),
        max_tunnels=int(limits.pop("max_tunnels", 8)),
        max_bytes=int(limits.pop("max_bytes", 1 << 20)),
        **limits,
    )
    async with serving(path, policy) as stats:
        yield path, stats


async def open_tunnel(path: Path, target: str) -> tuple[anyio.abc.SocketStream, bytes]:
    """Connects, asks for `target` and returns the stream and the service's reply line."""
    stream = await anyio.connect_unix(path)
    await stream.send(f"{target}\n".encode())
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = await stream.receive()
        reply += chunk
    return stream, reply


async def http_get(stream: anyio.abc.SocketStream, path: str) -> bytes:
    await stream.send(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    received = b""
    try:
        while True:
            received += await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        pass
    return received


@contextmanager
def holding_server() -> Iterator[tuple[int, threading.Event]]:
    """A TCP server on 127.0.0.1 that never answers; the event is set when its first client hangs up."""
    closed = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(4096):
                pass
        closed.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], closed
    finally:
        listener.close()


@contextmanager
def closing_server() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts every connection and closes it at once: the cheapest
    upstream for a flood of tunnels."""
    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    listener.settimeout(0.2)  # so that the thread sees `stop`; a closed socket does not wake accept()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def until(condition: Callable[[], bool]) -> None:
    """Waits (bounded) for the tunnel server, in this same event loop, to reach a state."""
    with anyio.fail_after(10):
        while not condition():  # noqa: ASYNC110 -- the server's counters set no event to wait on
            await anyio.sleep(0.01)


def tunnel_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import REGISTRY, generate_latest

    return samples(generate_latest(REGISTRY).decode())


async def test_allowed_host_is_tunnelled_and_bytes_are_counted(tmp_path: Path, upstream: str) -> None:
    async with tunnel_server(tmp_path) as (path, stats):
        stream, reply = await open_tunnel(path, f"127.0.0.1:{port_of(upstream)}")
        async with stream:
            response = await http_get(stream, "/bytes?n=1000")
    assert reply == b"OK\n"
    assert response.startswith(b"HTTP/1.1 200")
    assert response.endswith(b"x" * 1000)
    assert stats.opened == 1
    assert stats.bytes_from_upstream == len(response)
    assert stats.bytes_to_upstream > 0
    assert not (tmp_path / "egress.sock").exists()


async def test_host_outside_the_execution_list_is_refused_and_logged_even_when_on_allow_http_hosts(
    tmp_path: Path, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = port_of(upstream)
    with caplog.at_level(logging.WARNING, logger="metaagent.security"):
        async with tunnel_server(tmp_path, allow=("127.0.0.1",)) as (path, stats):
            stream, reply = await open_tunnel(path, f"127.0.0.2:{port}")
            await stream.aclose()
    assert reply == (
        b"ERR ERR_METAAGENT_HOST_BLOCKED Host 127.0.0.2 is not allowed: "
        b"it is not on this execution's network allow-list\n"
    )
    line = f"[SECURITY] Blocked HTTP request to disallowed host: 127.0.0.2 (CONNECT 127.0.0.2:{port})"
    assert line in caplog.messages
    blocked = [r for r in audit_records(tmp_path) if r["event"] == "egress.blocked"]
    assert len(blocked) == 1
    assert blocked[0]["host"] == "127.0.0.2"
    assert blocked[0]["port"] == port
    assert blocked[0]["execution_id"] == EXECUTION
    assert blocked[0]["tool"] == "code_interpreter"
    assert (stats.opened, stats.refused) == (0, 1)
    assert stats.refusals[0]["host"] == "127.0.0.2"
    assert stats.refusals[0]["port"] == port


async def test_name_that_resolves_to_loopback_is_refused_by_the_address_policy(
    tmp_path: Path, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    # localhost is on both lists, but only exact IP entries may lead to loopback addresses.
    with caplog.at_level(logging.WARNING, logger="metaagent.security"):
        async with tunnel_server(tmp_path, allow=("localhost",)) as (path, stats):
            stream, reply = await open_tunnel(path, f"localhost:{port_of(upstream)}")
            await stream.aclose()
    assert reply.startswith(b"ERR ERR_METAAGENT_HOST_BLOCKED Host localhost is not allowed: localhost resolves to")
    assert b"loopback" in reply
    assert any(m.startswith("[SECURITY] Blocked HTTP request to loopback address: localhost") for m in caplog.messages)
    assert stats.refused == 1


async def test_unreachable_allowed_host_fails_with_connection_refused(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with tunnel_server(tmp_path) as (path, stats):
        stream, reply = await open_tunnel(path, f"127.0.0.1:{port}")
        await stream.aclose()
    assert reply.startswith(b"ERR ECONNREFUSED connecting to 127.0.0.1:")
    assert (stats.failed, stats.refused) == (1, 0)


async def test_too_many_concurrent_tunnels_are_refused(tmp_path: Path) -> None:
    async with tunnel_server(tmp_path, max_tunnels=2, slot_wait_s=0.5) as (path, stats):
        # Two connections take both slots, two more wait for one; the fifth is refused at once.
        held = [await anyio.connect_unix(path) for _ in range(4)]
        stream, reply = await open_tunnel(path, "127.0.0.1:80")
        await stream.aclose()
        assert reply == b"ERR ERR_METAAGENT_TUNNEL_LIMIT too many connections at once (at most 2)\n"
        # The waiting ones are refused too when no slot frees up in time.
        for waiting in held[2:]:
            assert (await waiting.receive()).startswith(b"ERR ERR_METAAGENT_TUNNEL_LIMIT")
        for connection in held:
            await connection.aclose()
    assert [r["code"] for r in stats.refusals].count("ERR_METAAGENT_TUNNEL_LIMIT") == 3


async def test_byte_limit_cuts_the_tunnel_and_refuses_new_ones(tmp_path: Path, upstream: str) -> None:
    async with tunnel_server(tmp_path, max_bytes=10_000) as (path, stats):
        stream, reply = await open_tunnel(path, f"127.0.0.1:{port_of(upstream)}")
        async with stream:
            response = await http_get(stream, "/bytes?n=50000")
        assert reply == b"OK\n"
        assert len(response) <= 10_000
        assert stats.byte_limit_reached
        assert stats.bytes_total <= 10_000
        second, second_reply = await open_tunnel(path, f"127.0.0.1:{port_of(upstream)}")
        await second.aclose()
    assert second_reply.startswith(b"ERR ERR_METAAGENT_TUNNEL_LIMIT the execution moved its 10000 bytes")


async def test_leaving_the_server_closes_every_tunnel(tmp_path: Path) -> None:
    with holding_server() as (port, upstream_closed):
        async with tunnel_server(tmp_path) as (path, stats):
            stream, reply = await open_tunnel(path, f"127.0.0.1:{port}")
            await stream.send(b"GET / HTTP/1.1\r\n\r\n")
            assert reply == b"OK\n"
        assert upstream_closed.wait(30)
        with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
            await stream.receive()
        await stream.aclose()
    assert stats.opened == 1
    assert not path.exists()


@pytest.mark.parametrize(
    "line",
    [
        "no-port",
        "a b:80",
        "host:99999",
        "host:0",
        "user@host:80",
        "host/path:80",
        "[not-ipv6]:443",
        "h" * 600 + ":80",
        "bad%zz:80",
    ],
)
async def test_malformed_request_lines_are_refused(tmp_path: Path, line: str) -> None:
    async with tunnel_server(tmp_path) as (path, stats):
        stream, reply = await open_tunnel(path, line)
        await stream.aclose()
    assert reply.startswith(b"ERR ERR_METAAGENT_BAD_TUNNEL_REQUEST ")
    assert stats.refused == 1


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("api.example.com:443", ("api.example.com", 443)),
        ("API.Example.COM.:443", ("api.example.com", 443)),
        ("[::1]:8080", ("::1", 8080)),
        ("0x7f.1:80", ("127.0.0.1", 80)),  # read as a URL host is read, so the guard sees the real address
        ("2130706433:80", ("127.0.0.1", 80)),
    ],
)
def test_request_targets_are_read_like_url_hosts(line: str, expected: tuple[str, int]) -> None:
    assert parse_target(line.encode()) == expected


def test_a_request_target_with_a_control_character_is_refused() -> None:
    with pytest.raises(TunnelRefused):
        parse_target(b"evil\x00.example.com:443")


async def test_a_flood_of_refused_hosts_is_capped_in_the_log_and_the_audit_trail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with tunnel_server(tmp_path) as (path, stats):
        replies = []
        for n in range(MAX_REFUSALS + 20):
            stream, reply = await open_tunnel(path, f"blocked{n}.example:443")
            await stream.aclose()
            replies.append(reply)
    assert stats.refused == MAX_REFUSALS + 20  # every refusal is counted
    assert all(r.startswith(b"ERR ") for r in replies)
    assert b"no more tunnels" in replies[-1]
    blocked = [r for r in audit_records(tmp_path) if r["event"] == "egress.blocked"]
    security_lines = [r for r in caplog.records if "[SECURITY]" in r.getMessage()]
    assert len(blocked) == MAX_REFUSALS  # the rest were refused unheard
    assert len(security_lines) == MAX_REFUSALS


async def test_new_tunnels_past_the_rate_wait_their_turn_and_past_that_are_refused_in_one_summed_up_line(
    tmp_path: Path, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    before = tunnel_metrics()
    # A rate of 0.1 per second holds one token; with two tunnels allowed, two connections may wait for theirs.
    async with tunnel_server(tmp_path, max_tunnels=2, tunnel_rate=0.1) as (path, stats):
        first, first_reply = await open_tunnel(path, f"127.0.0.1:{port_of(upstream)}")
        waiting = [await anyio.connect_unix(path) for _ in range(2)]
        await until(lambda: stats.checked == 3)
        refused = [await open_tunnel(path, f"127.0.0.1:{port_of(upstream)}") for _ in range(5)]
        for stream in [first, *waiting, *(s for s, _ in refused)]:
            await stream.aclose()
    assert first_reply == b"OK\n"
    assert [reply for _, reply in refused] == [
        b"ERR ERR_METAAGENT_TUNNEL_RATE too many new connections (at most 0.1 per second)\n"
    ] * 5
    assert (stats.accepted, stats.checked, stats.opened) == (8, 3, 1)
    assert (stats.refused, stats.rate_refused) == (5, 5)
    assert stats.refusals == []  # counted, not recorded one by one
    assert stats.record()["rate_refused"] == 5
    lines = [r.getMessage() for r in caplog.records if r.name == "metaagent.tunnel"]
    assert lines == [
        f"execution {EXECUTION}: 5 tunnel connections were refused without a line each: "
        "5 past the rate of 0.1 new tunnels per second, 0 after its first 50 refusals"
    ]
    after = tunnel_metrics()
    assert (
        after[("metaagent_tunnel_refusals_total", (("reason", "rate"),))]
        - before.get(("metaagent_tunnel_refusals_total", (("reason", "rate"),)), 0)
        == 5
    )


async def test_failed_dns_lookups_are_refusals_that_are_logged_and_capped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    # A label longer than 63 characters fails in the resolver itself, at once and without a network.
    names = [f"{'n' * 64}.{n}.sandbox.test" for n in range(MAX_REFUSALS + 5)]
    async with tunnel_server(
        tmp_path, allow=("*.sandbox.test",), service_allow=("*.sandbox.test",), tunnel_rate=1000
    ) as (path, stats):
        replies = []
        for name in names:
            stream, reply = await open_tunnel(path, f"{name}:443")
            await stream.aclose()
            replies.append(reply)
    assert replies[0].startswith(f"ERR ENOTFOUND DNS lookup of {names[0]} failed".encode())
    assert all(r.startswith(b"ERR ENOTFOUND ") for r in replies[:MAX_REFUSALS])
    assert all(b"no more tunnels" in r for r in replies[MAX_REFUSALS:])
    assert (stats.refused, stats.failed, stats.opened) == (MAX_REFUSALS + 5, 0, 0)
    assert [r["code"] for r in stats.refusals] == ["ENOTFOUND"] * MAX_REFUSALS
    lines = [r.getMessage() for r in caplog.records if r.name == "metaagent.tunnel"]
    dns_lines = [line for line in lines if ": tunnel refused: DNS lookup of " in line]
    assert len(dns_lines) == MAX_REFUSALS
    assert lines[-1].endswith("0 past the rate of 1000 new tunnels per second, 5 after its first 50 refusals")


async def test_the_work_of_an_executions_tunnels_is_counted_in_metrics_by_phase(tmp_path: Path, upstream: str) -> None:
    def operations(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], phase: str) -> float:
        return metrics.get(("metaagent_tunnel_operations_total", (("phase", phase),)), 0.0)

    before = tunnel_metrics()
    async with tunnel_server(tmp_path) as (path, stats):
        for _ in range(3):
            stream, _reply = await open_tunnel(path, f"127.0.0.1:{port_of(upstream)}")
            async with stream:
                await http_get(stream, "/bytes?n=1000")
    after = tunnel_metrics()
    assert (stats.accepted, stats.checked, stats.opened) == (3, 3, 3)
    assert stats.relayed >= 6  # at least a request and an answer per tunnel
    assert operations(after, "accept") - operations(before, "accept") == 3
    assert operations(after, "check") - operations(before, "check") == 3
    assert operations(after, "relay") - operations(before, "relay") == stats.relayed
    moved = sum(
        after[("metaagent_tunnel_bytes_total", (("direction", d),))]
        - before.get(("metaagent_tunnel_bytes_total", (("direction", d),)), 0.0)
        for d in ("to_upstream", "from_upstream")
    )
    assert moved == stats.bytes_total
    count = ("metaagent_tunnel_execution_operations_count", (("phase", "check"),))
    total = ("metaagent_tunnel_execution_operations_sum", (("phase", "check"),))
    assert after[count] - before.get(count, 0.0) == 1  # one execution ended
    assert after[total] - before.get(total, 0.0) == 3


class EngineWithALongDataRoot:
    """Pure logic: an engine whose volume folders lie too deep for a Unix socket path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.removed: list[str] = []

    async def create_volume(self, name: str, labels: dict[str, str]) -> str:
        folder = self.root / ("d" * 60) / ("e" * 60) / name
        folder.mkdir(parents=True)
        return str(folder)

    async def remove_volume(self, name: str) -> bool:
        self.removed.append(name)
        return True


async def test_a_data_root_too_long_for_a_socket_path_is_a_503_that_says_so(tmp_path: Path) -> None:
    engine: Any = EngineWithALongDataRoot(tmp_path)
    network = SandboxNetwork(engine, guard_for(tmp_path, "127.0.0.1"), NetworkLimits(max_tunnels=2, max_bytes=1024))
    execution_network = network.for_execution(EXECUTION, AllowList.of("127.0.0.1"))
    with pytest.raises(Unavailable, match="shorter data root"):
        async with execution_network:
            pass
    assert engine.removed == [execution_network.volume]  # and the volume went again
