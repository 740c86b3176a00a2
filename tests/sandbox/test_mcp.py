"""`code_interpreter` over MCP with the official SDK's client, against the real engine, on both transports."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import mcp.types as types
import pytest
from mcp import Client
from mcp.client.stdio import stdio_client

from tests.sandbox.conftest import Service
from tests.test_mcp import stdio_server, text_of

pytestmark = pytest.mark.docker

TIMEOUT_S = 60
PROGRAM = {"code": "console.log(6 * 7); console.error('to stderr'); process.exitCode = 3", "timeout_s": 5}
PER_RUN = {"execution_id", "duration_ms", "queued_ms"}  # each execution's own


def assert_ran(result: types.CallToolResult) -> None:
    assert result.is_error is False
    structured = result.structured_content
    assert structured is not None
    assert structured["stdout"] == "42\n"
    assert structured["stderr"] == "to stderr\n"
    assert structured["exit_code"] == 3
    assert structured["execution_id"].startswith("exe_")
    assert json.loads(text_of(result)) == structured  # the readable form for models says the same


async def test_streamable_http_runs_code_in_a_sandbox(sandbox_service: Service) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{sandbox_service.base_url}/mcp") as client:
            result = await client.call_tool("code_interpreter", PROGRAM)
            invalid = await client.call_tool("code_interpreter", {"code": ""})
    assert_ran(result)
    assert invalid.is_error is True
    assert text_of(invalid) == "Invalid request: code must not be empty"


async def test_stdio_runs_code_in_a_sandbox(sandbox_service: Service, tmp_path: Path) -> None:
    # sandbox_service: only so that the image is there; the stdio server is a process of its own.
    with (tmp_path / "stderr.log").open("w") as errlog, anyio.fail_after(TIMEOUT_S):
        async with Client(stdio_client(stdio_server(tmp_path), errlog=errlog)) as client:
            result = await client.call_tool("code_interpreter", PROGRAM)
    assert_ran(result)


async def test_a_progress_token_brings_the_output_as_progress_and_leaves_the_result_unchanged(
    sandbox_service: Service,
) -> None:
    code = """
    let i = 0;
    const timer = setInterval(() => {
      i += 1;
      console.log(`line ${i} é`);
      if (i === 4) { console.error('to stderr'); clearInterval(timer); }
    }, 150);
    """
    notifications: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        notifications.append((progress, total, message))

    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{sandbox_service.base_url}/mcp") as client:
            with_progress = await client.call_tool(
                "code_interpreter", {"code": code, "timeout_s": 10}, progress_callback=on_progress
            )
            without = await client.call_tool("code_interpreter", {"code": code, "timeout_s": 10})
    assert with_progress.is_error is False
    structured, plain = with_progress.structured_content, without.structured_content
    assert structured is not None
    assert plain is not None
    assert {k: v for k, v in structured.items() if k not in PER_RUN} == {
        k: v for k, v in plain.items() if k not in PER_RUN
    }
    messages = [message or "" for _, _, message in notifications]
    output = structured["stdout"] + structured["stderr"]
    assert sorted("".join(messages).splitlines()) == sorted(output.splitlines())  # all of it, each line once
    assert all(total is None for _, total, _ in notifications)
    progress = [p for p, _, _ in notifications]
    assert progress == sorted(set(progress))  # grows with every notification
    assert progress[-1] == len(output.encode())  # bytes of output, é counted as two
    assert json.loads(text_of(with_progress)) == structured


async def test_a_refusal_with_a_progress_token_is_the_same_tool_error(sandbox_service: Service) -> None:
    refused = {"code": "1", "packages": ["not-on-the-list"]}

    async def on_progress(_progress: float, _total: float | None, _message: str | None) -> None:
        raise AssertionError("a refused call has no output")

    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{sandbox_service.base_url}/mcp") as client:
            with_progress = await client.call_tool("code_interpreter", refused, progress_callback=on_progress)
            without = await client.call_tool("code_interpreter", refused)
    assert with_progress.is_error is without.is_error is True
    assert text_of(with_progress) == text_of(without)
    assert "not-on-the-list" in text_of(with_progress)


async def test_tools_list_offers_the_session_tools_and_a_session_id_on_code_interpreter(
    sandbox_service: Service,
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{sandbox_service.base_url}/mcp") as client:
            listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert {"session_create", "session_close"} <= set(listed)
    assert "session_id" in listed["code_interpreter"].input_schema["properties"]
    assert listed["session_close"].input_schema["required"] == ["session_id"]


async def test_a_session_over_mcp_keeps_state_between_calls_and_a_call_after_close_is_a_tool_error(
    sandbox_service: Service,
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{sandbox_service.base_url}/mcp") as client:
            created = await client.call_tool("session_create", {})
            assert created.is_error is False, text_of(created)
            assert created.structured_content is not None
            session_id = created.structured_content["session_id"]
            define = await client.call_tool("code_interpreter", {"code": "let x = 41", "session_id": session_id})
            use = await client.call_tool("code_interpreter", {"code": "x + 1", "session_id": session_id})
            closed = await client.call_tool("session_close", {"session_id": session_id})
            after = await client.call_tool("code_interpreter", {"code": "x", "session_id": session_id})
    assert session_id.startswith("ses_")
    assert define.is_error is use.is_error is False
    assert define.structured_content is not None
    assert use.structured_content is not None
    assert define.structured_content["result"] is None  # `let x = 41` shows undefined, as in the REPL
    assert use.structured_content["result"] == "42"
    assert use.structured_content["session_id"] == session_id
    assert closed.structured_content == {"session_id": session_id, "closed": True}
    assert after.is_error is True
    assert text_of(after) == f"Session {session_id} has ended: closed"
    assert sandbox_service.get(f"/sessions/{session_id}").status_code == 410
