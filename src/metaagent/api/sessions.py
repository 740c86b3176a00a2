"""`/sessions`: stateful code interpreter sessions, their calls, and the files of their workspaces."""

from __future__ import annotations

import mimetypes
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import unquote_to_bytes

import anyio
import anyio.to_thread
from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.convertors import Convertor, register_url_convertor
from starlette.types import Receive, Scope, Send

from metaagent.access import current_tenant
from metaagent.api.body import StrictJsonRoute
from metaagent.api.deps import services, until_disconnect
from metaagent.api.errors import error_responses
from metaagent.api.events import OPENAPI_RESPONSE, event_stream, wants_event_stream
from metaagent.catalogue import open_session
from metaagent.fleet.routing import forwarded
from metaagent.sessions.models import (
    FileDeleted,
    FileList,
    FileWritten,
    SessionClosed,
    SessionCreateRequest,
    SessionEnding,
    SessionExecuteRequest,
    SessionExecuteResponse,
    SessionList,
    SessionRecord,
)
from metaagent.sessions.paths import decoded_workspace_path, workspace_path


class _AnyPath(Convertor[str]):
    """A file path, whatever it holds: the workspace rules decide, with a 400, never the router's 404."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("anypath", _AnyPath())

router = APIRouter(prefix="/sessions", tags=["sessions"], route_class=StrictJsonRoute)

FILES_SEGMENT = b"files"


@router.post(
    "", status_code=201, summary="Open a session", operation_id="session_create",
    responses=error_responses(400, 422, 429, 503),
)  # fmt: skip
async def create_session(request: Request, body: SessionCreateRequest | None = Body(default=None)) -> SessionRecord:  # noqa: B008 -- FastAPI's way to make a body optional
    return await open_session(services(request), body or SessionCreateRequest())


@router.get("", summary="The caller's open sessions")
async def list_sessions(request: Request) -> SessionList:
    """In a fleet, every live replica's (this one asks the others for theirs)."""
    svc, caller = services(request), current_tenant()
    sessions = svc.sessions.list(caller)
    if svc.peers is not None and not forwarded(request):
        found = await svc.peers.gather("/sessions", caller, "sessions")
        sessions += [SessionRecord.model_validate(item) for item in found]
    return SessionList(sessions=sessions)


@router.get("/{session_id}", summary="One session", responses=error_responses(404, 410))
async def get_session(session_id: str, request: Request) -> SessionRecord:
    return services(request).sessions.get(session_id, current_tenant()).record()


@router.delete(
    "/{session_id}",
    summary="Close a session now",
    response_model=SessionClosed,
    responses={
        **error_responses(404, 410),
        202: {"model": SessionEnding, "description": "The session has ended; the engine is removing its container"},
    },
)
async def close_session(session_id: str, request: Request) -> Response:
    closed = await services(request).sessions.close(session_id, current_tenant())
    return JSONResponse(closed.model_dump(mode="json"), status_code=202 if isinstance(closed, SessionEnding) else 200)


@router.post(
    "/{session_id}/execute",
    summary="Run code in the session (with Accept: text/event-stream, its output streams as it comes)",
    responses={**error_responses(404, 410, 422, 429), **OPENAPI_RESPONSE},
    response_model=SessionExecuteResponse,
)
async def execute_in_session(session_id: str, body: SessionExecuteRequest, request: Request) -> Response:
    sessions, caller = services(request).sessions, current_tenant()
    if wants_event_stream(request.headers.get("accept", "")):
        return event_stream(lambda sink: sessions.execute(session_id, body, caller, sink))
    response = await until_disconnect(request, lambda: sessions.execute(session_id, body, caller))
    return JSONResponse(response.model_dump(mode="json"))


@router.get(
    "/{session_id}/files",
    summary="Every regular file in the workspace",
    response_model=FileList,
    responses=error_responses(404, 410),
)
async def list_files(session_id: str, request: Request) -> Response:
    listing = await services(request).sessions.list_files(session_id, current_tenant())
    # Up to 10,000 entries: written off the event loop.
    return Response(await anyio.to_thread.run_sync(listing.model_dump_json), media_type="application/json")


@router.put(
    "/{session_id}/files/{path:anypath}",
    status_code=201,
    summary="Write a file into the workspace (the raw body is its content)",
    responses=error_responses(400, 404, 410, 413, 507),
)
async def put_file(session_id: str, path: str, request: Request) -> FileWritten:
    checked = _file_path(request, session_id, path)
    return await services(request).sessions.put_file(session_id, checked, request.stream(), current_tenant())


@router.get(
    "/{session_id}/files/{path:anypath}",
    summary="Read a file of the workspace (its raw bytes)",
    responses={**error_responses(400, 404, 410), 200: {"content": {"application/octet-stream": {}}}},
    response_model=None,
)
async def get_file(session_id: str, path: str, request: Request) -> StreamingResponse:
    checked = _file_path(request, session_id, path)
    opened = services(request).sessions.read_file(session_id, checked, current_tenant())
    download = await opened.__aenter__()
    done = False

    async def release() -> None:
        nonlocal done
        if not done:
            done = True
            await opened.__aexit__(None, None, None)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in download.chunks:
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):
                await release()

    media_type = mimetypes.guess_type(checked.rsplit("/", 1)[-1])[0] or "application/octet-stream"

    headers = {"Content-Length": str(download.size)}
    return _Download(body(), download.cut, release, media_type=media_type, headers=headers)


class _Download(StreamingResponse):
    """A file's bytes, sent until they end or the session does (`cut`): a session that ends stops its
    download wherever it waits, even in a send to a client that does not read; the server then closes
    the connection (the body is short of its Content-Length, so the client knows)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        cut: anyio.Event,
        release: Callable[[], Awaitable[None]],
        *,
        media_type: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._cut = cut
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def cut_when_the_session_ends() -> None:
                    await self._cut.wait()
                    group.cancel_scope.cancel()

                group.start_soon(cut_when_the_session_ends)
                await super().__call__(scope, receive, send)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()


@router.delete("/{session_id}/files/{path:anypath}", summary="Delete a file", responses=error_responses(400, 404, 410))
async def delete_file(session_id: str, path: str, request: Request) -> FileDeleted:
    checked = _file_path(request, session_id, path)
    return await services(request).sessions.delete_file(session_id, checked, current_tenant())


def _file_path(request: Request, session_id: str, decoded: str) -> str:
    """The checked workspace path, percent-decoded exactly once. It is read from the path as the client
    wrote it, so that bytes that are not UTF-8 are refused rather than replaced; the prefix is matched
    segment by segment, decoded, so a prefix written percent-encoded (`ses%5F...`) is found too. If it
    cannot be found (no `raw_path`, or a `%2F` in the prefix), the router's decoded path is checked as
    it is, never decoded a second time."""
    raw: bytes | None = request.scope.get("raw_path")
    if raw is not None:
        segments = raw.split(b"?", 1)[0].split(b"/")
        prefix = [b"sessions", session_id.encode("utf-8", "surrogateescape"), FILES_SEGMENT]
        for at in range(len(segments) - len(prefix)):
            if [unquote_to_bytes(s) for s in segments[at : at + len(prefix)]] == prefix:
                return workspace_path(b"/".join(segments[at + len(prefix) :]))
    return decoded_workspace_path(decoded.encode("utf-8", "surrogateescape"))
