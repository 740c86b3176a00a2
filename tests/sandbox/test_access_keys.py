"""API keys end to end: the key's id (never the key) is the caller in audit records, and each key has
its own limit of executions running or queued."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx2
import pytest

from tests.sandbox.conftest import RUNTIME_UNDER_TEST
from tests.test_access import ALICE, BOB, BOB_ID, KEYS
from tests.test_cli import serving

pytestmark = [pytest.mark.docker, pytest.mark.security]

RUN = "/tools/code-interpreter"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_key_ids_are_audited_and_each_key_has_its_own_execution_limit(tmp_path: Path) -> None:
    long_run = {"code": "console.log('up'); setInterval(() => {}, 1000)", "timeout_s": 60}
    answers: list[httpx2.Response] = []
    with serving(tmp_path, METAAGENT_API_KEYS=KEYS, METAAGENT_MAX_EXECUTIONS_PER_KEY="1") as (base, process):
        first = threading.Thread(
            target=lambda: answers.append(httpx2.post(f"{base}{RUN}", json=long_run, headers=bearer(ALICE), timeout=90))
        )
        first.start()
        try:
            deadline = time.monotonic() + 60
            while True:
                listed = httpx2.get(f"{base}/executions", headers=bearer(ALICE), timeout=30).json()["executions"]
                if any(e["state"] == "running" for e in listed):
                    break
                assert time.monotonic() < deadline, "the first execution did not start"
                time.sleep(0.1)
            assert [e["caller"] for e in listed] == ["alice"]

            refused = httpx2.post(f"{base}{RUN}", json={"code": "1"}, headers=bearer(ALICE), timeout=30)
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) > 0
            assert refused.json()["error"].startswith("Key alice already has 1 executions running or queued")

            other = httpx2.post(f"{base}{RUN}", json={"code": "console.log(2)"}, headers=bearer(BOB), timeout=60)
            assert other.status_code == 200, other.text
            assert other.json()["stdout"] == "2\n"
        finally:
            for execution in httpx2.get(f"{base}/executions", headers=bearer(ALICE), timeout=30).json()["executions"]:
                httpx2.delete(f"{base}/executions/{execution['execution_id']}", headers=bearer(ALICE), timeout=30)
            first.join(timeout=90)
        assert answers[0].status_code == 200
        assert answers[0].json()["killed"] is True
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)

    audit_text = (tmp_path / "audit.jsonl").read_text()
    callers = [json.loads(line)["caller"] for line in audit_text.splitlines() if "execution.finished" in line]
    assert sorted(callers) == sorted(["alice", BOB_ID])
    for secret in (ALICE, BOB):
        assert secret not in audit_text
        assert secret not in stderr


def test_a_streamed_execution_needs_a_key_runs_under_it_and_counts_against_its_limit(tmp_path: Path) -> None:
    sse = {"Accept": "text/event-stream"}
    alice = {**sse, **bearer(ALICE)}
    long_run = {"code": "console.log('up'); setInterval(() => {}, 1000)", "timeout_s": 60}
    with serving(tmp_path, METAAGENT_API_KEYS=KEYS, METAAGENT_MAX_EXECUTIONS_PER_KEY="1") as (base, _process):
        anonymous = httpx2.post(f"{base}{RUN}", json={"code": "1"}, headers=sse, timeout=30)
        with httpx2.stream("POST", f"{base}{RUN}", json=long_run, headers=alice, timeout=90) as stream:
            events = iter(httpx2.EventSource(stream))  # kept: a dropped iterator closes the stream
            first = next(events)
            listed = httpx2.get(f"{base}/executions", headers=bearer(ALICE), timeout=30).json()["executions"]
            refused = httpx2.post(f"{base}{RUN}", json={"code": "1"}, headers=alice, timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.headers["content-type"] == "application/json"
    assert (first.event, first.json()) == ("stdout", {"text": "up\n"})
    assert [e["caller"] for e in listed] == ["alice"]
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/json"
    assert refused.json()["error"].startswith("Key alice already has 1 executions running or queued")


def test_a_session_call_through_code_interpreter_is_a_session_call_for_every_limit(tmp_path: Path) -> None:
    """The finding: with session_id, code_interpreter counted against the key's execution limit (429)
    while the same call through POST /sessions/{id}/execute ran."""
    long_run = {"code": "console.log('up'); setInterval(() => {}, 1000)", "timeout_s": 60}
    answers: list[httpx2.Response] = []
    env = {"METAAGENT_API_KEYS": KEYS, "METAAGENT_MAX_EXECUTIONS_PER_KEY": "1", "METAAGENT_POOL_ENABLED": "false"}
    if RUNTIME_UNDER_TEST:
        env["METAAGENT_SANDBOX_RUNTIME"] = RUNTIME_UNDER_TEST
    with serving(tmp_path, **env) as (base, _process):
        created = httpx2.post(f"{base}/sessions", json={"memory_mb": 128}, headers=bearer(ALICE), timeout=180)
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        first = threading.Thread(
            target=lambda: answers.append(httpx2.post(f"{base}{RUN}", json=long_run, headers=bearer(ALICE), timeout=90))
        )
        first.start()
        try:
            deadline = time.monotonic() + 60
            while not any(
                e["state"] == "running"
                for e in httpx2.get(f"{base}/executions", headers=bearer(ALICE), timeout=30).json()["executions"]
            ):
                assert time.monotonic() < deadline, "the one-shot execution did not start"
                time.sleep(0.1)
            one_shot = httpx2.post(f"{base}{RUN}", json={"code": "1"}, headers=bearer(ALICE), timeout=30)
            call = {"code": "21 * 2", "session_id": session_id}
            through_tool = httpx2.post(f"{base}{RUN}", json=call, headers=bearer(ALICE), timeout=60)
            through_session = httpx2.post(
                f"{base}/sessions/{session_id}/execute", json={"code": "21 * 2"}, headers=bearer(ALICE), timeout=60
            )
        finally:
            for execution in httpx2.get(f"{base}/executions", headers=bearer(ALICE), timeout=30).json()["executions"]:
                httpx2.delete(f"{base}/executions/{execution['execution_id']}", headers=bearer(ALICE), timeout=30)
            first.join(timeout=90)
            httpx2.delete(f"{base}/sessions/{session_id}", headers=bearer(ALICE), timeout=60)
    assert one_shot.status_code == 429  # the one-shot quota is full
    for answer in (through_tool, through_session):
        assert answer.status_code == 200, answer.text
        assert answer.json()["result"] == "42"
        assert answer.json()["session_id"] == session_id
