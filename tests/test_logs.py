"""Log lines cannot be forged, in either format, and access lines carry no query string or credential.

Against a real `metaagent serve` process: what is checked is its stderr as written, split into lines the
way every reader splits it (`str.splitlines` also breaks at NEL, U+2028, U+2029 and other separators).
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path
from urllib.parse import quote

import httpx2
import pytest

from metaagent.logs import DropQueryString, escape_for_log, formatter
from tests.service_process import ServiceProcess, service_process
from tests.test_access import ALICE, KEYS

pytestmark = pytest.mark.security

FORGED = "[SECURITY] Blocked HTTP request to disallowed host: evil.com (GET https://evil.com/)"
# Every character some reader ends a line at, as a caller can put it in a URL path (percent-encoded).
BREAKERS = {
    "LF": "%0A",
    "CR": "%0D",
    "CRLF": "%0D%0A",
    "NUL": "%00",
    "VT": "%0B",
    "FF": "%0C",
    "FS": "%1C",
    "ESC": "%1B",
    "DEL": "%7F",
    "NEL": "%C2%85",
    "C1 CSI": "%C2%9B",
    "LINE SEPARATOR": "%E2%80%A8",
    "PARAGRAPH SEPARATOR": "%E2%80%A9",
}
FORGED_PATH = quote(FORGED, safe="")


def messages(stderr: str, log_format: str) -> list[str]:
    """Each line's message, the lines split as any reader splits them (a JSON line must parse whole)."""
    lines = stderr.splitlines()
    return [json.loads(line)["message"] for line in lines] if log_format == "json" else lines


def security_lines(stderr: str, log_format: str) -> list[str]:
    return [message for message in messages(stderr, log_format) if message.startswith("[SECURITY]")]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_refused_path_cannot_forge_a_log_line_with_any_line_breaker(tmp_path: Path, log_format: str) -> None:
    with service_process(tmp_path, METAAGENT_API_KEYS=KEYS, METAAGENT_LOG_FORMAT=log_format) as service:
        for name, breaker in BREAKERS.items():
            response = httpx2.get(f"{service.base}/x{breaker}{FORGED_PATH}", timeout=30)
            assert response.status_code == 401, name  # refused by the key check, which logs the path
        service.stop()
        stderr = service.stderr()
    assert security_lines(stderr, log_format) == []
    refused = [line for line in messages(stderr, log_format) if "refused GET /x" in line]
    assert len(refused) == len(BREAKERS)
    assert any("/x\\x0a[SECURITY]" in line for line in refused)
    assert any("/x\\u2028[SECURITY]" in line for line in refused)
    assert any("/x\\x85[SECURITY]" in line for line in refused)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_blocked_url_cannot_forge_a_security_line(tmp_path: Path, log_format: str) -> None:
    url = "https://evil.com/x\r\n" + FORGED + "\u2028" + FORGED + "\x85" + FORGED + "\x00"
    with service_process(tmp_path, ALLOW_HTTP_HOSTS='["127.0.0.1"]', METAAGENT_LOG_FORMAT=log_format) as service:
        response = httpx2.post(f"{service.base}/tools/http", json={"url": url}, timeout=30)
        assert response.status_code == 400
        service.stop()
        stderr = service.stderr()
    security = security_lines(stderr, log_format)
    assert len(security) == 1, security  # the real refusal, once, on one line
    assert "\\x0d\\x0a[SECURITY]" in security[0]
    assert "\\u2028[SECURITY]" in security[0]
    assert "\\x85[SECURITY]" in security[0]


def test_a_query_string_never_reaches_an_access_line(tmp_path: Path) -> None:
    secret = "sk-live-do-not-log-me-0123456789"
    with service_process(tmp_path) as service:
        assert httpx2.get(f"{service.base}/metrics?api_key={secret}", timeout=30).status_code == 200
        assert httpx2.get(f"{service.base}/health?token={secret}&x=1", timeout=30).status_code == 200
        service.stop()
        stderr = service.stderr()
    assert secret not in stderr
    assert '"GET /metrics HTTP/1.1" 200' in stderr  # the access line is there, without its query


def test_a_key_sent_as_bearer_or_in_the_query_never_reaches_the_log(tmp_path: Path) -> None:
    with service_process(tmp_path, METAAGENT_API_KEYS=KEYS) as service:
        httpx2.get(f"{service.base}/tools", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
        httpx2.get(f"{service.base}/tools?key={ALICE}", timeout=30)
        httpx2.get(f"{service.base}/tools", headers={"Authorization": f"Bearer {ALICE}x"}, timeout=30)
        service.stop()
        stderr = service.stderr()
    assert ALICE not in stderr


def raw_request(service: ServiceProcess, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_raw_nel_in_host_or_origin_headers_never_reaches_the_log_raw(tmp_path: Path) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    with service_process(tmp_path) as service:
        for headers in (
            b"Host: evil\x85" + FORGED.encode() + b"\r\n",
            b"Host: 127.0.0.1\r\nOrigin: http://evil\x85" + FORGED.encode() + b"\r\n",
            b"Host: 127.0.0.1\r\nMcp-Session-Id: abc\x85" + FORGED.encode() + b"\r\n",
        ):
            answer = raw_request(
                service,
                b"POST /mcp HTTP/1.1\r\n" + headers + b"Content-Type: application/json\r\n"
                b"Accept: application/json, text/event-stream\r\nConnection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
            )
            assert answer.split(b" ", 2)[1] in (b"421", b"403", b"404"), answer[:200]
        service.stop()
        raw = service.stderr_path.read_bytes()
    assert b"\x85" not in raw
    assert "\u0085".encode() not in raw
    assert security_lines(raw.decode("utf-8", "replace"), "text") == []


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        ("a\nb", "a\\x0ab"),
        ("a\rb", "a\\x0db"),
        ("\x00\x1b\x7f", "\\x00\\x1b\\x7f"),
        ("\x85\x9b", "\\x85\\x9b"),
        ("\u2028\u2029", "\\u2028\\u2029"),
        ("lone \udfff", "lone \\udfff"),
        ("a\\x0ab", "a\\\\x0ab"),  # a literal escape is doubled, so it cannot pass for an escaped newline
        ("café ☕ 𝄞", "café ☕ 𝄞"),
    ],
)
def test_escape_for_log_escapes_every_line_breaker_and_nothing_else(raw: str, escaped: str) -> None:
    assert escape_for_log(raw) == escaped


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_an_exception_message_cannot_start_a_log_line(log_format: str) -> None:
    try:
        raise ValueError("bad input\n" + FORGED)
    except ValueError:
        record = logging.LogRecord(
            "metaagent", logging.ERROR, __file__, 1, "failed: %s", ("x\n" + FORGED,), sys.exc_info()
        )
    line = formatter(log_format).format(record)
    for part in line.splitlines():
        assert not part.startswith("[SECURITY]")
    if log_format == "json":
        assert len(line.splitlines()) == 1


def test_the_access_filter_drops_only_the_query() -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', None, None)
    record.args = ("127.0.0.1:5", "GET", "/metrics?api_key=secret", "1.1", 200)
    assert DropQueryString().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /metrics HTTP/1.1" 200'
