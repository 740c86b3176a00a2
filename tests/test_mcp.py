"""The tools over MCP, driven by the official SDK's client: in-process, over streamable HTTP, over stdio."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp.types as types
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client

from metaagent.app import TOOLS, create_app
from metaagent.hosts import transport_security
from metaagent.sessions.models import SessionExecuteResponse
from metaagent.tools.code_interpreter import CodeInterpreterResponse
from tests.conftest import ServiceFactory, make_settings
from tests.fake_upstreams import SERPER_KEY
from tests.live_service import serving

LOCAL = '["127.0.0.1"]'
TIMEOUT_S = 30
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}},
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@asynccontextmanager
async def in_process(tmp_path: Path, **overrides: Any) -> AsyncIterator[Client]:
    app = create_app(make_settings(tmp_path, **overrides))
    async with app.router.lifespan_context(app), Client(app.state.mcp_server) as client:
        yield client


@pytest.fixture
def live_service(tmp_path: Path) -> Iterator[str]:
    app = create_app(make_settings(tmp_path, allow_http_hosts=LOCAL))
    with serving(app) as url:
        yield url


def text_of(result: types.CallToolResult) -> str:
    (block,) = result.content
    assert isinstance(block, types.TextContent)
    return block.text


async def test_every_catalogue_tool_is_listed_with_its_request_models_schema(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path) as client:
            listed = (await client.list_tools()).tools
    assert [t.name for t in listed] == [spec.name for spec in TOOLS]
    assert {"http", "search", "embeddings"} <= {t.name for t in listed}
    for tool, spec in zip(listed, TOOLS, strict=True):
        assert tool.input_schema == spec.parameters_schema()
        assert tool.description == spec.description
        assert tool.output_schema is not None


async def test_mcp_offers_the_same_tools_and_schemas_as_get_tools(service: ServiceFactory, tmp_path: Path) -> None:
    async with service() as http_client:
        functions = (await http_client.get("/tools")).json()["tools"]
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path) as client:
            listed = (await client.list_tools()).tools
    assert [(f["name"], f["description"], f["parameters"]) for f in functions] == [
        (t.name, t.description, t.input_schema) for t in listed
    ]


async def test_calling_http_returns_structured_content_and_the_same_json_as_text(tmp_path: Path, upstream: str) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path, allow_http_hosts=LOCAL) as client:
            result = await client.call_tool("http", {"url": f"{upstream}/hello"})
    assert result.is_error is False
    assert result.structured_content["status"] == 200
    assert result.structured_content["body"] == "hello from upstream"
    assert json.loads(text_of(result)) == result.structured_content
    # compact, for the model that reads it: the same JSON with no indentation or padding
    assert text_of(result) == json.dumps(result.structured_content, ensure_ascii=False, separators=(",", ":"))


async def test_each_tool_carries_annotations_that_say_what_a_call_does(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path) as client:
            listed = {t.name: t.annotations for t in (await client.list_tools()).tools}
    hints = {
        name: (a.read_only_hint, a.destructive_hint, a.idempotent_hint, a.open_world_hint)
        for name, a in listed.items()
        if a is not None
    }
    assert set(hints) == set(listed)  # every tool has them
    # (read only, destructive, idempotent, open world)
    assert hints["search"] == hints["embeddings"] == (True, False, True, True)  # the web, changing nothing
    assert hints["http"] == (False, True, False, True)  # any method, to hosts out there
    assert hints["session_files"] == hints["session_read_file"] == (True, False, True, False)
    assert hints["session_write_file"] == (False, True, True, False)  # it replaces the file at that path
    assert hints["session_close"] == (False, True, True, False)
    assert hints["session_create"] == (False, False, False, False)
    assert hints["code_interpreter"] == (False, True, False, True)


async def test_code_interpreters_output_schema_has_a_session_calls_fields_as_optional(tmp_path: Path) -> None:
    # A client that builds objects from the output schema (fastmcp's `.data`) keeps `result` and `error`.
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
    schema = listed["code_interpreter"].output_schema
    assert schema is not None
    session_fields = set(SessionExecuteResponse.model_fields) - set(CodeInterpreterResponse.model_fields)
    assert {"session_id", "result", "error", "images"} <= session_fields <= set(schema["properties"])
    assert not session_fields & set(schema["required"])  # a one-shot run's answer has none of them


@pytest.mark.security
async def test_blocked_host_is_a_tool_error_with_the_message(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path, allow_http_hosts=LOCAL) as client:
            result = await client.call_tool("http", {"url": "https://malicious.com/api"})
    assert result.is_error is True
    assert text_of(result) == "Blocked host: malicious.com"


async def test_a_refusal_with_a_hint_carries_the_hint_in_the_error_text(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path, allow_http_hosts=LOCAL, serper_api_key=SERPER_KEY) as client:
            result = await client.call_tool("search", {"q": "x"})
    assert result.is_error is True
    message, hint = text_of(result).split("\n")
    assert message == "Blocked host: google.serper.dev"
    assert hint.startswith("hint: ")
    assert "ALLOW_HTTP_HOSTS" in hint


async def test_a_missing_key_is_a_tool_error_naming_the_variable(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path, allow_http_hosts=LOCAL) as client:
            result = await client.call_tool("embeddings", {"input": "x"})
    assert result.is_error is True
    assert "OPENAI_API_KEY" in text_of(result)


async def test_invalid_arguments_are_a_tool_error_naming_the_field(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path, allow_http_hosts=LOCAL) as client:
            result = await client.call_tool("http", {"url": "https://x.com", "timeout_s": 0})
    assert result.is_error is True
    assert text_of(result) == "Invalid request: timeout_s must be greater than 0 (got 0)"


async def test_an_unknown_tool_is_a_protocol_error(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path) as client:
            with pytest.raises(MCPError, match="Unknown tool: shell"):
                await client.call_tool("shell", {})


async def test_streamable_http_at_mcp_lists_the_tools_and_calls_http(live_service: str, upstream: str) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{live_service}/mcp") as client:
            names = [t.name for t in (await client.list_tools()).tools]
            result = await client.call_tool("http", {"url": f"{upstream}/hello"})
            blocked = await client.call_tool("http", {"url": "https://malicious.com/"})
    assert names == [spec.name for spec in TOOLS]
    assert result.structured_content["body"] == "hello from upstream"
    assert blocked.is_error is True
    assert text_of(blocked) == "Blocked host: malicious.com"


def stdio_server(tmp_path: Path, **env: str) -> StdioServerParameters:
    values = {
        "METAAGENT_AUDIT_LOG": str(tmp_path / "audit.jsonl"),
        "METAAGENT_SANDBOX_BUILD_ON_START": "false",
        "ALLOW_HTTP_HOSTS": LOCAL,
        **{k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "VIRTUAL_ENV")},
        **env,
    }
    return StdioServerParameters(command=sys.executable, args=["-m", "metaagent", "mcp"], env=values, cwd=tmp_path)


async def test_stdio_lists_the_tools_and_calls_http(tmp_path: Path, upstream: str) -> None:
    with (tmp_path / "stderr.log").open("w") as errlog, anyio.fail_after(TIMEOUT_S):
        async with Client(stdio_client(stdio_server(tmp_path), errlog=errlog)) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            result = await client.call_tool("http", {"url": f"{upstream}/hello"})
    assert names == [spec.name for spec in TOOLS]
    assert result.is_error is False
    assert result.structured_content["body"] == "hello from upstream"


@pytest.mark.security
async def test_stdio_keeps_logs_on_stderr_and_the_wire_clean(tmp_path: Path) -> None:
    with (tmp_path / "stderr.log").open("w") as errlog, anyio.fail_after(TIMEOUT_S):
        async with Client(stdio_client(stdio_server(tmp_path), errlog=errlog)) as client:
            result = await client.call_tool("http", {"url": "https://malicious.com/api"})
    assert text_of(result) == "Blocked host: malicious.com"
    stderr = (tmp_path / "stderr.log").read_text()
    assert "[SECURITY] Blocked HTTP request to disallowed host: malicious.com (GET https://malicious.com/api)" in stderr


@pytest.mark.security
async def test_mcp_refuses_a_foreign_host_header_with_421(service: ServiceFactory) -> None:
    async with service() as client:
        response = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "evil.example"})
    assert response.status_code == 421


async def test_mcp_accepts_localhost_and_the_configured_extra_hosts(service: ServiceFactory) -> None:
    async with service(allowed_hosts='["tools.internal"]') as client:
        for host in ("127.0.0.1:3102", "localhost", "tools.internal:8080"):
            response = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": host})
            assert response.status_code == 200, host


def test_transport_security_reads_hosts_as_json_or_comma_separated() -> None:
    assert "api.internal:*" in transport_security("api.internal, other:8080").allowed_hosts
    assert "other:8080" in transport_security('["api.internal", "other:8080"]').allowed_hosts
    assert "other:8080:*" not in transport_security("other:8080").allowed_hosts
    assert transport_security("*").enable_dns_rebinding_protection is False
    assert transport_security("").enable_dns_rebinding_protection is True


async def test_mcp_is_not_part_of_the_openapi_description(service: ServiceFactory) -> None:
    async with service() as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
    assert "/mcp" not in paths
    assert {"/tools/search", "/tools/embeddings"} <= set(paths)


@pytest.mark.security
async def test_the_running_service_refuses_a_foreign_host_header_at_mcp(live_service: str) -> None:
    port = live_service.rsplit(":", 1)[1]
    async with httpx2.AsyncClient(base_url=live_service, timeout=TIMEOUT_S) as client:
        ok = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": f"localhost:{port}"})
        refused = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Host": "attacker.example"})
    assert ok.status_code == 200
    assert refused.status_code == 421


async def test_the_same_app_serves_mcp_again_after_its_lifespan_restarts(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path))
    for _ in range(2):
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1:3102") as client:
                response = await client.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS)
            assert response.status_code == 200


async def test_mcp_answers_503_outside_the_lifespan(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path))
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1:3102") as client:
        response = await client.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS)
    assert response.status_code == 503


async def test_an_argument_is_checked_as_strictly_as_an_http_body(tmp_path: Path) -> None:
    """The same request models, so `timeout_s: true` is no more a number over MCP than over HTTP."""
    with anyio.fail_after(TIMEOUT_S):
        async with in_process(tmp_path, allow_http_hosts=LOCAL) as client:
            boolean = await client.call_tool("http", {"url": "https://x.com", "timeout_s": True})
            text = await client.call_tool("search", {"q": "a", "num": "5"})
    assert boolean.is_error is True
    assert text_of(boolean) == "Invalid request: timeout_s must be a number (got true)"
    assert text.is_error is True
    assert text_of(text) == "Invalid request: num must be an integer (got a string)"


@pytest.mark.parametrize(
    ("body", "phrase"),
    [
        (json.dumps(INITIALIZE)[:-1].encode() + b', "id": 2}', "Invalid request: id: given twice"),
        (json.dumps(INITIALIZE).encode("utf-16"), "Invalid request: body: starts with a UTF-16 byte order mark"),
        (
            json.dumps({**INITIALIZE, "id": 12345}).replace("12345", "1" * 5000).encode(),
            "Invalid request: id: an integer",
        ),
        (b'{"\\ud800": 1, "\\ud800": 2}', "Invalid request: \ud800: given twice"),  # quoted back, as its escape
        (b'{"' + b"k" * 200_000 + b'": 1, "' + b"k" * 200_000 + b'": 2}', "Invalid request: " + "k" * 100 + "...: "),
    ],
    ids=["duplicate", "utf16", "5000_digits", "lone_surrogate_key", "long_key"],
)
def test_an_mcp_message_that_is_not_strict_json_is_a_parse_error_naming_the_field(
    live_service: str, body: bytes, phrase: str
) -> None:
    response = httpx2.post(f"{live_service}/mcp", content=body, headers=MCP_HEADERS, timeout=TIMEOUT_S)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == types.PARSE_ERROR
    assert response.json()["error"]["message"].startswith(phrase)
