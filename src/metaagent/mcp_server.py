"""The tools of the catalogue as a Model Context Protocol server: streamable HTTP at `/mcp`, or stdio.

Built on the SDK's low-level `Server`, so that each tool's input schema is exactly its request model's
JSON Schema (the one `GET /tools` and OpenAPI show) and a call runs the very `ToolSpec.invoke` the HTTP
route runs, on the same `Services`. A result carries the response model as `structuredContent` and the
same JSON as text; a refusal or failure (`MetaAgentError`) is a tool error (`isError`) with its message.
A call of a streaming tool that carries a `progressToken` also sends its output as progress
notifications (`metaagent.progress`); its result is the same.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import mcp.types as types
from fastapi import FastAPI
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from metaagent import __version__
from metaagent.access import acting_as, caller_of
from metaagent.errors import MetaAgentError, describe_validation_errors
from metaagent.progress import with_progress
from metaagent.services import Services
from metaagent.tools import ToolSpec, inline_refs

log = logging.getLogger("metaagent.mcp")

PATH = "/mcp"
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def build_server(tools: Sequence[ToolSpec], services: Callable[[], Services]) -> Server[Any]:
    """An MCP server offering `tools`; `services()` gives the running service's parts at call time."""
    by_name = {spec.name: spec for spec in tools}
    listing = [
        types.Tool(
            name=spec.name,
            title=spec.summary,
            description=spec.description,
            input_schema=spec.parameters_schema(),
            output_schema=inline_refs(spec.response_model.model_json_schema(mode="serialization")),
        )
        for spec in tools
    ]

    async def list_tools(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listing)

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        spec = by_name.get(params.name)
        if spec is None:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}; the tools are {', '.join(by_name)}")
        try:
            request = spec.request_model.model_validate(params.arguments or {})
        except ValidationError as exc:
            message, _details = describe_validation_errors(exc.errors())
            return _tool_error(message)
        try:
            # The session runs in the task of the request that opened it: act as this request's key.
            with acting_as(caller_of(ctx.request)):
                result = await _call(spec, services(), request, ctx)
        except MetaAgentError as exc:
            hint = exc.extra.get("hint")
            return _tool_error(f"{exc.message}\nhint: {hint}" if hint else exc.message)
        except Exception:  # the top of a tool call: the caller gets a generic error, the log the details
            log.exception("MCP call of tool %r failed unexpectedly", params.name)
            return _tool_error("Internal error; the service log has the details")
        structured = result.model_dump(mode="json")
        text = json.dumps(structured, ensure_ascii=False, indent=2)
        return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured)

    schemas = {spec.name: spec.parameters_schema() for spec in tools}
    return Server(
        "metaagent",
        version=__version__,
        title="MetaAgent tools",
        instructions="Tools that cannot endanger the machine they run on: "
        + ", ".join(f"{spec.name} ({spec.summary.lower()})" for spec in tools),
        get_tool_input_schema=schemas.get,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _call(spec: ToolSpec, svc: Services, request: BaseModel, ctx: ServerRequestContext[Any]) -> BaseModel:
    """The tool's answer; with a `progressToken` on a tool that streams, its output goes out as progress too."""
    stream = spec.stream
    if stream is None or progress_token_from_params(ctx.params) is None:
        return await spec.invoke(svc, request)

    async def report(progress: float, text: str) -> None:
        await ctx.session.report_progress(progress, None, text)

    return await with_progress(lambda sink: stream(svc, request, sink), report)


def _tool_error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


def transport_security(allowed_hosts: str) -> TransportSecuritySettings:
    """DNS-rebinding protection: localhost's Host headers, plus `METAAGENT_MCP_ALLOWED_HOSTS` (`*`: no check).

    Entries are `host` (any port) or `host:port`, as a JSON array or comma-separated.
    """
    extra = _parse_hosts(allowed_hosts)
    if "*" in extra:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    hosts: list[str] = []
    origins: list[str] = []
    for host in [*_LOCAL_HOSTS, *extra]:
        forms = [host] if ":" in host.removeprefix("[").split("]")[-1] else [host, f"{host}:*"]
        hosts.extend(forms)
        origins.extend(f"{scheme}://{form}" for form in forms for scheme in ("http", "https"))
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


def _parse_hosts(text: str) -> list[str]:
    text = text.strip()
    if not text:
        return []
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text.split(",")
    items = parsed if isinstance(parsed, list) else [parsed]
    return [str(item).strip().lower() for item in items if str(item).strip()]


class StreamableHttpEndpoint:
    """The ASGI app at `/mcp`; the host app's lifespan enters `run()`, which starts a session manager.

    A session manager runs only once, so each lifespan gets a new one: the same app can start again.
    """

    def __init__(self, server: Server[Any], security: TransportSecuritySettings) -> None:
        self._server = server
        self._security = security
        self._manager: StreamableHTTPSessionManager | None = None

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        manager = StreamableHTTPSessionManager(app=self._server, security_settings=self._security)
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                self._manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._manager is None:
            response = JSONResponse({"error": "The MCP endpoint is not running"}, status_code=503)
            await response(scope, receive, send)
            return
        await self._manager.handle_request(scope, receive, send)


def mount_mcp(app: FastAPI, server: Server[Any], allowed_hosts: str) -> StreamableHttpEndpoint:
    """Serves `server` at `/mcp` on `app`; the app's lifespan must enter the endpoint's `run()`."""
    endpoint = StreamableHttpEndpoint(server, transport_security(allowed_hosts))
    app.router.routes.append(Route(PATH, endpoint, include_in_schema=False))
    return endpoint


async def serve_stdio(app: FastAPI) -> None:
    """Serves the app's MCP server over stdin/stdout, with the services its lifespan builds.

    stdio is claimed before the lifespan starts, so nothing the start-up prints can corrupt the wire.
    """
    server: Server[Any] = app.state.mcp_server
    async with stdio_server() as (read_stream, write_stream), app.router.lifespan_context(app):
        await server.run(read_stream, write_stream, server.create_initialization_options())
