"""Workspace files as MCP resources: `metaagent://sessions/{session_id}/files/{path}`.

A client that shows resources (or lets its model read them) reads a session's file by that URI, with the
same rules as the `session_read_file` tool: the caller's own session only, the workspace path rules,
at most 1 MiB, in order with the session's calls. A file that is UTF-8 comes as text, any other as a
blob. The template is listed (`resources/templates/list`); `resources/list` is empty, because listing
the files of every open session would be a call into each of them, and a call is a use that keeps a
session from idling out: the `session_files` tool lists one session's files when asked.
"""

from __future__ import annotations

import base64
import mimetypes
import re
from urllib.parse import unquote

import mcp.types as types

from metaagent.errors import RequestRefused
from metaagent.sessions.file_tools import read_bytes
from metaagent.sessions.paths import checked_path
from metaagent.sessions.service import Sessions
from metaagent.tenancy import Caller

TEMPLATE = types.ResourceTemplate(
    name="workspace_file",
    title="A file of a session's workspace",
    uri_template="metaagent://sessions/{session_id}/files/{path}",
    description="A file of a session's /workspace (at most 1 MiB): text if it is UTF-8, else a blob. The path "
    "is relative to /workspace, its segments percent-encoded; list the files with the session_files tool.",
)
_URI = re.compile(r"metaagent://sessions/(?P<session_id>[^/]{1,64})/files/(?P<path>.+)", re.DOTALL)


async def read(sessions: Sessions, uri: str, caller: Caller) -> types.ReadResourceResult:
    match = _URI.fullmatch(uri)
    if match is None:
        raise RequestRefused(f"Not a workspace file: {uri!r}; its URI is {TEMPLATE.uri_template}")
    try:
        path = unquote(match["path"], errors="strict")
    except UnicodeDecodeError:
        raise RequestRefused(f"The path of {uri!r} is not valid UTF-8 once percent-decoded") from None
    session_id = match["session_id"]
    data = await read_bytes(sessions, session_id, checked_path(path), caller, reader="a resource read")
    mime = mimetypes.guess_type(path.rsplit("/", 1)[-1])[0]
    contents: types.TextResourceContents | types.BlobResourceContents
    try:
        contents = types.TextResourceContents(uri=uri, mime_type=mime or "text/plain", text=data.decode("utf-8"))
    except UnicodeDecodeError:
        blob = base64.b64encode(data).decode("ascii")
        contents = types.BlobResourceContents(uri=uri, mime_type=mime or "application/octet-stream", blob=blob)
    return types.ReadResourceResult(contents=[contents])
