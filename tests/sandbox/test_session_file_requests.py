"""The HTTP side of sessions against a real service and engine: a file path as written is decoded once,
and a client that hangs up mid-upload or before its answer is one info line in the service log."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.sandbox.conftest import Service

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
