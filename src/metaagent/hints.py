"""The next step an error message suggests, named in the language of the face the caller came through.

A caller of the resource routes (`/sessions/...`, `/executions/...`, the older `/tools/code-interpreter`)
speaks HTTP and is pointed at a route ("to create one, POST /sessions"). A model calling tools, over MCP
or function calling (`POST /tools/{name}`), can call only tools and is pointed at a tool ("to create
one, call session_create"). Messages name an `Action` through `hint()`; the face is a context variable
that the MCP call handler and the by-name tool routes set (`speaking(Face.TOOLS)`) around the work they run,
so a message raised deep in `metaagent.sessions` reads right for whoever asked.

    ROUTES (the default)   "POST /sessions", "GET /sessions/ses_1/files"
    TOOLS                  "call session_create", "call session_files with session_id ses_1"

Files past the file tools' 1 MiB have no tool: a hint about those names the HTTP route on every face.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


class Face(enum.Enum):
    ROUTES = "routes"
    TOOLS = "tools"


@dataclass(frozen=True)
class Action:
    """One thing a hint may point to: its route (a template over `{session_id}` and `{path}`; what is not
    known stays a placeholder) and its tool, with the arguments the hint names when their values are
    known (`required` ones are named even when not: `code_interpreter` is a session call only with one)."""

    route: str
    tool: str
    arguments: tuple[str, ...] = ()
    required: tuple[str, ...] = ()

    def for_face(self, face: Face, **ids: str) -> str:
        if face is Face.ROUTES:
            return self.route.format(**{"session_id": "{id}", "path": "{path}", **ids})
        named = [
            f"{name} {ids[name]}" if name in ids else name
            for name in self.arguments
            if name in ids or name in self.required
        ]
        return f"call {self.tool}" + (f" with {' and '.join(named)}" if named else "")


CREATE_SESSION = Action("POST /sessions", "session_create")
CLOSE_SESSION = Action("DELETE /sessions/{session_id}", "session_close", ("session_id",))
RUN_IN_SESSION = Action(
    "POST /sessions/{session_id}/execute", "code_interpreter", ("session_id",), required=("session_id",)
)
LIST_FILES = Action("GET /sessions/{session_id}/files", "session_files", ("session_id",))
READ_FILE = Action("GET /sessions/{session_id}/files/{path}", "session_read_file", ("session_id", "path"))
WRITE_FILE = Action("PUT /sessions/{session_id}/files/{path}", "session_write_file", ("session_id", "path"))
DELETE_FILE = Action(  # no tool deletes a file: the session's own code can
    "DELETE /sessions/{session_id}/files/{path}", "code_interpreter", ("session_id",), required=("session_id",)
)

# Every action a hint may name, by what it does.
ACTIONS: dict[str, Action] = {
    "create a session": CREATE_SESSION,
    "close a session": CLOSE_SESSION,
    "run code in a session": RUN_IN_SESSION,
    "list a session's files": LIST_FILES,
    "read a file": READ_FILE,
    "write a file": WRITE_FILE,
    "delete a file": DELETE_FILE,
}

_face: ContextVar[Face] = ContextVar("metaagent_face", default=Face.ROUTES)


def current_face() -> Face:
    return _face.get()


@contextmanager
def speaking(face: Face) -> Iterator[None]:
    """Messages raised inside name actions in `face`'s language (tasks started inside inherit it)."""
    token = _face.set(face)
    try:
        yield
    finally:
        _face.reset(token)


def hint(action: Action, **ids: str) -> str:
    """`action` as the current caller can take it: a route, or a tool call."""
    return action.for_face(_face.get(), **ids)
