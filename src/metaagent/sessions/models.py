"""The session resource's request and answer models: they validate requests and make OpenAPI, the tool
schemas of the session tools (session_create, session_close and the file tools), and the docs."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from metaagent.languages import LanguageName
from metaagent.tools.code_interpreter import (
    DEFAULT_MEMORY_MB,
    LANGUAGE_DESCRIPTION,
    MAX_CODE_BYTES,
    MEMORY_DESCRIPTION,
    NETWORK_DESCRIPTION,
    PACKAGES_DESCRIPTION,
    CodeInterpreterResponse,
    NetworkPolicy,
)
from metaagent.validation import ToolRequest

SessionState = Literal["idle", "busy"]


class SessionCreateRequest(ToolRequest):
    """Open a session: one long-lived, isolated context for several calls, in JavaScript (Node.js 18, the
    default) or Python (language "python": Python 3.11 with numpy, pandas, scipy and matplotlib).

    What one call defines (variables, functions, classes, imports) later calls see; top-level await
    works; each call answers the value of its last expression as `result`, and in Python the matplotlib
    figures it shows (or leaves open) as `images`. The session has a private /workspace (its cwd; upload
    and download files there), and files work inside /workspace and /tmp.
    Run code in it with code_interpreter and its session_id; close it with session_close when done (it
    also ends after idle_timeout_s without a call).
    """

    language: LanguageName = Field(default="javascript", description=LANGUAGE_DESCRIPTION)
    memory_mb: int = Field(default=DEFAULT_MEMORY_MB, ge=64, le=1024, description=MEMORY_DESCRIPTION)
    packages: list[str] = Field(default_factory=list, max_length=16, description=PACKAGES_DESCRIPTION)
    network: NetworkPolicy | None = Field(default=None, description=NETWORK_DESCRIPTION)
    idle_timeout_s: int = Field(
        default=600, ge=10, le=3600, description="The session ends this long (seconds) after its last use."
    )


class SessionRecord(BaseModel):
    session_id: str
    language: LanguageName
    memory_mb: int
    packages: list[str]
    network: NetworkPolicy | None
    idle_timeout_s: int
    created_at: datetime
    last_used_at: datetime
    expires_at: datetime
    state: SessionState
    executions: int


class SessionList(BaseModel):
    sessions: list[SessionRecord]


class SessionExecuteRequest(ToolRequest):
    """Run code in the session's context: its state persists from call to call."""

    code: str = Field(min_length=1, max_length=MAX_CODE_BYTES, description="Source code in the session's language.")
    timeout_s: int = Field(default=8, ge=1, le=300, description="Wall-clock limit of this call in seconds.")


class CallError(BaseModel):
    """Why a call did not complete normally: a thrown error (its own name, message and stack, each at most
    4 KiB), or one of the names Timeout, Killed, OutOfMemory, Exited for a call that did not complete."""

    name: str = Field(
        description="The thrown error's own name (TypeError, ValueError, ...; in JavaScript ThrownValue for a "
        "thrown non-Error), or Timeout, Killed, OutOfMemory or Exited."
    )
    message: str = Field(description="What happened, and what to do about it.")
    stack: str | None = Field(
        default=None, description="The thrown error as printed (in Python, its traceback); null for the other kinds."
    )


class ImageOut(BaseModel):
    mime: str = Field(description="The image's media type, e.g. image/png.")
    data: str = Field(description="The image's bytes, base64.")

    def decoded(self) -> bytes:
        """The image's bytes."""
        return base64.b64decode(self.data)


class SessionExecuteResponse(CodeInterpreterResponse):
    session_id: str
    result: str | None = Field(
        description="The value of the last expression, as the session's language shows it: in JavaScript as the "
        "Node.js REPL does (null for undefined); in Python its repr, as IPython shows it (null for None or no "
        "expression)."
    )
    result_truncated: bool = Field(description="The result is not the whole value (it was cut at the 50 KiB cap).")
    error: CallError | None = Field(description="Null when the call completed normally; otherwise why it did not.")
    images: list[ImageOut] = Field(
        default_factory=list,
        description="Figures the call displayed (at most 8, 4 MiB in all): in Python the matplotlib figures it "
        "showed or left open; always empty in JavaScript.",
    )
    images_truncated: bool = Field(default=False, description="Figures past the limits were left out.")
    session_ended: bool = Field(description="The call ended the session (its process exited, or it was killed).")


