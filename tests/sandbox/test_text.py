"""Text with lone surrogates from sandboxed code, against the real engine: every face (JSON over HTTP, the
`code_interpreter` tool, Server-Sent Events, MCP, the audit log) and both call paths (one-shot and
session) carry it as well-formed text (each lone surrogate one U+FFFD), and every call has its audit
record in an intact chain (issue 22, finding 4: a result of `new Error('\\ud800')` was a 500, and its
call had no `session.call` record while `metaagent audit verify` said the chain was intact).

One session and a few one-shot runs do every check, to keep the engine's work small.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client

from metaagent.validation import lone_surrogate_at
from tests.sandbox.conftest import Service, audit_records
from tests.test_cli import METAAGENT
from tests.test_mcp import text_of

pytestmark = [pytest.mark.docker, pytest.mark.security]

R = "\ufffd"
# JavaScript source: `\\ud800` is the escape in the code (the request itself is well-formed text).
OUTPUT = (
    "console.log('out \\ud800'); console.error('err \\udc00');"
    " process.stdout.write(Buffer.from([0xed, 0xa0, 0x80, 0x0a]));"  # a surrogate's bytes, which are not UTF-8
)
SESSION_CALLS = {
    "error_value": f"{OUTPUT} new Error('value \\ud800')",
    "custom_inspect": "({ [require('util').inspect.custom]: () => 'custom \\udfff' })",
    "thrown": "throw new Error('thrown \\ud83d\\ud800')",
    "file": "require('fs').writeFileSync('name-\\ud800.txt', 'x'); 'written'",
}
ONE_SHOT = f"{OUTPUT} throw new Error('thrown \\ud800')"
STDOUT = f"out {R}\n{R}{R}{R}\n"


def well_formed(body: Any) -> Any:
    assert lone_surrogate_at(body) is None, body
    return body


def check_output(body: dict[str, Any]) -> None:
    assert body["stdout"] == STDOUT
    assert body["stderr"].startswith(f"err {R}\n")


def check_session_call(name: str, body: dict[str, Any]) -> None:
    well_formed(body)
    if name == "error_value":
        check_output(body)
        assert body["exit_code"] == 0
        assert body["result"].startswith(f"Error: value {R}\n    at ")
    elif name == "custom_inspect":
        assert body["result"] == f"custom {R}"
    elif name == "thrown":
        assert body["exit_code"] == 1
        assert f"Uncaught Error: thrown {R}{R}" in body["stderr"]
    else:
        assert body["result"] == "'written'"


def check_one_shot(body: dict[str, Any]) -> None:
    well_formed(body)
    check_output(body)
    assert body["exit_code"] == 1
    assert f"Error: thrown {R}" in body["stderr"]


def post(service: Service, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx2.post(f"{service.base_url}{path}", json=body, timeout=120)
    assert response.status_code == (201 if path == "/sessions" else 200), response.text
    answer: dict[str, Any] = response.json()
    return answer


def streamed(service: Service, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The stdout events' text and the result event's body of one streamed call."""
    headers = {"Accept": "text/event-stream"}
    url = f"{service.base_url}{path}"
    with httpx2.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        events = [(sse.event, well_formed(sse.json())) for sse in httpx2.EventSource(response)]
    assert [name for name, _ in events][-1] == "result"
    return "".join(data["text"] for name, data in events if name == "stdout"), events[-1][1]


async def over_mcp(service: Service, calls: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[str]]]:
    """Each call's structured result and its progress messages, through the official client."""
    answers = []
    with anyio.fail_after(120):
        async with Client(f"{service.base_url}/mcp") as client:
            for arguments in calls:
                messages: list[str] = []

                async def on_progress(_p: float, _t: float | None, message: str | None, into: list[str] = messages):
                    into.append(message or "")

                result = await client.call_tool("code_interpreter", arguments, progress_callback=on_progress)
                assert result.is_error is False, text_of(result)
                assert result.structured_content is not None
                assert json.loads(text_of(result)) == result.structured_content
                answers.append((well_formed(result.structured_content), well_formed(messages)))
    return answers


