"""The one JSON decoder of request bodies: RFC 8259 JSON in UTF-8, read strictly, before any model sees it.

    decode_request_json(body)    the body's value; InvalidRequest (422) that names the field otherwise
    read_request_json(body)      the same, in a worker thread for a large body

Python's `json.loads` is lenient where a request must not be: given bytes it guesses UTF-16 or UTF-32
and skips a byte order mark, a duplicated key silently takes the last value, `NaN` and `Infinity` are
read as numbers, `1e400` becomes infinity, and an integer past 4300 digits raises a bare ValueError
(Python's guard on int-from-text), which the web framework turned into a 400 that named nothing. Here:

    not UTF-8, or a byte order mark     body: ... send JSON encoded as UTF-8
    not JSON, or nested too deeply      body: not valid JSON (...)
    a key given twice                   <path of the key>: given twice
    NaN, Infinity, a number past float  <path>: not a JSON number ...
    an integer of more than 32 digits   <path>: out of range (no field takes an integer that long)
    null as the whole body              body: ... null is not an object

Paths are the fields as the 422 names them (`network.allow.0`). Every HTTP route with a JSON body reads
it here (`metaagent.api.body.StrictJsonRoute`), and so does `/mcp` for its JSON-RPC messages; the request
models then check types strictly (`metaagent.validation.ToolRequest`) and every range.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import anyio.to_thread

from metaagent.errors import InvalidRequest

# No field takes an integer anywhere near this long; past it the text is never turned into an int, so
# a 5000-digit number costs nothing and is refused by name.
MAX_INTEGER_DIGITS = 32
OFFLOAD_BYTES = 256 * 1024

_UTF8_HINT = "send JSON encoded as UTF-8 (RFC 8259)"
_BOMS = (
    (b"\xef\xbb\xbf", "a UTF-8 byte order mark"),
    (b"\x00\x00\xfe\xff", "a UTF-32 byte order mark"),
    (b"\xff\xfe\x00\x00", "a UTF-32 byte order mark"),
    (b"\xfe\xff", "a UTF-16 byte order mark"),
    (b"\xff\xfe", "a UTF-16 byte order mark"),
)


class _Refused:
    """Put in the decoded value where a number cannot be taken; found, with its path, after decoding."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


class _Duplicated(dict[str, Any]):
    """An object in which `key` was given more than once."""

    def __init__(self, pairs: list[tuple[str, Any]], key: str) -> None:
        super().__init__(pairs)
        self.key = key


async def read_request_json(body: bytes) -> Any:
    """`decode_request_json(body)`, in a worker thread when the body is large, so the event loop keeps
    serving other requests while it is read."""
    if len(body) > OFFLOAD_BYTES:
        return await anyio.to_thread.run_sync(decode_request_json, body)
    return decode_request_json(body)


def decode_request_json(body: bytes) -> Any:
    """The value of a JSON request body, read strictly (see the module's docstring)."""
    text = _utf8_text(body)
    refused = False

    def object_of(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal refused
        value = dict(pairs)
        if len(value) == len(pairs):
            return value
        refused = True
        counts = Counter(key for key, _ in pairs)
        return _Duplicated(pairs, next(key for key, _ in pairs if counts[key] > 1))

    def integer(digits: str) -> int | _Refused:
        nonlocal refused
        if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
            refused = True
            return _Refused(
                f"an integer of {len(digits.lstrip('-'))} digits is out of range (no field takes more than "
                f"{MAX_INTEGER_DIGITS} digits); send a number within the field's range"
            )
        return int(digits)

    def number(digits: str) -> float | _Refused:
        nonlocal refused
        value = float(digits)
        if math.isfinite(value):
            return value
        refused = True
        return _Refused("the number is too large to represent (past 1.8e308); send a number within the field's range")

    def constant(name: str) -> _Refused:
        nonlocal refused
        refused = True
        return _Refused(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity); send a finite number")

    try:
        value = json.loads(
            text, object_pairs_hook=object_of, parse_int=integer, parse_float=number, parse_constant=constant
        )
    except json.JSONDecodeError as exc:
        raise _body_error(f"not valid JSON ({exc.msg} at character {exc.pos}); send a JSON object") from None
    except RecursionError:
        raise _body_error("nests arrays or objects too deeply to parse; send flatter JSON") from None
    if refused:
        where, problem = _first_refusal(value)
        raise InvalidRequest.for_field(where, problem)
    if value is None:
        raise _body_error("a JSON object is needed, not null; send {} or no body at all for the defaults")
    return value


def _utf8_text(body: bytes) -> str:
    for mark, name in _BOMS:
        if body.startswith(mark):
            raise _body_error(f"starts with {name}; {_UTF8_HINT}, without a byte order mark")
    # RFC 4627's detection: JSON text starts with two ASCII characters, so NULs among the first four bytes
    # mean UTF-16 or UTF-32 (NUL is valid UTF-8, so decoding alone would not say so).
    if b"\x00" in body[:4]:
        kind = "UTF-32" if body[:4].count(b"\x00") == 3 else "UTF-16"  # one ASCII byte in four
        raise _body_error(f"encoded as {kind}, not UTF-8; {_UTF8_HINT}")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _body_error(f"not valid UTF-8 (at byte {exc.start}: {exc.reason}); {_UTF8_HINT}") from None


def _body_error(problem: str) -> InvalidRequest:
    return InvalidRequest.for_field("body", problem)


def _first_refusal(value: Any) -> tuple[str, str]:
    """The path of the first refused number or repeated key in `value`, and what is wrong there."""
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, _Refused):
            return _name(path), item.problem
        if isinstance(item, _Duplicated):
            return _name((*path, item.key)), "given twice in one object; send each key once"
        if isinstance(item, dict):
            pending.extend(((*path, key), element) for key, element in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend(((*path, i), element) for i, element in reversed(list(enumerate(item))))
    return "body", "refused"  # pragma: no cover -- a refusal is always somewhere in the value


def _name(path: tuple[str | int, ...]) -> str:
    """The path as the 422 names fields; a key of any length is shown by its first `_NAME_CHARS`."""
    parts = (str(part) if len(str(part)) <= _NAME_CHARS else f"{str(part)[:_NAME_CHARS]}..." for part in path)
    return ".".join(parts) or "body"


_NAME_CHARS = 100
