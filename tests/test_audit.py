"""The audit log never loses a record silently: what JSON cannot carry is escaped, and a record that cannot
be written fails its request with a 500 that says so, logged.

The finding: a lone surrogate in a refused request made `AuditLog.append` raise UnicodeEncodeError after
the `[SECURITY]` line was written, so the refusal had no audit record.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import pytest

from metaagent.audit import AuditLog, verify
from metaagent.errors import AuditWriteFailed
from tests.service_process import service_process

pytestmark = pytest.mark.security


def test_a_lone_surrogate_is_written_as_its_json_escape_and_reads_back_the_same(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl")
    audit.append("egress.blocked", tool="http", host="evil\udfff.com", url="http://\ud800/", where=tmp_path)
    audit.append("egress.blocked", tool="http", host="a\\udfff")  # a real backslash stays distinct
    raw = (tmp_path / "audit.jsonl").read_bytes()
    raw.decode("utf-8")  # every line is valid UTF-8
    first, second = (json.loads(line) for line in raw.splitlines())
    assert first["host"] == "evil\udfff.com"
    assert first["url"] == "http://\ud800/"
    assert first["where"] == str(tmp_path)  # a value JSON has no type for is written as its text
    assert second["host"] == "a\\udfff"
    assert verify(tmp_path / "audit.jsonl").ok


def test_the_log_folder_is_made_when_needed_and_again_once_removed_with_the_chain_kept(tmp_path: Path) -> None:
    folder = tmp_path / "state" / "metaagent"
    audit = AuditLog(folder / "audit.jsonl")
    audit.append("session.created", session_id="ses_1")
    (folder / "audit.jsonl").unlink()
    folder.rmdir()
    record = audit.append("session.ended", session_id="ses_1")
    assert record["seq"] == 2  # the chain goes on from the record before, in the new file
    assert json.loads((folder / "audit.jsonl").read_text())["hash"] == record["hash"]


def test_a_record_that_cannot_be_written_raises_and_leaves_the_chain_whole(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path)
    path.mkdir()  # no longer a file it can write: every write fails
    with pytest.raises(AuditWriteFailed, match=r"could not be written .* make the audit log writable"):
        audit.append("egress.blocked", tool="http", host="evil.com")
    path.rmdir()  # the operator fixes it: the next record is the first, and the chain verifies
    assert audit.append("egress.blocked", tool="http", host="evil.com")["seq"] == 1
    assert verify(path).ok


def test_a_request_whose_audit_record_cannot_be_written_is_a_500_that_says_so_and_is_logged(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    with service_process(tmp_path, METAAGENT_AUDIT_LOG=str(audit)) as service:
        audit.unlink(missing_ok=True)
        audit.mkdir()  # the audit log is no longer a file the service can write
        response = httpx2.post(f"{service.base}/tools/http", json={"url": "https://evil.com/"}, timeout=30)
        assert response.status_code == 500
        assert "audit record of this request (egress.blocked) could not be written" in response.json()["error"]
        service.stop()
        stderr = service.stderr()
    assert "[SECURITY] Blocked HTTP request to disallowed host: evil.com (GET https://evil.com/)" in stderr
    (logged,) = [line for line in stderr.splitlines() if "could not be written" in line]
    assert logged.startswith("error: ")