def test_lone_surrogates_from_sandboxed_code_reach_every_face_well_formed_and_every_call_is_audited(
    sandbox_service: Service,
) -> None:
    service = sandbox_service
    sid = post(service, "/sessions", {})["session_id"]
    try:
        session_ids = []
        # The session's own route, buffered and streamed, and the code_interpreter tool with session_id.
        for name, code in SESSION_CALLS.items():
            body = post(service, f"/sessions/{sid}/execute", {"code": code})
            check_session_call(name, body)
            session_ids.append(body["execution_id"])
            tool = post(service, "/tools/code-interpreter", {"code": code, "session_id": sid})
            check_session_call(name, tool)
            session_ids.append(tool["execution_id"])
            text, result = streamed(service, f"/sessions/{sid}/execute", {"code": code})
            check_session_call(name, result)
            assert text == result["stdout"]
            session_ids.append(result["execution_id"])
        files = well_formed(httpx2.get(f"{service.base_url}/sessions/{sid}/files", timeout=60).json())["files"]
        assert [f["path"] for f in files] == [f"name-{R}.txt"]
        # MCP, session and one-shot: the results and the progress messages.
        mcp_calls = [
            {"code": SESSION_CALLS["error_value"], "session_id": sid},
            {"code": SESSION_CALLS["custom_inspect"], "session_id": sid},
            {"code": ONE_SHOT},
        ]
        (value, value_progress), (custom, _), (one_shot_mcp, one_shot_progress) = anyio.run(
            over_mcp, service, mcp_calls
        )
        check_session_call("error_value", value)
        check_session_call("custom_inspect", custom)
        check_one_shot(one_shot_mcp)
        assert f"out {R}" in "".join(value_progress)
        assert f"out {R}" in "".join(one_shot_progress)
        session_ids += [value["execution_id"], custom["execution_id"]]
        # One-shot over HTTP, buffered and streamed.
        one_shot = post(service, "/tools/code-interpreter", {"code": ONE_SHOT})
        check_one_shot(one_shot)
        text, one_shot_streamed = streamed(service, "/tools/code-interpreter", {"code": ONE_SHOT})
        check_one_shot(one_shot_streamed)
        assert text == STDOUT
        one_shot_ids = [one_shot["execution_id"], one_shot_streamed["execution_id"], one_shot_mcp["execution_id"]]
        # A streamed call whose caller hangs up while it runs is audited too.
        headers = {"Accept": "text/event-stream"}
        waiting = {"code": "console.log('begun \\ud800'); await new Promise((r) => setTimeout(r, 60000))"}
        url = f"{service.base_url}/sessions/{sid}/execute"
        with httpx2.stream("POST", url, json={**waiting, "timeout_s": 120}, headers=headers, timeout=120) as response:
            for sse in httpx2.EventSource(response):
                assert sse.event == "stdout"
                assert sse.json()["text"] == f"begun {R}\n"
                break  # leave while the call runs
    finally:
        httpx2.delete(f"{service.base_url}/sessions/{sid}", timeout=60)

    deadline = time.monotonic() + 60
    while True:
        calls = [r for r in audit_records(service) if r["event"] == "session.call" and r["session_id"] == sid]
        if len(calls) == len(session_ids) + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [r["execution_id"] for r in calls[:-1]] == session_ids
    assert all(r["outcome"]["status"] == "completed" for r in calls[:-1])
    assert calls[-1]["outcome"] == {"status": "error", "error": "cancelled"}
    finished = {r["execution_id"] for r in audit_records(service) if r["event"] == "execution.finished"}
    assert set(one_shot_ids) <= finished
    verified = subprocess.run(
        [*METAAGENT, "audit", "verify", str(service.audit_log)], capture_output=True, text=True, timeout=120
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "chain intact" in verified.stdout
