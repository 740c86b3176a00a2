"""The path of a workspace file, as the file routes take it: relative to /workspace, read after
percent-decoding, valid UTF-8, `/`-separated segments of 1..255 bytes, none `.` or `..`, no NUL or
control character (C0, DEL, C1), at most 1024 bytes in all. Anything else is a 400 that says why."""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

from metaagent.errors import RequestRefused

MAX_PATH_BYTES = 1024
MAX_SEGMENT_BYTES = 255


def workspace_path(raw: bytes) -> str:
    """The checked path a percent-encoded request path names; raises RequestRefused (400)."""
    return decoded_workspace_path(unquote_to_bytes(raw))


def decoded_workspace_path(data: bytes) -> str:
    """The checked path of a request path already percent-decoded (it is not decoded again)."""
    if not data:
        raise _refused("it is empty; name a file, e.g. data/input.csv")
    try:
        path = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _refused("it is not valid UTF-8 once percent-decoded") from None
    return checked_path(path)


def checked_path(path: str) -> str:
    """`path` itself when it follows the rules (a decoded path, or one a listing names); raises
    RequestRefused (400)."""
    try:
        data = path.encode("utf-8")
    except UnicodeEncodeError:
        raise _refused("it is not valid UTF-8") from None
    if not data:
        raise _refused("it is empty; name a file, e.g. data/input.csv")
    if len(data) > MAX_PATH_BYTES:
        raise _refused(f"it is {len(data)} bytes long; at most {MAX_PATH_BYTES}")
    if path.startswith("/"):
        raise _refused("it is absolute; paths are relative to /workspace (drop the leading /)")
    for segment in path.split("/"):
        if segment == "":
            raise _refused("it has an empty segment (a doubled or trailing /)")
        if segment in (".", ".."):
            raise _refused(f"it has a {segment!r} segment; name the file itself")
        if len(segment.encode()) > MAX_SEGMENT_BYTES:
            raise _refused(f"a segment is longer than {MAX_SEGMENT_BYTES} bytes")
    control = _CONTROL.search(path)
    if control is not None:
        raise _refused(f"it holds the control character U+{ord(control.group()):04X}")
    return path


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1


def _refused(why: str) -> RequestRefused:
    return RequestRefused(f"Invalid workspace path: {why}")
