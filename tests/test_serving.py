"""Connections cost their holder, not the service: the deadlines and the connection cap of a real
`metaagent serve` process, with real sockets on 127.0.0.1 and a real open-file limit."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from metaagent.errors import ConfigError
from metaagent.serving import connection_limits
from metaagent.settings import Settings
from tests.service_process import ServiceProcess, service_process

KEY = "alice-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLOSE_WAIT_S = 60
HEAD = "Host: 127.0.0.1\r\n"
HALF_BODY = (
    f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    '{"code": "'
).encode()
# Every way to hold a connection without finishing a request.
STALLED = {
    "nothing sent": b"",
    "half a request line": b"GET /tools HT",
    "half the headers": f"GET /tools HTTP/1.1\r\n{HEAD}Accept: appl".encode(),
    "half a body": HALF_BODY,
    "idle after an answer": f"GET /health HTTP/1.1\r\n{HEAD}\r\n".encode(),
}


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    sock.settimeout(CLOSE_WAIT_S)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def response_parts(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


def small_window_connection(port: int) -> socket.socket:
    """A connection whose client takes little at a time (a 4 KiB receive window), for clients that stop reading."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: it sets the window
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock


def holds_connection(pid: int, client_port: int) -> bool:
    """Whether process `pid` has a descriptor for its end of the TCP connection from `client_port`."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rsplit(":", 1)[1], 16) == client_port and fields[9] != "0":
            inodes.add(f"socket:[{fields[9]}]")
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) in inodes:
                return True
    return False


def read_until(sock: socket.socket, end: bytes) -> bytes:
    """What the server sends up to and with `end` (the connection left open)."""
    sock.settimeout(CLOSE_WAIT_S)
    received = b""
    while end not in received:
        chunk = sock.recv(1)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return received


def wait_for_log(service: ServiceProcess, needle: str) -> str:
    deadline = time.monotonic() + CLOSE_WAIT_S
    while needle not in service.stderr():
        assert time.monotonic() < deadline, f"no {needle!r} in the log: {service.stderr()}"
        time.sleep(0.1)
    return service.stderr()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def enough_open_files() -> Iterator[None]:
    """This test process holds over a thousand sockets: its own limit is raised for the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
        except (ValueError, OSError):
            pytest.skip(f"this test needs {wanted} open files and the hard limit is {hard}")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def quick_deadlines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with service_process(
        tmp_path_factory.mktemp("deadlines"),
        METAAGENT_CLIENT_HEADER_TIMEOUT_S="1",
        METAAGENT_CLIENT_BODY_TIMEOUT_S="2",
        METAAGENT_KEEP_ALIVE_TIMEOUT_S="1",
    ) as service:
        yield service


# --- the deadlines -------------------------------------------------------------------------------------


@pytest.mark.security
@pytest.mark.parametrize("kind", list(STALLED))
def test_each_kind_of_stalled_connection_is_closed_by_the_service_after_its_deadline(
    quick_deadlines: ServiceProcess, kind: str
) -> None:
    deadline_s = {"half a body": 2.0}.get(kind, 1.0)
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(STALLED[kind])
        received = read_until_closed(sock)
        waited = time.monotonic() - started
    assert waited >= 0.9 * deadline_s, received  # closed by the deadline, not before it
    if kind == "nothing sent":
        assert received == b""
    elif kind in ("half a request line", "half the headers"):
        status, headers, body = response_parts(received)
        assert status == 408
        assert headers["content-type"] == "application/json"
        assert headers["connection"] == "close"
        assert "METAAGENT_CLIENT_HEADER_TIMEOUT_S" in json.loads(body)["error"]
    elif kind == "half a body":
        assert received == b""  # the route had the request; the service closed it under the route
        log = wait_for_log(quick_deadlines, "no request body bytes came for 2 s")
        line = next(line for line in log.splitlines() if "no request body bytes came" in line)
        assert '"POST /tools/code-interpreter HTTP/1.1" closed after 10 of 1000 request body bytes' in line
        assert line.startswith("info: ")
    else:
        status, _, _ = response_parts(received)
        assert status == 200  # answered, then closed once idle