def _answer_of_either_kind() -> type[CodeInterpreterResponse]:
    """The answer of the code_interpreter tool, as its output schema states it: a one-shot run's fields, and
    a session call's (with `session_id`) as optional ones, so that a client that builds objects from the
    schema (fastmcp's `.data`) keeps them. Derived from `SessionExecuteResponse`, so the two cannot drift."""
    session_only: dict[str, Any] = {}
    for name, field in SessionExecuteResponse.model_fields.items():
        if name not in CodeInterpreterResponse.model_fields:
            optional = field.annotation | None  # type: ignore[operator]  # an annotation is a type at run time
            session_only[name] = (optional, Field(default=None, description=f"With session_id: {field.description}"))
    answer: type[CodeInterpreterResponse] = create_model(
        "CodeInterpreterAnswer",
        __base__=CodeInterpreterResponse,
        __doc__=CodeInterpreterResponse.__doc__,
        **session_only,
    )
    return answer


CodeInterpreterAnswer = _answer_of_either_kind()


class SessionCloseRequest(ToolRequest):
    """Close a session: its container and workspace are gone once this answers."""

    session_id: str = Field(max_length=64)


class SessionClosed(BaseModel):
    session_id: str
    closed: bool = True


class SessionEnding(SessionClosed):
    """A close whose container removal the engine did not confirm in time (a 202): the session has ended
    (its id answers 410 `closed`) and the service's reaper removes the container."""

    closed: bool = False
    ending: bool = True


class FileWritten(BaseModel):
    path: str
    size: int
    sha256: str


class FileInfo(BaseModel):
    path: str
    size: int
    modified_at: datetime


class FileList(BaseModel):
    files: list[FileInfo]


# The file tools carry a file inside a JSON argument or answer: at most this much, once decoded. Larger
# files go through the file routes, which stream them.
MAX_TOOL_FILE_BYTES = 1024 * 1024
# The longest base64 text of MAX_TOOL_FILE_BYTES bytes (padded), the bound of `content` in a request.
MAX_TOOL_CONTENT_CHARS = -(-MAX_TOOL_FILE_BYTES // 3) * 4

FileEncoding = Literal["utf-8", "base64"]
_ENCODING = "utf-8 for text, base64 for any other bytes."
_PATH = "A file of the workspace, relative to /workspace, e.g. data/input.csv."


class SessionFilesRequest(ToolRequest):
    """List the files of a session's /workspace: every regular file, with its size and time of change,
    sorted by path."""

    session_id: str = Field(max_length=64)


class SessionReadFileRequest(ToolRequest):
    """Read a file of a session's /workspace (at most 1 MiB): as text (utf-8) or as base64 for any other
    bytes, with its size and sha256."""

    session_id: str = Field(max_length=64)
    path: str = Field(min_length=1, max_length=1024, description=_PATH)
    encoding: FileEncoding = Field(default="utf-8", description=_ENCODING)


class SessionWriteFileRequest(ToolRequest):
    """Write a file into a session's /workspace (at most 1 MiB), creating its folders; an existing file is
    replaced. Code in the session then reads it (fs in JavaScript, open() in Python) relative to its cwd
    /workspace."""

    session_id: str = Field(max_length=64)
    path: str = Field(min_length=1, max_length=1024, description=_PATH)
    content: str = Field(max_length=MAX_TOOL_CONTENT_CHARS, description="The file's content, in `encoding`.")
    encoding: FileEncoding = Field(default="utf-8", description=_ENCODING)


class FileContent(BaseModel):
    path: str
    size: int
    sha256: str
    encoding: FileEncoding
    content: str


class FileDeleted(BaseModel):
    path: str
    deleted: bool = True
