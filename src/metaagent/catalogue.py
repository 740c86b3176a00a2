"""The tools this service offers, in one place: HTTP routes, `GET /tools` and MCP are all built from `TOOLS`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from metaagent import metrics
from metaagent.access import current_caller, current_tenant
from metaagent.errors import ReplicaFull
from metaagent.fleet.routing import ReplicaUnreachable
from metaagent.sandbox.output import OutputSink
from metaagent.services import Services
from metaagent.sessions import file_tools
from metaagent.sessions.models import (
    CodeInterpreterAnswer,
    FileContent,
    FileList,
    FileWritten,
    SessionClosed,
    SessionCloseRequest,
    SessionCreateRequest,
    SessionExecuteRequest,
    SessionFilesRequest,
    SessionReadFileRequest,
    SessionRecord,
    SessionWriteFileRequest,
)
from metaagent.tools import Effects, ToolSpec
from metaagent.tools.code_interpreter import CodeInterpreterRequest, CodeInterpreterResponse
from metaagent.tools.embeddings import EMBEDDINGS
from metaagent.tools.http import HttpRequest, HttpResponse
from metaagent.tools.search import SEARCH


async def _invoke_http(svc: Services, request: HttpRequest) -> HttpResponse:
    return await svc.http(request)


def _in_its_session(tool: str, call: Callable[..., Awaitable[BaseModel]]) -> Callable[..., Awaitable[BaseModel]]:
    """`call`, run on the replica that holds the session the request names (`session_id`): here, or in a
    fleet on another replica, through `POST /tools/<tool>` there, as this request's caller (its output
    streamed back when a sink is given)."""

    async def routed(svc: Services, request: BaseModel, sink: OutputSink | None = None) -> BaseModel:
        async def here() -> BaseModel:
            return await (call(svc, request, sink) if sink is not None else call(svc, request))

        session_id = getattr(request, "session_id", None)
        if session_id is None or svc.peers is None:
            return await here()
        peers = svc.peers

        async def there(node_url: str) -> BaseModel:
            return await peers.call_tool(node_url, tool, request, current_tenant(), sink)

        return await peers.at_owner("session", session_id, current_tenant(), there=there, here=here)

    return routed


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
    try:
        return await metrics.observe_execution(_execute_as_caller(svc, request, sink))  # "rejected" if full here
    except ReplicaFull as full:  # in a fleet, another replica with room runs it (its place taken there)
        if svc.peers is None:
            raise
        # The other replica's answer, every field of it; that replica's metrics count how it ended.
        return await svc.peers.hand_over("code_interpreter", request, current_tenant(), sink, full)  # type: ignore[return-value]


async def _execute_as_caller(
    svc: Services, request: CodeInterpreterRequest, sink: OutputSink | None
) -> CodeInterpreterResponse:
    caller = current_caller()  # the API key's id, set by the access check
    async with svc.execution_quota.hold(caller):
        return await svc.interpreter(request, caller=caller, sink=sink)


async def open_session(svc: Services, request: SessionCreateRequest) -> SessionRecord:
    """A new session: here, or in a fleet on the replica that holds the fewest once this one holds its
    share of the fleet's sessions (`metaagent.fleet.routing.Peers.session_home`)."""
    if svc.peers is not None:
        home = await svc.peers.session_home(svc.sessions.open_count, svc.sessions.limits.max_sessions)
        if home is not None:
            try:
                return await svc.peers.call_tool(home, "session_create", request, current_tenant(), None)  # type: ignore[return-value]
            except ReplicaUnreachable:  # nothing reached it (it may just have stopped): the session opens here
                svc.peers.state.forget_replicas()
    return await svc.sessions.create(request, current_tenant())


async def _invoke_session_create(svc: Services, request: SessionCreateRequest) -> SessionRecord:
    return await open_session(svc, request)


async def _invoke_session_close(svc: Services, request: SessionCloseRequest) -> SessionClosed:
    return await svc.sessions.close(request.session_id, current_tenant())


async def _invoke_session_files(svc: Services, request: SessionFilesRequest) -> FileList:
    return await file_tools.list_files(svc.sessions, request, current_tenant())


async def _invoke_session_read_file(svc: Services, request: SessionReadFileRequest) -> FileContent:
    return await file_tools.read_file(svc.sessions, request, current_tenant())


async def _invoke_session_write_file(svc: Services, request: SessionWriteFileRequest) -> FileWritten:
    return await file_tools.write_file(svc.sessions, request, current_tenant())


# What a file tool may answer besides 200: a bad path or encoding (400), no such session or file (404),
# an ended session (410), a content too large (413), the session's queue full (429), a workspace full (507).
_FILE_TOOL_STATUSES = (400, 404, 410, 413, 422, 429, 503, 504, 507)

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "http",
        "/tools/http",
        HttpRequest,
        HttpResponse,
        "Make an HTTP request to an allow-listed host",
        _invoke_http,
        # any method: a DELETE or PUT to the host may destroy or replace what is there
        effects=Effects(read_only=False, destructive=True, open_world=True),
    ),
    ToolSpec(
        "code_interpreter",
        "/tools/code-interpreter",
        CodeInterpreterRequest,
        CodeInterpreterAnswer,  # a one-shot run's answer, or with session_id a session call's
        "Run JavaScript or Python in a fresh, isolated container",
        _in_its_session("code_interpreter", _run_code),
        error_statuses=(400, 422, 429, 502, 503, 504),
        stream=_in_its_session("code_interpreter", _run_code),
        # in a session the code may delete or overwrite workspace files; with `network` it reaches hosts
        effects=Effects(read_only=False, destructive=True, open_world=True),
    ),
    SEARCH,
    EMBEDDINGS,
    ToolSpec(
        "session_create",
        None,
        SessionCreateRequest,
        SessionRecord,
        "Open a stateful JavaScript or Python session with a private /workspace",
        _invoke_session_create,
        error_statuses=(400, 422, 429, 503),
        effects=Effects(read_only=False),
    ),
    ToolSpec(
        "session_close",
        None,
        SessionCloseRequest,
        SessionClosed,
        "Close a session: its container and files are gone",
        _in_its_session("session_close", _invoke_session_close),
        error_statuses=(404, 410),
        effects=Effects(read_only=False, destructive=True, idempotent=True),  # its files are gone
    ),
    ToolSpec(
        "session_files",
        None,
        SessionFilesRequest,
        FileList,
        "List the files of a session's workspace",
        _in_its_session("session_files", _invoke_session_files),
        error_statuses=_FILE_TOOL_STATUSES,
        effects=Effects(read_only=True, idempotent=True),
    ),
    ToolSpec(
        "session_read_file",
        None,
        SessionReadFileRequest,
        FileContent,
        "Read a file of a session's workspace",
        _in_its_session("session_read_file", _invoke_session_read_file),
        error_statuses=_FILE_TOOL_STATUSES,
        effects=Effects(read_only=True, idempotent=True),
    ),
    ToolSpec(
        "session_write_file",
        None,
        SessionWriteFileRequest,
        FileWritten,
        "Write a file into a session's workspace",
        _in_its_session("session_write_file", _invoke_session_write_file),
        error_statuses=_FILE_TOOL_STATUSES,
        effects=Effects(read_only=False, destructive=True, idempotent=True),  # replaces a file of that path
    ),
)
