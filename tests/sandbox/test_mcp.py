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
    assert text_of(invalid).startswith("Invalid request: code:")


async def test_stdio_runs_code_in_a_sandbox(sandbox_service: Service, tmp_path: Path) -> None:
    # sandbox_service: only so that the image is there; the stdio server is a process of its own.
    with (tmp_path / "stderr.log").open("w") as errlog, anyio.fail_after(TIMEOUT_S):
        async with Client(stdio_client(stdio_server(tmp_path), errlog=errlog)) as client:
            result = await client.call_tool("code_interpreter", PROGRAM)
    assert_ran(result)
