"""The tools of the catalogue as a Model Context Protocol server: streamable HTTP at `/mcp`, or stdio.

Built on the SDK's low-level `Server`, so that each tool's input schema is exactly its request model's
JSON Schema (the one `GET /tools` and OpenAPI show) and a call runs the very `ToolSpec.invoke` the HTTP
route runs, on the same `Services`; each tool's annotations say what a call does (`ToolSpec.effects`).
A result carries the response model as `structuredContent` and the same JSON as compact text; a refusal
or failure (`MetaAgentError`) is a tool error (`isError`) with its message. A call of a streaming tool
that carries a `progressToken` also sends its output as progress notifications (`metaagent.progress`);
its result is the same. Workspace files are resources (`metaagent.workspace_resources`). Each POST body
at `/mcp` is read first by the service's strict JSON decoder (`metaagent.request_json`: UTF-8 only, no
repeated key, no integer past its range), which answers a JSON-RPC parse error (HTTP 400, as the SDK
answers its own) that names the field; the arguments then meet the tool's request model, strict as over
HTTP.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import mcp.types as types
from fastapi import FastAPI
from mcp.server import Server
from mcp.server.auth.middleware.bearer_auth import AuthorizationContext
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from metaagent import __version__, workspace_resources
from metaagent.access import acting_as, caller_of, current_tenant
from metaagent.api.errors import ErrorResponse
from metaagent.errors import InvalidRequest, MetaAgentError, describe_validation_errors
from metaagent.hints import Face, speaking
from metaagent.progress import with_progress
from metaagent.request_json import read_request_json
from metaagent.services import Services
from metaagent.tools import ToolSpec, inline_refs

log = logging.getLogger("metaagent.mcp")

PATH = "/mcp"
RESOURCE_NOT_FOUND = -32002  # the MCP specification's code for a resource that does not exist


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
            annotations=types.ToolAnnotations(
                title=spec.summary,
                read_only_hint=spec.effects.read_only,
                destructive_hint=spec.effects.destructive,
                idempotent_hint=spec.effects.idempotent,
                open_world_hint=spec.effects.open_world,
            ),
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
            message, _details = describe_validation_errors(exc.errors(), root=())
            return _tool_error(message)
        try:
            # The session runs in the task of the request that opened it: act as this request's key.
            # A model over MCP can only call tools: hints in its errors name tools (metaagent.hints).
            with acting_as(caller_of(ctx.request)), speaking(Face.TOOLS):
                result = await _call(spec, services(), request, ctx)
        except MetaAgentError as exc:
            if exc.status_code == 500:  # the service's own failure (an audit record not written): logged
                log.error("MCP call of tool %r failed: %s", params.name, exc.message)
            hint = exc.extra.get("hint")
            return _tool_error(f"{exc.message}\nhint: {hint}" if hint else exc.message)
        except Exception:  # the top of a tool call: the caller gets a generic error, the log the details
            log.exception("MCP call of tool %r failed unexpectedly", params.name)
            return _tool_error("Internal error; the service log has the details")
        structured = result.model_dump(mode="json")
        return types.CallToolResult(content=_content(structured), structured_content=structured)

    async def list_resources(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])  # see metaagent.workspace_resources

    async def list_resource_templates(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[workspace_resources.TEMPLATE])

    async def read_resource(
        ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        try:
            with acting_as(caller_of(ctx.request)), speaking(Face.TOOLS):
                return await workspace_resources.read(services().sessions, params.uri, current_tenant())
        except MetaAgentError as exc:  # a JSON-RPC error: a resource read has no isError
            code = RESOURCE_NOT_FOUND if exc.status_code in (404, 410) else types.INVALID_PARAMS
            raise MCPError(code, exc.message) from None

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
        on_list_resources=list_resources,
        on_list_resource_templates=list_resource_templates,
        on_read_resource=read_resource,
    )


async def _call(spec: ToolSpec, svc: Services, request: BaseModel, ctx: ServerRequestContext[Any]) -> BaseModel:
    """The tool's answer; with a `progressToken` on a tool that streams, its output goes out as progress too."""
    stream = spec.stream
    if stream is None or progress_token_from_params(ctx.params) is None:
        return await spec.invoke(svc, request)

    async def report(progress: float, text: str) -> None:
        await ctx.session.report_progress(progress, None, text)

    return await with_progress(lambda sink: stream(svc, request, sink), report)


def _content(structured: dict[str, Any]) -> list[types.ContentBlock]:
    """A result as MCP content: its JSON as text, and each figure of a session call (`images`) as an
    image item. In the text an image's base64 is replaced by the number of the image item that holds
    it: a model that reads the text would otherwise read megabytes of base64 (structured content keeps
    it whole). Compact JSON: frameworks that show the model the text pay for every byte, on every call."""
    images = structured.get("images") or []
    shown = structured
    if images:
        shown = {**structured, "images": [{**image, "data": f"<image {n}>"} for n, image in enumerate(images, 1)]}
    text = json.dumps(shown, ensure_ascii=False, separators=(",", ":"))
    content: list[types.ContentBlock] = [types.TextContent(text=text)]
    content.extend(types.ImageContent(data=image["data"], mime_type=image["mime"]) for image in images)
    return content


def _tool_error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


@dataclass(frozen=True)
class SessionLimits:
    """MCP sessions at once (`total`), per key (`per_key`), and how long one may be idle."""

    total: int
    per_key: int
    idle_timeout_s: float


class _KeyShareExhausted(Exception):
    def __init__(self, key_id: str | None) -> None:
        self.key_id = key_id


class BoundedSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager with a share per key on top of its global cap.

    The SDK ties each session to the `AuthenticatedUser` that opened it (the key id, see
    `metaagent.access`) and bounds all sessions together (503 past `max_sessions`). A key past its own
    share is refused here, inside the SDK's admission (under its lock, so concurrent opens cannot
    overshoot), and answered 429; other keys are not affected. The counts follow the SDK's own session
    lifecycle: a session counts from its admission until the SDK discards it (closed by the client,
    idle past the timeout, failed opening request, crash, shutdown).
    """

    def __init__(
        self,
        app: Server[Any],
        security: TransportSecuritySettings,
        limits: SessionLimits,
        forget: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(
            app=app,
            security_settings=security,
            session_idle_timeout=limits.idle_timeout_s,
            max_sessions=limits.total,
        )
        self.limits = limits
        self.forget = forget  # in a fleet: says that a discarded session no longer lives here
        self._owner_of: dict[str, str | None] = {}
        self._open: dict[str | None, int] = {}

    def open_sessions(self, key_id: str | None) -> int:
        return self._open.get(key_id, 0)

    def _admit_session(self, requestor: AuthorizationContext | None) -> StreamableHTTPServerTransport | None:
        key_id = requestor["client_id"] if requestor is not None else None
        if self.open_sessions(key_id) >= self.limits.per_key:
            raise _KeyShareExhausted(key_id)
        transport = super()._admit_session(requestor)
        if transport is not None and transport.mcp_session_id is not None:
            self._owner_of[transport.mcp_session_id] = key_id
            self._open[key_id] = self.open_sessions(key_id) + 1
        return transport

    async def _discard_session(self, session_id: str, transport: StreamableHTTPServerTransport) -> None:
        if session_id in self._owner_of:
            key_id = self._owner_of.pop(session_id)
            self._open[key_id] -= 1
            if not self._open[key_id]:
                del self._open[key_id]
        if self.forget is not None:
            await self.forget(session_id)
        await super()._discard_session(session_id, transport)


class StreamableHttpEndpoint:
    """The ASGI app at `/mcp`; the host app's lifespan enters `run()`, which starts a session manager.

    A session manager runs only once, so each lifespan gets a new one: the same app can start again.
    """

    def __init__(
        self,
        server: Server[Any],
        security: TransportSecuritySettings,
        limits: SessionLimits,
        forget: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._server = server
        self._security = security
        self.limits = limits
        self.forget = forget
        self.manager: BoundedSessionManager | None = None

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        manager = BoundedSessionManager(self._server, self._security, self.limits, self.forget)
        async with manager.run():
            self.manager = manager
            try:
                yield
            finally:
                self.manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.manager is None:
            response = JSONResponse({"error": "The MCP endpoint is not running"}, status_code=503)
            await response(scope, receive, send)
            return
        if scope["method"] == "POST":
            body, receive = await _buffered(receive)
            refusal = await _strict_json_refusal(body) if body is not None else None
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        try:
            await self.manager.handle_request(scope, receive, send)
        except _KeyShareExhausted as exc:
            who = f"Key {exc.key_id}" if exc.key_id is not None else "This caller"
            log.warning("refused a new MCP session: %s has %d open", who, self.limits.per_key)
            response = JSONResponse(
                {
                    "error": f"{who} already has {self.limits.per_key} MCP sessions open (the share per key, "
                    "METAAGENT_MCP_SESSIONS_PER_KEY): close one (HTTP DELETE with its Mcp-Session-Id) or "
                    f"let it idle out ({self.limits.idle_timeout_s:g} s)",
                    "retry_after_s": 5,
                },
                status_code=429,
                headers={"Retry-After": "5"},
            )
            await response(scope, receive, send)


async def _strict_json_refusal(body: bytes) -> ErrorResponse | None:
    """The answer to a body the strict decoder refuses: JSON-RPC's parse error, as the SDK answers its own."""
    if not body:
        return None
    try:
        await read_request_json(body)
    except InvalidRequest as exc:
        error = {"code": types.PARSE_ERROR, "message": exc.message}
        return ErrorResponse({"jsonrpc": "2.0", "id": None, "error": error}, status_code=400)
    return None


async def _buffered(receive: Receive) -> tuple[bytes | None, Receive]:
    """The whole request body (bounded by `metaagent.body_limit`; None if the client left before it was
    sent), and a `receive` that gives it, or the disconnect, again."""
    chunks: list[bytes] = []
    body: bytes | None = None
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: the SDK sees the same
            replay: list[Message] = [message]
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            body = b"".join(chunks)
            replay = [{"type": "http.request", "body": body, "more_body": False}]
            break

    async def replaying() -> Message:
        return replay.pop() if replay else await receive()

    return body, replaying


def mount_mcp(
    app: FastAPI,
    server: Server[Any],
    security: TransportSecuritySettings,
    limits: SessionLimits,
    forget: Callable[[str], Awaitable[None]] | None = None,
) -> StreamableHttpEndpoint:
    """Serves `server` at `/mcp` on `app`; the app's lifespan must enter the endpoint's `run()`. `forget` is
    told each MCP session the SDK discards (closed, idle, failed)."""
    endpoint = StreamableHttpEndpoint(server, security, limits, forget)
    app.router.routes.append(Route(PATH, endpoint, include_in_schema=False))
    return endpoint


async def serve_stdio(app: FastAPI) -> None:
    """Serves the app's MCP server over stdin/stdout, with the services its lifespan builds.

    stdio is claimed before the lifespan starts, so nothing the start-up prints can corrupt the wire.
    """
    server: Server[Any] = app.state.mcp_server
    async with stdio_server() as (read_stream, write_stream), app.router.lifespan_context(app):
        await server.run(read_stream, write_stream, server.create_initialization_options())
