"""The HTTP side of sessions against a real service and engine: a file path as written is decoded once, a
client that hangs up mid-upload or before its answer is one info line in the service log, and the body
deadline does not run while the service itself holds an upload back."""

from __future__ import annotations

import concurrent.futures
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx2
import pytest

from tests.sandbox.conftest import Service, running_service

pytestmark = [pytest.mark.docker]

LOG_WAIT_S = 60


@pytest.fixture
def session_id(sandbox_service: Service) -> Iterator[str]:
    created = httpx2.post(f"{sandbox_service.base_url}/sessions", timeout=120)
    assert created.status_code == 201, created.text
    sid: str = created.json()["session_id"]
    yield sid
    httpx2.delete(f"{sandbox_service.base_url}/sessions/{sid}", timeout=120)


def log_after(path: Path, offset: int) -> str:
    return path.read_bytes()[offset:].decode("utf-8", "surrogateescape")


def wait_for_line(path: Path, offset: int, needle: str) -> str:
    """The log written since `offset`, once a line holding `needle` is in it (and a moment more, for any
    line the same event writes after it)."""
    deadline = time.monotonic() + LOG_WAIT_S
    while needle not in log_after(path, offset):
        assert time.monotonic() < deadline, f"no {needle!r} line: {log_after(path, offset)}"
        time.sleep(0.1)
    time.sleep(1)
    return log_after(path, offset)


def test_a_file_path_under_a_percent_encoded_session_id_is_decoded_once(
    sandbox_service: Service, session_id: str
) -> None:
    base = sandbox_service.base_url
    encoded_id = session_id.replace("_", "%5F")
    written = httpx2.put(f"{base}/sessions/{encoded_id}/files/%2541", content=b"once", timeout=60)
    assert written.status_code == 201, written.text
    assert written.json()["path"] == "%41"
    listed = httpx2.get(f"{base}/sessions/{encoded_id}/files", timeout=60).json()["files"]
    assert [f["path"] for f in listed] == ["%41"]
    assert httpx2.get(f"{base}/sessions/{encoded_id}/files/%2541", timeout=60).content == b"once"
    assert httpx2.get(f"{base}/sessions/{session_id}/files/A", timeout=60).status_code == 404
    # The prefix itself may be written percent-encoded too: the path after it is still decoded once.
    assert httpx2.get(f"{base}/%73essions/{session_id}/%66iles/%2541", timeout=60).content == b"once"
    deleted = httpx2.delete(f"{base}/sessions/{encoded_id}/files/%2541", timeout=60)
    assert deleted.json() == {"path": "%41", "deleted": True}


def test_a_client_that_hangs_up_during_a_file_upload_is_one_info_line_without_a_traceback(
    sandbox_service: Service, session_id: str
) -> None:
    offset = sandbox_service.stderr_path.stat().st_size
    port = int(sandbox_service.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            f"PUT /sessions/{session_id}/files/upload.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Length: 1000000\r\n\r\n"
        )
        sock.sendall(head.encode() + b"y" * 70000)
        time.sleep(1)  # the upload is under way in the session before the client goes
    written = wait_for_line(sandbox_service.stderr_path, offset, "client hung up")
    lines = [line for line in written.splitlines() if "upload.bin" in line or line.startswith(("error", " "))]
    assert len(lines) == 1, written
    assert re.fullmatch(
        r'info: 127\.0\.0\.1:\d+ - "PUT /sessions/ses_\w+/files/upload\.bin HTTP/1\.1" '
        r"client hung up after \d+ of 1000000 request body bytes",
        lines[0],
    ), written
    assert "Traceback" not in written
    # The session took no harm: a later upload of the same path is whole.
    base = sandbox_service.base_url
    assert httpx2.put(f"{base}/sessions/{session_id}/files/upload.bin", content=b"z", timeout=60).status_code == 201
    assert httpx2.get(f"{base}/sessions/{session_id}/files/upload.bin", timeout=60).content == b"z"


