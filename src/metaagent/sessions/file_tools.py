"""The workspace as tools (`session_files`, `session_read_file`, `session_write_file`), for a caller that
has only tool calls: an MCP client, a function-calling loop.

Each is the file route it stands for (the same path rules, order with the session's calls, limits and
audit: it calls the same `Sessions` methods); what differs is that the file travels inside JSON, as text
or base64, so it is bounded by `MAX_TOOL_FILE_BYTES`. A file the session holds is not believed either:
its size is checked before its bytes are read, and the bytes are counted as they come.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import AsyncIterator

from metaagent.errors import InvalidRequest, PayloadTooLarge, RequestRefused, Unavailable
from metaagent.sessions.models import (
    MAX_TOOL_FILE_BYTES,
    FileContent,
    FileList,
    FileWritten,
    SessionFilesRequest,
    SessionReadFileRequest,
    SessionWriteFileRequest,
)
from metaagent.sessions.paths import checked_path
from metaagent.sessions.service import Sessions
from metaagent.tenancy import Caller

_MIB = MAX_TOOL_FILE_BYTES // (1024 * 1024)
_PIECE = 64 * 1024  # what one frame of the session's wire carries


async def list_files(sessions: Sessions, request: SessionFilesRequest, caller: Caller) -> FileList:
    return await sessions.list_files(request.session_id, caller)


async def read_bytes(sessions: Sessions, session_id: str, path: str, caller: Caller, *, reader: str) -> bytes:
    """The bytes of a workspace file of at most `MAX_TOOL_FILE_BYTES` (`reader` names the tool or face that
    asks, for the refusal); `path` was checked by the caller (`checked_path`)."""
    async with sessions.read_file(session_id, path, caller) as download:
        if download.size > MAX_TOOL_FILE_BYTES:
            raise RequestRefused(
                f"{path} is {download.size} bytes; {reader} returns at most {_MIB} MiB. Read it in parts with "
                f"code in the session, or download it with GET /sessions/{session_id}/files/{path}"
            )
        pieces: list[bytes] = []
        received = 0
        async for chunk in download.chunks:
            received += len(chunk)
            if received > download.size:  # the session sends more than it announced: not believed
                raise Unavailable(f"Session {session_id} sent more of {path} than its size; retry")
            pieces.append(chunk)
    data = b"".join(pieces)
    if len(data) != download.size:
        raise Unavailable(f"Session {session_id} sent {len(data)} of the {download.size} bytes of {path}")
    return data


async def read_file(sessions: Sessions, request: SessionReadFileRequest, caller: Caller) -> FileContent:
    path = checked_path(request.path)
    data = await read_bytes(sessions, request.session_id, path, caller, reader="session_read_file")
    if request.encoding == "base64":
        content = base64.b64encode(data).decode("ascii")
    else:
        try:
            content = data.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestRefused(
                f"{path} is not valid UTF-8 text; read it with encoding base64 (or download it with "
                f"GET /sessions/{request.session_id}/files/{path})"
            ) from None
    return FileContent(
        path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest(), encoding=request.encoding, content=content
    )


async def write_file(sessions: Sessions, request: SessionWriteFileRequest, caller: Caller) -> FileWritten:
    path = checked_path(request.path)
    data = _decoded(request)
    if len(data) > MAX_TOOL_FILE_BYTES:
        raise PayloadTooLarge(
            f"The content is {len(data)} bytes once decoded; session_write_file takes at most {_MIB} MiB. Upload "
            f"larger files with PUT /sessions/{request.session_id}/files/{path}"
        )

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(data), _PIECE):
            yield data[start : start + _PIECE]

    return await sessions.put_file(request.session_id, path, pieces(), caller)


def _decoded(request: SessionWriteFileRequest) -> bytes:
    if request.encoding == "utf-8":
        return request.content.encode("utf-8")  # well-formed: every request string was checked
    try:
        return base64.b64decode(request.content, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest.for_field(
            "content", "it is not valid base64 (standard alphabet, padded, no line breaks)"
        ) from None
