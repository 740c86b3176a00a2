"""The tools this service offers, in one place: HTTP routes, `GET /tools` and MCP are all built from `TOOLS`."""

from __future__ import annotations

from metaagent import metrics
from metaagent.access import current_caller
from metaagent.sandbox.output import OutputSink
from metaagent.services import Services
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
    """One execution, buffered (no sink) or streamed to `sink`: the same path either way."""
    return await metrics.observe_execution(_execute_as_caller(svc, request, sink))


async def _execute_as_caller(
    svc: Services, request: CodeInterpreterRequest, sink: OutputSink | None
) -> CodeInterpreterResponse:
    caller = current_caller()  # the API key's id, set by the access check
    with svc.execution_quota.hold(caller):
        return await svc.interpreter(request, caller=caller, sink=sink)


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
)