def test_a_client_that_hangs_up_before_its_answer_is_one_info_line_without_a_traceback(
    sandbox_service: Service, session_id: str
) -> None:
    offset = sandbox_service.stderr_path.stat().st_size
    port = int(sandbox_service.base_url.rsplit(":", 1)[1])
    body = b'{"code": "await new Promise((r) => setTimeout(r, 20000))", "timeout_s": 30}'
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            f"POST /sessions/{session_id}/execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        time.sleep(2)  # the call is running in the session
    written = wait_for_line(sandbox_service.stderr_path, offset, "client hung up")
    lines = [line for line in written.splitlines() if "/execute" in line or line.startswith(("error", " "))]
    assert len(lines) == 1, written
    assert lines[0].endswith('/execute HTTP/1.1" client hung up before the answer was complete'), written
    # The call was interrupted: the session answers the next one at once.
    base = sandbox_service.base_url
    after = httpx2.post(f"{base}/sessions/{session_id}/execute", json={"code": "6 * 7"}, timeout=60)
    assert after.json()["result"] == "42", after.text


@pytest.fixture(scope="module")
def strict_bodies(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    """A service whose body chunks must come within 1 s of each other."""
    with running_service(
        tmp_path_factory.mktemp("strict-bodies"), METAAGENT_CLIENT_BODY_TIMEOUT_S="1", METAAGENT_POOL_ENABLED="false"
    ) as service:
        yield service


def hold_session(base: str, sid: str, pool: concurrent.futures.ThreadPoolExecutor) -> concurrent.futures.Future[Any]:
    """Starts a call that keeps the session busy for 5 s; returns once it runs."""
    call = {"code": "await new Promise((r) => setTimeout(r, 5000)); 1", "timeout_s": 30}
    running = pool.submit(httpx2.post, f"{base}/sessions/{sid}/execute", json=call, timeout=120)
    deadline = time.monotonic() + LOG_WAIT_S
    while httpx2.get(f"{base}/sessions/{sid}", timeout=30).json()["state"] != "busy":
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.05)
    return running


@pytest.mark.security
def test_the_body_deadline_closes_a_stalled_upload_but_not_one_the_service_holds_back_in_a_busy_session(
    strict_bodies: Service,
) -> None:
    base = strict_bodies.base_url
    port = int(base.rsplit(":", 1)[1])
    sid = httpx2.post(f"{base}/sessions", timeout=120).json()["session_id"]
    put_head = f"PUT /sessions/{sid}/files/held.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    try:
        # A client that stops sending is closed once 1 s passes without a chunk.
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(f"{put_head}Content-Length: 1000\r\n\r\n".encode() + b"x" * 10)
            sock.settimeout(LOG_WAIT_S)
            assert sock.recv(1024) == b""
        data = bytes(range(256)) * (16 * 1024)  # 4 MiB
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The service reads 64 KiB of this one, then holds the rest back until the call ends: that wait
            # is the service's, so the client's 1 s between chunks does not run meanwhile.
            running = hold_session(base, sid, pool)
            started = time.monotonic()
            written = httpx2.put(f"{base}/sessions/{sid}/files/held.bin", content=data, timeout=120)
            waited = time.monotonic() - started
            assert running.result().status_code == 200
            assert written.status_code == 201, written.text
            assert written.json()["size"] == len(data)
            assert waited > 1  # it did wait past the body deadline
            # A client that waits for `100 Continue` is not timed before the service asks for the body.
            running = hold_session(base, sid, pool)
            with socket.create_connection(("127.0.0.1", port), timeout=LOG_WAIT_S) as sock:
                sock.sendall(f"{put_head}Content-Length: 5\r\nExpect: 100-continue\r\n\r\n".encode())
                assert sock.recv(1024).startswith(b"HTTP/1.1 100 ")
                sock.sendall(b"hello")
                assert sock.recv(1024).startswith(b"HTTP/1.1 201 ")
            assert running.result().status_code == 200
        assert httpx2.get(f"{base}/sessions/{sid}/files/held.bin", timeout=120).content == b"hello"
    finally:
        httpx2.delete(f"{base}/sessions/{sid}", timeout=120)
