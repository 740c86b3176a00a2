"""A session call's `error` from what a subverted container sends: checked, capped, never a 500 and never
unbounded (issue 23, item 6)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from metaagent.executions import Execution
from metaagent.sandbox import session_wire as wire
from metaagent.sandbox.output import CappedBuffer
from metaagent.sandbox.session_container import CallOutcome, SessionContainer
from metaagent.sessions.call_errors import ERROR_FIELD_CAP, call_error, thrown_error
from metaagent.sessions.models import SessionExecuteResponse
from metaagent.sessions.service import _response
from tests.test_session_container_hostile import FakeEngine, frame, hostile_writer, run_against

pytestmark = [pytest.mark.security]


GENERIC = "The call threw an error that the session could not describe; stderr shows what it printed"


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "TypeError",
        ["TypeError", "m", None],
        {"name": "TypeError", "message": "m"},
        {"name": "TypeError", "message": "m", "stack": None, "extra": 1},
        {"name": {"nested": True}, "message": "m", "stack": None},
        {"name": "TypeError", "message": 5, "stack": None},
        {"name": "TypeError", "message": "m", "stack": ["frame"]},
    ],
)
def test_a_malformed_thrown_error_becomes_a_generic_one(raw: Any) -> None:
    error = thrown_error(raw)
    assert (error.name, error.message, error.stack) == ("Error", GENERIC, None)


def test_a_well_formed_thrown_error_is_believed_and_each_field_capped_at_4_kib() -> None:
    assert thrown_error({"name": "TypeError", "message": "m", "stack": "TypeError: m"}).name == "TypeError"
    huge = thrown_error({"name": "\U0001f600" * 100_000, "message": "é" * 100_000, "stack": "s" * 100_000})
    for field in (huge.name, huge.message, huge.stack or ""):
        assert 0 < len(field.encode()) <= ERROR_FIELD_CAP
    assert huge.name == "\U0001f600" * (ERROR_FIELD_CAP // 4)
    assert thrown_error({"name": "", "message": "", "stack": None}).name == "Error"


def outcome(status: str, **fields: Any) -> CallOutcome:
    return CallOutcome(status, CappedBuffer(100, "stdout"), CappedBuffer(100, "stderr"), 1, **fields)


@pytest.mark.parametrize(
    ("given", "name"),
    [
        (outcome("interrupted", timed_out=True), "Timeout"),
        (outcome("interrupted", killed=True), "Killed"),
        (outcome("interrupted"), "Killed"),
        (outcome("ended", ended="timeout", timed_out=True), "Timeout"),
        (outcome("ended", ended="killed", killed=True), "Killed"),
        (outcome("ended", ended="closed"), "Killed"),
        (outcome("ended", ended="oom", exit_code=137, oom_killed=True), "OutOfMemory"),
        (outcome("ended", ended="exited", exit_code=3), "Exited"),
    ],
)
def test_a_call_that_did_not_complete_says_why_from_what_the_service_saw(given: CallOutcome, name: str) -> None:
    answer = _response("ses_1", "exe_1", given, 0, timeout_s=2, memory_mb=64)
    assert answer.error is not None
    assert answer.error.name == name
    assert answer.error.stack is None
    SessionExecuteResponse.model_validate(answer.model_dump(mode="json"))  # the schema MCP derives holds


def test_the_messages_name_what_to_act_on() -> None:
    timeout = call_error(outcome("interrupted", timed_out=True), timed_out=True, killed=False, timeout_s=2, memory_mb=1)
    assert timeout is not None
    assert "timeout_s=2" in timeout.message
    assert "keeps its state" in timeout.message
    exited = call_error(
        outcome("ended", ended="exited", exit_code=3), timed_out=False, killed=False, timeout_s=2, memory_mb=1
    )
    assert exited is not None
    assert "code 3" in exited.message
    assert call_error(outcome("ok"), timed_out=False, killed=False, timeout_s=2, memory_mb=1) is None


async def test_a_forged_error_from_a_subverted_supervisor_is_refused_and_a_huge_one_capped(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    service_end, container_end = pair
    engine = FakeEngine()
    forged = [
        b'{"id": 2, "status": "threw", "error": {"name": [1], "message": {}, "stack": 5, "more": "x"}}',
        b'{"id": 3, "status": "threw", "error": {"name": "' + b"N" * 500_000 + b'", "message": "m", "stack": null}}',
        b'{"id": 4, "status": "ok", "result": "1", "result_bytes": 1, "error": {"name": "Forged"}}',
    ]

    def chunks() -> Iterator[bytes]:
        for reply in forged:
            request = b""
            while wire.EXECUTE not in request:
                request += container_end.recv(65536)
            yield frame(wire.REPLY, reply)

    writer = hostile_writer(container_end, chunks)
    answers: list[SessionExecuteResponse] = []

    async def calls(container: SessionContainer) -> None:
        for n in range(len(forged)):
            got = await container.call("1", 5, Execution(f"exe_{n}", 5, 256))
            answers.append(_response("ses_1", f"exe_{n}", got, 0, timeout_s=5, memory_mb=256))
        engine.killed.set()

    await run_against(service_end, engine, during=calls)
    writer.join(timeout=10)
    assert answers[0].error is not None
    assert (answers[0].error.name, answers[0].error.message) == ("Error", GENERIC)
    assert answers[1].error is not None
    assert answers[1].error.name == "N" * ERROR_FIELD_CAP
    assert (answers[2].error, answers[2].result) == (None, "1")  # an error on a completed call means nothing


def test_a_result_the_runner_says_is_incomplete_is_marked_truncated_though_it_fits() -> None:
    answer = _response("ses_1", "exe_1", outcome("ok", result="[x]", result_bytes=3, result_incomplete=True), 0,
                       timeout_s=2, memory_mb=64)  # fmt: skip
    assert (answer.result, answer.result_truncated) == ("[x]", True)