@pytest.mark.security
def test_a_slow_request_line_and_headers_are_timed_as_a_whole_not_per_byte(quick_deadlines: ServiceProcess) -> None:
    head = f"GET /health HTTP/1.1\r\n{HEAD}X-Slow: {'a' * 40}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # closed under the drip
            time.sleep(0.05)
        received = read_until_closed(sock)
    assert response_parts(received)[0] == 408


@pytest.mark.security
def test_the_body_deadline_is_per_chunk_a_body_that_keeps_coming_is_never_cut_and_one_that_stops_is(
    quick_deadlines: ServiceProcess,
) -> None:
    body = json.dumps({"code": "1", "padding": "x" * 100}).encode()
    chunks = [body[i : i + 4] for i in range(0, len(body), 4)]  # 30 chunks, 0.1 s apart: past the 2 s deadline
    head = (
        f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head.encode())
        for chunk in chunks:
            time.sleep(0.1)
            sock.sendall(chunk)
        assert time.monotonic() - started > 2
        status, _, answer = response_parts(read_until_closed(sock))
    assert status == 422, answer  # the whole body arrived and was judged: `padding` is not a field
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"".join(chunks[:10]))
        assert read_until_closed(sock) == b""  # the same body, stopped a third of the way: closed


@pytest.mark.security
def test_a_connection_answered_before_its_body_ended_is_closed_once_idle_after_the_body(
    quick_deadlines: ServiceProcess,
) -> None:
    """A 413 goes out on the head alone; the client may still send the body it announced. Once it has, the
    connection is idle like any other, and its keep-alive deadline runs."""
    size = 9 * 1024 * 1024  # past the default 8 MiB limit
    head = (
        f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Content-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        sock.sendall(head.encode())
        assert response_parts(read_until(sock, b'METAAGENT_MAX_REQUEST_BODY_BYTES)"}'))[0] == 413
        sock.sendall(b"x" * size)
        assert read_until_closed(sock) == b""  # closed by the keep-alive deadline (1 s), not held


# --- the cap -------------------------------------------------------------------------------------------


def test_the_cap_is_half_the_open_file_limit_unless_set_and_a_cap_too_close_to_it_refuses_to_start() -> None:
    assert connection_limits(Settings(), nofile=1024).max_connections == 512
    assert connection_limits(Settings(max_connections=700), nofile=1024).max_connections == 700
    with pytest.raises(ConfigError, match=r"METAAGENT_MAX_CONNECTIONS=900 .* open-file limit of 1024 \(at most 768"):
        connection_limits(Settings(max_connections=900), nofile=1024)


def test_serve_refuses_a_connection_cap_too_close_to_the_open_file_limit(tmp_path: Path) -> None:
    with (
        pytest.raises(AssertionError, match="at most 768"),
        service_process(tmp_path, open_files=1024, METAAGENT_MAX_CONNECTIONS="900"),
    ):
        pass  # pragma: no cover -- it must not start


@pytest.mark.security
def test_at_the_cap_a_new_connection_takes_the_place_of_the_oldest_one_without_a_request(tmp_path: Path) -> None:
    with service_process(tmp_path, METAAGENT_MAX_CONNECTIONS="3") as service:
        idle = [socket.create_connection(("127.0.0.1", service.port), timeout=30) for _ in range(3)]
        time.sleep(0.5)  # accepted, in order
        try:
            assert httpx2.get(f"{service.base}/health", timeout=30).status_code == 200
            assert read_until_closed(idle[0]) == b""  # the oldest made room
            assert "closed 1 connection(s) with no request in flight" in wait_for_log(service, "connection cap")
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.security
def test_at_the_cap_with_a_request_in_flight_on_every_connection_a_new_one_is_refused_with_a_503(
    tmp_path: Path,
) -> None:
    with service_process(tmp_path, METAAGENT_MAX_CONNECTIONS="3") as service:
        busy = [socket.create_connection(("127.0.0.1", service.port), timeout=30) for _ in range(3)]
        try:
            head, half = HALF_BODY.split(b"\r\n\r\n", 1)
            for sock in busy:
                # `100 Continue` comes once the route asks for the body: the request is in flight.
                sock.sendall(head + b"\r\nExpect: 100-continue\r\n\r\n")
                assert read_until(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 100 ")
                sock.sendall(half)
            refused = httpx2.get(f"{service.base}/health", timeout=30)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert "METAAGENT_MAX_CONNECTIONS" in refused.json()["error"]
            assert "refused 1 new connection(s) with 503" in wait_for_log(service, "connection cap")
            busy.pop(0).close()  # one holder lets go: there is room again
            deadline = time.monotonic() + CLOSE_WAIT_S
            while httpx2.get(f"{service.base}/health", timeout=30).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            for sock in busy:
                sock.close()


@pytest.mark.security
def test_a_thousand_stalled_connections_under_a_1024_descriptor_limit_hold_few_descriptors_and_a_keyed_client_is_served(
    tmp_path: Path, enough_open_files: None
) -> None:
    with service_process(
        tmp_path,
        open_files=1024,
        METAAGENT_API_KEYS=f"alice:{KEY}",
        # Long deadlines: what keeps the service up here is the cap, not a deadline that ran out.
        METAAGENT_CLIENT_HEADER_TIMEOUT_S="300",
        METAAGENT_CLIENT_BODY_TIMEOUT_S="600",
        METAAGENT_KEEP_ALIVE_TIMEOUT_S="300",
    ) as service:
        answers: list[int | str] = []
        stop = threading.Event()

        def keyed_client() -> None:  # one kept-alive connection, asking all along
            with httpx2.Client(base_url=service.base, headers=AUTH, timeout=30) as client:
                while not stop.is_set():
                    try:
                        answers.append(client.get("/tools").status_code)
                    except httpx2.TransportError as exc:
                        answers.append(repr(exc))

        thread = threading.Thread(target=keyed_client)
        thread.start()
        stalled: list[socket.socket] = []
        most_fds = 0
        try:
            kinds = list(STALLED.values())
            for batch in range(10):
                for i in range(100):
                    sock = socket.create_connection(("127.0.0.1", service.port), timeout=30)
                    stalled.append(sock)
                    with contextlib.suppress(OSError):  # already closed to make room: the cap at work
                        sock.sendall(kinds[(batch * 100 + i) % len(kinds)])
                    if i % 10 == 9:
                        time.sleep(0.01)  # a flood, not a burst inside one idle gap of the kept-alive client
                # A new keyed client, on a fresh connection, between every hundred.
                fresh = httpx2.get(f"{service.base}/tools", headers=AUTH, timeout=30)
                assert fresh.status_code == 200, (batch, fresh.text)
                most_fds = max(most_fds, open_fds(service.process.pid))
            for _ in range(20):
                assert httpx2.get(f"{service.base}/tools", headers=AUTH, timeout=30).status_code == 200
        finally:
            stop.set()
            thread.join(60)
            for sock in stalled:
                sock.close()
        assert answers, "the kept-alive client was never answered"
        assert set(answers) == {200}, [a for a in answers if a != 200][:5]
        assert most_fds < 1024 * 3 // 4
        assert service.process.poll() is None
        log = service.stderr()
        assert "Too many open files" not in log
        assert not [line for line in log.splitlines() if line.startswith("error")], log
        assert "at most 512 connections open (open-file limit 1024)" in log
        assert "connection cap (512" in log


def test_the_service_runs_on_uvloops_event_loop(quick_deadlines: ServiceProcess) -> None:
    """`serve` names uvloop (README, "uvloop, measured again"): its extension is loaded in the process."""
    maps = Path(f"/proc/{quick_deadlines.process.pid}/maps").read_text()
    assert "/uvloop/loop.cpython" in maps


@pytest.mark.security
def test_a_forwarded_for_header_does_not_change_the_client_the_log_names(quick_deadlines: ServiceProcess) -> None:
    """The access line names the connection's peer: a local client cannot write another address into it."""
    forged = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        peer_port = sock.getsockname()[1]
        headers = "".join(f"{name}: {value}\r\n" for name, value in forged.items())
        sock.sendall(f"GET /forged-peer HTTP/1.1\r\n{HEAD}{headers}Connection: close\r\n\r\n".encode())
        read_until_closed(sock)
    logged = wait_for_log(quick_deadlines, "/forged-peer")
    line = next(line for line in logged.splitlines() if "/forged-peer" in line)
    assert f"127.0.0.1:{peer_port} - " in line, line
    assert "203.0.113.9" not in line, line


# --- what the parser refuses ---------------------------------------------------------------------------


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The answers in what a connection received, in order (each one sized by its content-length)."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status, headers, _ = response_parts(head + b"\r\n\r\n")
        length = int(headers["content-length"])
        found.append((status, headers, rest[:length]))
        raw = rest[length:]
    return found


def exchange(service: ServiceProcess, *pieces: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Sends the pieces on one connection, one after another, and returns every answer until it closes."""
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except OSError:
                break  # closed under the sender: the answers say why
        return answers(read_until_closed(sock))


@pytest.mark.security
@pytest.mark.parametrize("delivery", ["in one piece", "a kilobyte at a time", "as many small headers"])
def test_a_request_head_past_16_kib_gets_a_json_431_however_it_arrives(
    quick_deadlines: ServiceProcess, delivery: str
) -> None:
    head = f"GET /health HTTP/1.1\r\n{HEAD}X-Large: {'a' * 20_000}\r\n\r\n".encode()
    # A kilobyte at a time, the head is never finished: it is cut off once too large, not when (if ever) it ends.
    dripped = [head[i : i + 1024] for i in range(0, 18 * 1024, 1024)]
    small_ones = (f"GET /health HTTP/1.1\r\n{HEAD}" + "a:\r\n" * 5000 + "\r\n").encode()  # 5,000 empty headers
    pieces = {"in one piece": [head], "a kilobyte at a time": dripped, "as many small headers": [small_ones]}[delivery]
    ((status, headers, body),) = exchange(quick_deadlines, *pieces)
    assert status == 431
    assert headers["content-type"] == "application/json"
    assert "at most 16384 bytes" in json.loads(body)["error"]
    # Just under the limit is served.
    ok = f"GET /health HTTP/1.1\r\n{HEAD}X-Large: {'a' * 15_000}\r\nConnection: close\r\n\r\n".encode()
    assert [status for status, _, _ in exchange(quick_deadlines, ok)] == [200]


@pytest.mark.security
@pytest.mark.parametrize(
    ("request_bytes", "fault"),
    [
        (f"GET /health HTTP/1.1\r\n{HEAD}No colon here\r\n\r\n".encode(), "Invalid header token"),
        (
            # Both lengths: the classic request-smuggling ambiguity.
            f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Content-Length: 4\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode(),
            "Transfer-Encoding can't be present with Content-Length",
        ),
        (
            f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Transfer-Encoding: chunked\r\n\r\n"
            '5\r\n{"cod\r\nZZ\r\n'.encode(),
            "Invalid character in chunk size",
        ),
        (b"GET /h\xffalth HTTP/1.1\r\n" + HEAD.encode() + b"\r\n", "Invalid char in url path"),
    ],
    ids=["header without a colon", "content-length and chunked", "bad chunk size", "byte 0xff in the path"],
)
def test_an_unreadable_request_gets_a_json_400_that_names_the_fault_and_the_connection_closes(
    quick_deadlines: ServiceProcess, request_bytes: bytes, fault: str
) -> None:
    ((status, headers, body),) = exchange(quick_deadlines, request_bytes)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert fault in json.loads(body)["error"]


@pytest.mark.security
def test_an_upgrade_request_is_served_as_an_ordinary_one_without_a_body_and_refused_with_one(
    quick_deadlines: ServiceProcess,
) -> None:
    h2c = (  # what `curl --http2 http://...` sends
        f"GET /health HTTP/1.1\r\n{HEAD}Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
    )
    after = f"GET /health HTTP/1.1\r\n{HEAD}Connection: close\r\n\r\n"
    served = exchange(quick_deadlines, (h2c + after).encode())
    assert [status for status, _, _ in served] == [200, 200]  # and the request after it was read as one
    with_body = (
        f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Connection: Upgrade\r\nUpgrade: websocket\r\n"
        'Content-Type: application/json\r\nContent-Length: 12\r\n\r\n{"code":"1"}'
    )
    connect = f"CONNECT 127.0.0.1:22 HTTP/1.1\r\n{HEAD}\r\n"
    for refused in (with_body, connect):
        ((status, _, body),) = exchange(quick_deadlines, refused.encode())
        assert status == 400
        assert "Connection upgrades are not served" in json.loads(body)["error"]


@pytest.mark.security
def test_bad_bytes_pipelined_behind_good_requests_are_refused_after_their_answers(
    quick_deadlines: ServiceProcess,
) -> None:
    good = f"GET /health HTTP/1.1\r\n{HEAD}\r\n"
    served = exchange(quick_deadlines, (good + good + "GARBAGE\r\n\r\n").encode())
    assert [status for status, _, _ in served] == [200, 200, 400]  # whole, and no error answer inside them
    assert served[-1][1]["connection"] == "close"
    assert "Invalid HTTP request" in json.loads(served[-1][2])["error"]


@pytest.mark.security
def test_a_queued_request_with_a_bad_body_is_refused_at_its_turn_and_never_run(
    quick_deadlines: ServiceProcess,
) -> None:
    """Its head was read and queued behind others when its body turned out bad: the requests before it are
    answered, then its 400, which names the fault (not a body deadline that blames the client)."""
    good = f"GET /health HTTP/1.1\r\n{HEAD}\r\n"
    bad = (
        f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Content-Type: application/json\r\n"
        'Transfer-Encoding: chunked\r\n\r\n5\r\n{"cod\r\nZZ\r\n'
    )
    before = quick_deadlines.stderr()
    served = exchange(quick_deadlines, (good * 3 + bad).encode())
    assert [status for status, _, _ in served] == [200, 200, 200, 400]
    assert served[-1][1]["connection"] == "close"
    assert "Invalid character in chunk size" in json.loads(served[-1][2])["error"]
    assert "POST /tools/code-interpreter" not in quick_deadlines.stderr()[len(before) :]  # never run


@pytest.mark.security
def test_a_client_that_half_closes_and_takes_nothing_loses_its_connection_within_the_grace(
    quick_deadlines: ServiceProcess,
) -> None:
    """A half-close is a hang-up; closed through the wrapper, the connection is aborted once the grace is
    over, however much of its answers the client leaves unread (the transport's own close kept it)."""
    with small_window_connection(quick_deadlines.port) as sock:
        answered = fill_the_kernels_queue(quick_deadlines, sock)
        sock.sendall(f"GET /openapi.json HTTP/1.1\r\n{HEAD}\r\n".encode())  # its answer stays in the service
        deadline = time.monotonic() + CLOSE_WAIT_S
        while quick_deadlines.stderr().count(answered[0]) <= answered[1]:
            assert time.monotonic() < deadline, quick_deadlines.stderr()
            time.sleep(0.05)
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while holds_connection(quick_deadlines.process.pid, sock.getsockname()[1]):
            assert time.monotonic() < deadline, "the service still holds the half-closed connection"
            time.sleep(0.05)


@pytest.mark.security
def test_a_head_begun_in_the_read_that_ended_the_request_before_it_gets_its_408(
    quick_deadlines: ServiceProcess,
) -> None:
    """The next head's first bytes came in the same read as the request before it: its clock starts at
    that request's answer and its deadline is the head's (a 408), not the idle connection's silent close."""
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\n{HEAD}\r\nGET /health HTTP/1.1\r\nX-Partial: ".encode())
        served = answers(read_until_closed(sock))
    assert [status for status, _, _ in served] == [200, 408]


@pytest.mark.security
def test_a_head_begun_behind_a_request_being_answered_counts_whole_against_the_head_limit(
    quick_deadlines: ServiceProcess,
) -> None:
    """The next request's head began while the one before it was answered: its bytes are not forgotten at
    that answer, so the head limit holds across it (a 431, not a head that grows with each answer)."""
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        sock.sendall(
            f"GET /health HTTP/1.1\r\n{HEAD}\r\nGET /health HTTP/1.1\r\n{HEAD}X-Large: ".encode() + b"a" * 10_000
        )
        first = read_until(sock, b"\r\n\r\n")  # the first answer is out
        with contextlib.suppress(OSError):  # closed under the sender: the answer says why
            sock.sendall(b"a" * 12_000)  # (a head is counted to within one 4 KiB slice: well past the limit)
        served = answers(first + read_until_closed(sock))
    assert [status for status, _, _ in served] == [200, 431]


@pytest.mark.security
def test_a_flood_of_pipelined_requests_is_read_only_sixteen_deep_and_the_connection_closes_after_their_answers(
    quick_deadlines: ServiceProcess,
) -> None:
    """The parser reads a whole read's worth of requests at once: each one queued would be a scope and a
    cycle, many times its bytes, so no more than 16 wait behind the one being answered."""
    served = exchange(quick_deadlines, f"GET /health HTTP/1.1\r\n{HEAD}\r\n".encode() * 300)
    assert [status for status, _, _ in served] == [200] * (1 + 16) + [429]
    assert served[-1][1]["connection"] == "close"
    assert "Too many pipelined requests: at most 16" in json.loads(served[-1][2])["error"]


@pytest.mark.security
def test_chunk_framing_and_trailers_are_refused_once_past_16_kib(quick_deadlines: ServiceProcess) -> None:
    """The parser holds a trailer until its line ends and would take trailers without end: they, chunk sizes
    and extensions are bounded like a head."""
    head = (
        f"POST /tools/code-interpreter HTTP/1.1\r\n{HEAD}Content-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    # In one send with the head, so most likely in one read with it: counted all the same.
    trailers = b"2\r\n{}\r\n0\r\n" + b"X-Trailer: 1\r\n" * 2000  # 28 KB of trailers, never ended
    with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
        with contextlib.suppress(OSError):  # closed under the sender: the answer says why
            sock.sendall(head.encode() + trailers)
        (status, headers, body), *_ = answers(read_until_closed(sock))
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert "Request body framing too large: at most 16384 bytes" in json.loads(body)["error"]


@pytest.mark.security
def test_an_absolute_url_as_the_request_target_is_refused_not_routed_past_the_host_check(
    quick_deadlines: ServiceProcess,
) -> None:
    """With an absolute URL, its authority names the server, not the Host header the host check reads."""
    raw = f"GET http://attacker.example/health HTTP/1.1\r\n{HEAD}\r\n".encode()
    ((status, _, body),) = exchange(quick_deadlines, raw)
    assert status == 400
    assert "must be a path" in json.loads(body)["error"]


@pytest.mark.security
def test_a_client_that_stops_taking_its_answers_is_cut_off_after_the_body_deadline(
    quick_deadlines: ServiceProcess,
) -> None:
    """It would hold its connection (and a place under the cap) for as long as it liked: the service
    writes, the client does not read, and nothing else would end it."""
    with small_window_connection(quick_deadlines.port) as sock:
        peer = f"127.0.0.1:{sock.getsockname()[1]}"
        line = f"closed the connection from {peer}: the client took no answer bytes for 2 s"
        answered = f'{peer} - "GET /openapi.json HTTP/1.1" 200'
        # 54 KB answers, 16 at a time, until the kernel's buffers fill and then the service's
        for batch in range(1, 21):
            sock.sendall(f"GET /openapi.json HTTP/1.1\r\n{HEAD}\r\n".encode() * 16)
            deadline = time.monotonic() + CLOSE_WAIT_S
            while quick_deadlines.stderr().count(answered) < 16 * batch and line not in quick_deadlines.stderr():
                assert time.monotonic() < deadline, quick_deadlines.stderr()
                time.sleep(0.05)
            if line in quick_deadlines.stderr():
                break
        wait_for_log(quick_deadlines, line)
        # The service's descriptor is gone (the kernel may still send what it holds, not the service).
        deadline = time.monotonic() + CLOSE_WAIT_S
        while holds_connection(quick_deadlines.process.pid, sock.getsockname()[1]):
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.security
def test_a_client_that_hangs_up_on_pipelined_requests_is_a_hang_up_not_a_traceback(
    quick_deadlines: ServiceProcess,
) -> None:
    """The route running is told, not only the newest request behind it."""
    before = quick_deadlines.stderr()
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", quick_deadlines.port), timeout=30) as sock:
            sock.sendall(f"GET /openapi.json HTTP/1.1\r\n{HEAD}\r\n".encode() * 3)
            time.sleep(0.005)
    time.sleep(1)
    after = quick_deadlines.stderr()[len(before) :]
    assert "Traceback" not in after, after
    assert "Exception in ASGI application" not in after, after


def send_queue(server_port: int, client_port: int) -> int:
    """Bytes the service's end of the connection from `client_port` has queued and not had acknowledged."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
        if (local, remote) == (server_port, client_port):
            return int(fields[4].split(":")[0], 16)
    return 0


@pytest.mark.security
def test_a_connection_closed_after_its_last_answer_does_not_keep_its_descriptor_while_the_client_reads_nothing(
    quick_deadlines: ServiceProcess,
) -> None:
    """uvicorn closes a connection itself after answering `Connection: close` (and at its keep-alive
    timer): the close waited for a client that never reads, descriptor held, for ever."""
    with small_window_connection(quick_deadlines.port) as sock:
        fill_the_kernels_queue(quick_deadlines, sock)
        sock.sendall(f"GET /health HTTP/1.1\r\n{HEAD}Connection: close\r\n\r\n".encode())
        deadline = time.monotonic() + CLOSE_WAIT_S
        while holds_connection(quick_deadlines.process.pid, sock.getsockname()[1]):
            assert time.monotonic() < deadline, "the service still holds the connection"
            time.sleep(0.05)


def fill_the_kernels_queue(service: ServiceProcess, sock: socket.socket) -> tuple[str, int]:
    """Asks for 54 KB answers one at a time and reads none, until the kernel's queue for the client is
    full: what the service writes to it next stays in the service. Returns the answers' log line and count."""
    client_port = sock.getsockname()[1]
    answered = f'127.0.0.1:{client_port} - "GET /openapi.json HTTP/1.1" 200'
    queued = -1
    for sent in range(1, 400):
        sock.sendall(f"GET /openapi.json HTTP/1.1\r\n{HEAD}\r\n".encode())
        deadline = time.monotonic() + CLOSE_WAIT_S
        while service.stderr().count(answered) < sent:
            assert time.monotonic() < deadline, service.stderr()
            time.sleep(0.05)
        now_queued = send_queue(service.port, client_port)
        if now_queued - queued < 40_000:
            return answered, sent
        queued = now_queued
    raise AssertionError("the kernel's queue never filled")
