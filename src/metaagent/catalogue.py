"""The tools this service offers, in one place: HTTP routes, `GET /tools` and MCP are all built from `TOOLS`."""

from __future__ import annotations

from metaagent import metrics
from metaagent.access import current_caller, current_tenant
from metaagent.sandbox.output import OutputSink
from metaagent.services import Services
from metaagent.sessions.models import (
    SessionClosed,
    SessionCloseRequest,
    SessionCreateRequest,
    SessionExecuteRequest,
    SessionRecord,
)
from metaagent.tools import ToolSpec
from metaagent.tools.code_interpreter import CodeInterpreterRequest, CodeInterpreterResponse
from metaagent.tools.embeddings import EMBEDDINGS
from metaagent.tools.http import HttpRequest, HttpResponse
from metaagent.tools.search import SEARCH


async def _invoke_http(svc: Services, request: HttpRequest) -> HttpResponse:
    return await svc.http(request)


async def _run_code(
    svc: Services, request: CodeInterpreterRequest, sink: OutputSink | None = None
) -> CodeInterpreterResponse:
    """One execution, buffered (no sink) or streamed to `sink`: the same path either way.

    With `session_id` it is a session call, exactly as POST /sessions/{id}/execute makes it: the session's
    limits (its queue) and not the one-shot ones (the per-key execution quota, the execution metrics)."""
    if request.session_id is not None:
        svc.sessions.check_own_values(request.session_id, request.session_values(), current_tenant())
        call = SessionExecuteRequest(code=request.code, timeout_s=request.timeout_s)
        return await svc.sessions.execute(request.session_id, call, current_tenant(), sink)
    return await metrics.observe_execution(_execute_as_caller(svc, request, sink))


async def _execute_as_caller(
    svc: Services, request: CodeInterpreterRequest, sink: OutputSink | None
) -> CodeInterpreterResponse:
    caller = current_caller()  # the API key's id, set by the access check
    with svc.execution_quota.hold(caller):
        return await svc.interpreter(request, caller=caller, sink=sink)


async def _invoke_session_create(svc: Services, request: SessionCreateRequest) -> SessionRecord:
    return await svc.sessions.create(request, current_tenant())


async def _invoke_session_close(svc: Services, request: SessionCloseRequest) -> SessionClosed:
    return await svc.sessions.close(request.session_id, current_tenant())


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "http", "/tools/http", HttpRequest, HttpResponse, "Make an HTTP request to an allow-listed host", _invoke_http
    ),
    ToolSpec(
        "code_interpreter",
        "/tools/code-interpreter",
        CodeInterpreterRequest,
        CodeInterpreterResponse,
        "Run JavaScript in a fresh, isolated container",
        _run_code,
        error_statuses=(400, 422, 429, 502, 503, 504),
        stream=_run_code,
    ),
    SEARCH,
    EMBEDDINGS,
    ToolSpec(
        "session_create",
        None,
        SessionCreateRequest,
        SessionRecord,
        "Open a stateful JavaScript session with a private /workspace",
        _invoke_session_create,
        error_statuses=(400, 422, 429, 503),
    ),
    ToolSpec(
        "session_close",
        None,
        SessionCloseRequest,
        SessionClosed,
        "Close a session: its container and files are gone",
        _invoke_session_close,
        error_statuses=(404, 410),
    ),
)
