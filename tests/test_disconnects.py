"""A client that hangs up mid-request, against a real service process: one info line, never a traceback."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import pytest
from starlette.requests import ClientDisconnect

from metaagent.disconnects import caused_by_hang_up
from tests.service_process import ServiceProcess, service_process

LOG_WAIT_S = 60


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with service_process(tmp_path_factory.mktemp("disconnects")) as running:
        yield running


def wait_for_line(service: ServiceProcess, offset: int, needle: str) -> str:
    """The log since `offset`, once a line holding `needle` is in it (and a moment more, for any line the
    same event writes after it)."""
    deadline = time.monotonic() + LOG_WAIT_S
    while needle not in service.stderr()[offset:]:
        assert time.monotonic() < deadline, f"no {needle!r} line: {service.stderr()[offset:]}"
        time.sleep(0.1)
    time.sleep(1)
    return service.stderr()[offset:]


@pytest.mark.parametrize(
    ("path", "content_type"),
    [("/tools/code-interpreter", "application/json"), ("/mcp", "application/json"), ("/tools/http", "text/plain")],
)
def test_a_client_that_hangs_up_mid_body_is_one_info_line_without_a_traceback(
    service: ServiceProcess, path: str, content_type: str
) -> None:
    offset = len(service.stderr())
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            "Accept: application/json, text/event-stream\r\nContent-Length: 100000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"code": "' + b"x" * 1000)
        time.sleep(0.5)
    written = wait_for_line(service, offset, "client hung up")
    lines = [line for line in written.splitlines() if path in line or line.startswith(("error", " "))]
    assert len(lines) == 1, written
    assert re.fullmatch(
        rf'info: 127\.0\.0\.1:\d+ - "POST {re.escape(path)} HTTP/1\.1" client hung up after 1010 of 100000 '
        r"request body bytes",
        lines[0],
    ), written


def test_only_a_client_disconnect_or_what_it_caused_counts_as_a_hang_up() -> None:
    assert caused_by_hang_up(ClientDisconnect())
    wrapped = ValueError("body unreadable")
    wrapped.__cause__ = ClientDisconnect()
    assert caused_by_hang_up(wrapped)
    assert caused_by_hang_up(ExceptionGroup("both", [ClientDisconnect(), ClientDisconnect()]))
    assert not caused_by_hang_up(ExceptionGroup("mixed", [ClientDisconnect(), RuntimeError("bug")]))
    assert not caused_by_hang_up(RuntimeError("bug"))
