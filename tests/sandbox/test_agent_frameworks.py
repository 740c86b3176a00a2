"""Each agent framework's own MCP client drives a whole session, as its agent loop would, with no LLM:
the official SDK's `Client`, fastmcp's `Client`, and the OpenAI Agents SDK's `MCPServerStreamableHttp`
(its tools converted to strict mode and invoked through the function tools it hands an agent)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import fastmcp
import mcp
import pytest
from agents import Agent, RunContextWrapper
from agents.mcp import MCPServerStreamableHttp, MCPUtil
from agents.tool import FunctionTool
from agents.tool_context import ToolContext

from metaagent.app import TOOLS
from tests.sandbox.conftest import Service

pytestmark = pytest.mark.docker

TIMEOUT_S = 120
Call = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]

CSV = "city,temp\nLisboa,21\nOslo,4\nCairo,35\n"
PARSE = """
const rows = require('fs').readFileSync('temps.csv', 'utf8').trim().split('\\n').slice(1)
  .map((line) => { const [city, temp] = line.split(','); return { city, temp: Number(temp) }; });
rows.length
"""
SUMMARISE = """
const mean = rows.reduce((sum, row) => sum + row.temp, 0) / rows.length;
const hottest = rows.sort((a, b) => b.temp - a.temp)[0].city;
require('fs').writeFileSync('summary.json', JSON.stringify({ mean, hottest }));
mean
"""


async def whole_session(call: Call) -> None:
    """Create; write a CSV; compute over it in two calls that share state; read the result file back; a
    thrown error and a timeout, seen as `error`, the session living on; close."""
    session_id = (await call("session_create", {}))["session_id"]
    written = await call("session_write_file", {"session_id": session_id, "path": "temps.csv", "content": CSV})
    parsed = await call("code_interpreter", {"session_id": session_id, "code": PARSE})
    summarised = await call("code_interpreter", {"session_id": session_id, "code": SUMMARISE})
    summary = await call("session_read_file", {"session_id": session_id, "path": "summary.json"})
    thrown = await call("code_interpreter", {"session_id": session_id, "code": "rows.missing.field"})
    timed_out = await call("code_interpreter", {"session_id": session_id, "code": "for (;;) {}", "timeout_s": 1})
    still = await call("code_interpreter", {"session_id": session_id, "code": "rows.length"})
    closed = await call("session_close", {"session_id": session_id})

    assert written["size"] == len(CSV)
    assert (parsed["result"], parsed["error"]) == ("3", None)
    assert summarised["result"] == "20"
    assert json.loads(summary["content"]) == {"mean": 20, "hottest": "Cairo"}
    assert thrown["error"]["name"] == "TypeError"
    assert "reading 'field'" in thrown["error"]["message"]
    assert thrown["exit_code"] == 1
    assert timed_out["error"]["name"] == "Timeout"
    assert timed_out["timed_out"] is True
    assert timed_out["session_ended"] is False
    assert still["result"] == "3"  # the session kept its state through both
    assert closed == {"session_id": session_id, "closed": True}


async def test_the_official_mcp_client_runs_a_whole_session(sandbox_service: Service) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with mcp.Client(f"{sandbox_service.base_url}/mcp") as client:
            names = [tool.name for tool in (await client.list_tools()).tools]

            async def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                result = await client.call_tool(name, arguments)
                assert result.is_error is False, result.content
                assert result.structured_content is not None
                return result.structured_content

            await whole_session(call)
    assert names == [spec.name for spec in TOOLS]


async def test_fastmcp_runs_a_whole_session(sandbox_service: Service) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with fastmcp.Client(f"{sandbox_service.base_url}/mcp") as client:
            names = [tool.name for tool in await client.list_tools()]

            async def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                result = await client.call_tool(name, arguments)  # raises ToolError on a tool error
                assert result.structured_content is not None
                return result.structured_content

            await whole_session(call)
            # A call that runs out of the client's own timeout is abandoned, and the service interrupts it:
            # the next call of that session runs, long before the abandoned one's timeout_s (300 s).
            session_id = (await call("session_create", {}))["session_id"]
            spin = {"session_id": session_id, "code": "for (;;) {}", "timeout_s": 300}
            with pytest.raises(mcp.MCPError, match="timed out"):
                await client.call_tool("code_interpreter", spin, timeout=2)
            after = await call("code_interpreter", {"session_id": session_id, "code": "'served'"})
            await call("session_close", {"session_id": session_id})
    assert names == [spec.name for spec in TOOLS]
    assert after["result"] == "'served'"


async def test_the_openai_agents_sdk_runs_a_whole_session_in_strict_mode(sandbox_service: Service) -> None:
    # The SDK's default client timeout (5 s) is below the tools' default timeout_s (8): it must be raised.
    server = MCPServerStreamableHttp(
        {"url": f"{sandbox_service.base_url}/mcp"}, client_session_timeout_seconds=60, cache_tools_list=True
    )
    with anyio.fail_after(TIMEOUT_S):
        async with server:
            agent = Agent(name="analyst", mcp_servers=[server])
            tools = await MCPUtil.get_function_tools(server, True, RunContextWrapper(context=None), agent)
            function_tools = {tool.name: tool for tool in tools if isinstance(tool, FunctionTool)}

            async def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                tool = function_tools[name]
                # What a model in strict mode sends: every property, null where it has no value.
                every = {prop: arguments.get(prop) for prop in tool.params_json_schema["properties"]}
                context = ToolContext(
                    context=None, tool_name=name, tool_call_id=f"call_{name}", tool_arguments=json.dumps(every)
                )
                output = await tool.on_invoke_tool(context, json.dumps(every))
                assert isinstance(output, dict), output  # a tool error would be the SDK's error text
                answer: dict[str, Any] = json.loads(output["text"])
                return answer

            await whole_session(call)
    strict = {name for name, tool in function_tools.items() if tool.strict_json_schema}
    assert strict == {spec.name for spec in TOOLS} - {"http"}  # http's headers map cannot be strict
