"""The wire between the service and a session's supervisor (runner/supervisor.js says the same from its
side).

Frames, both ways: one type byte, a 32-bit big-endian length, then that many bytes. Requests go on the
container's stdin; the supervisor's frames come on its stdout. The program runs in a child of the
supervisor and holds no descriptor of this wire, but the service trusts the container no more for that:
every frame is checked here (a known type, a bounded length, no empty output frame, JSON that is an
object with an integer id), and the session's reader holds each output window to what the caps keep.
Anything else is a `WireError`, and the session it came from is ended; a frame can only ever confuse
its own session.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from metaagent import text as sandbox_text

HEADER = struct.Struct(">cI")
CHUNK = 1024 * 1024  # file bytes per frame, both ways (FILE_CHUNK in supervisor.js)
# The longest frame the runner may send: a listing of 10,000 files fits, with room.
MAX_FRAME = 8 * 1024 * 1024

STDOUT, STDERR, REPLY, FILE, DATA, END = b"o", b"e", b"r", b"f", b"d", b"z"
_JSON_TYPES = frozenset({REPLY, FILE, END})
_KNOWN = frozenset({STDOUT, STDERR, REPLY, FILE, DATA, END})

EXECUTE, INTERRUPT, PUT, ABORT, GET, LIST, DELETE = b"x", b"i", b"p", b"a", b"g", b"l", b"D"


class WireError(Exception):
    """The runner's stream broke the protocol."""


def encode(kind: bytes, payload: bytes | bytearray) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def request(kind: bytes, **fields: Any) -> bytes:
    return encode(kind, json.dumps(fields, ensure_ascii=False).encode())


def data_frames(chunk: bytes | bytearray) -> list[bytes]:
    """File bytes as DATA frames of at most CHUNK bytes each."""
    return [encode(DATA, chunk[i : i + CHUNK]) for i in range(0, len(chunk), CHUNK)]


# A JSON frame longer than this (a listing of thousands of files) is parsed off the event loop, by its
# reader (`Frame.deferred`, `message_of`), so that one large reply does not hold every other caller.
LARGE_MESSAGE = 256 * 1024


@dataclass(frozen=True)
class Frame:
    kind: bytes
    payload: bytes
    message: dict[str, Any] | None = None  # the decoded JSON of REPLY, FILE and END frames
    deferred: bool = False  # a large JSON frame, not parsed yet: `message_of(payload)` parses it

    @property
    def id(self) -> int | None:
        return None if self.message is None else int(self.message["id"])


class FrameDecoder:
    """Turns the runner's stdout bytes into frames (`add` them as they come, `take` the frames complete so
    far); raises WireError. A byte sink for the Demultiplexer's stdout."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._frames: list[Frame] = []

    def take(self) -> list[Frame]:
        frames, self._frames = self._frames, []
        return frames

    def add(self, data: bytes) -> None:
        self._pending += data
        while len(self._pending) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._pending)
            if kind not in _KNOWN:
                raise WireError(f"a frame of unknown type {kind!r}")
            if length > MAX_FRAME:
                raise WireError(f"a frame of {length} bytes")
            if length == 0 and kind in (STDOUT, STDERR):
                raise WireError("an empty output frame")
            end = HEADER.size + length
            if len(self._pending) < end:
                return
            payload = bytes(self._pending[HEADER.size : end])
            del self._pending[:end]
            if kind not in _JSON_TYPES:
                self._frames.append(Frame(kind, payload))
            elif length > LARGE_MESSAGE:
                self._frames.append(Frame(kind, payload, deferred=True))
            else:
                self._frames.append(Frame(kind, payload, _message(payload)))


def message_of(payload: bytes) -> dict[str, Any]:
    """The checked JSON object of a deferred frame; raises WireError."""
    return _message(payload)


def _message(payload: bytes) -> dict[str, Any]:
    try:
        message = sandbox_text.loads(payload)  # JSON with the one rule for a sandbox's text (text.py)
    except (ValueError, RecursionError):
        raise WireError("a reply that is not JSON") from None
    if not isinstance(message, dict) or type(message.get("id")) is not int:
        raise WireError("a reply without an integer id")
    return message
