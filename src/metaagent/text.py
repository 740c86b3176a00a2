"""The one rule for text that comes out of a sandbox: it is well-formed Unicode before the service holds it.

Everything a sandboxed program says reaches the service's data model through this module: its stdout
and stderr as bytes (`decoder`, `decode`), and a session runner's JSON replies (results, error text,
file listings, refusal messages) as they are parsed (`loads`, which walks a reply with
`well_formed_json` only when its text holds a surrogate's escape). From there the same text goes
to JSON answers, Server-Sent Events, MCP and the audit log, none of which has to repair it again, and
none of which can forget to.

The rule is the one JavaScript itself applies when it turns a string into bytes (`TextEncoder`,
`Buffer.from`, `String.prototype.toWellFormed`) and the WHATWG decoder applies to bytes: every code
unit that is not part of a character becomes U+FFFD (REPLACEMENT CHARACTER), and everything else is
kept as it is.

- Bytes: each maximal invalid UTF-8 subsequence becomes one U+FFFD, as `TextDecoder` does; the
  three-byte encoding of a surrogate (`ED A0 80`) is not UTF-8, and gives three.
- Decoded JSON: JSON can spell a lone UTF-16 surrogate (`"\\ud800"`), and Python's parser hands it
  over as a `str` that UTF-8 cannot encode: a 500 waiting to happen in whichever face meets it first.
  Each lone surrogate becomes one U+FFFD; a high surrogate followed by a low one is the character they
  encode (as JavaScript reads them). Object keys are made well-formed as well as values.

A surrogate is the only thing a Python `str` can hold that UTF-8 cannot encode, so a well-formed
string encodes everywhere the service writes text. Control characters and NUL are kept: they are
valid Unicode, and JSON escapes them.

Cost: a reply without a surrogate's escape costs one regular-expression scan on top of parsing (a
listing of 10,000 files: the same time as `json.loads`, within noise); one whose every string holds a
lone surrogate about five times the parse, linear in its size, which the frame cap bounds.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONE_SURROGATE = re.compile("[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]")
# The only way a surrogate gets into JSON text that is valid UTF-8: a `\uD800`-`\uDFFF` escape. (A
# match may be a pair, or an escaped backslash before `ud800`: the walk then finds nothing to replace.)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def decoder() -> codecs.IncrementalDecoder:
    """An incremental UTF-8 decoder for a stream of sandbox bytes (a character split across chunks is
    held back until it is whole; invalid bytes become U+FFFD)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def decode(data: bytes) -> str:
    """Sandbox bytes as text, invalid UTF-8 replaced."""
    return data.decode("utf-8", errors="replace")


def is_well_formed(text: str) -> bool:
    """True when `text` holds no surrogate (so UTF-8 can encode it)."""
    return text.isascii() or _SURROGATE.search(text) is None  # isascii: a flag of the string, no scan


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD (and a high-low pair joined into its character)."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _repaired(text)


def _repaired(text: str) -> str:
    # One pass in C, however many there are (a codec's error handler would be called for each): every
    # surrogate that is not half of a high-low pair becomes U+FFFD; then UTF-16 joins the pairs left.
    text = _LONE_SURROGATE.sub(REPLACEMENT, text)
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")


def loads(payload: bytes) -> Any:
    """JSON that a sandbox sent, with every string well-formed. Raises ValueError (and RecursionError)
    as `json.loads` does.

    Bytes that are not UTF-8 become U+FFFD first (Python's parser would otherwise take a surrogate's
    raw bytes, or guess UTF-16 from NUL bytes); then only an escape can spell a surrogate, and a reply
    without one (the usual case) is not walked at all.
    """
    text = decode(payload)
    value = json.loads(text)
    if _SURROGATE_ESCAPE.search(text) is None:
        return value
    return well_formed_json(value)


def well_formed_json(value: Any) -> Any:
    """A decoded JSON value with every string in it (object keys included) made `well_formed`.

    Containers are changed in place and `value` is returned: it is a tree fresh from the parser, which
    nothing else holds yet. A replaced key moves to the end of its object, and two keys that differ only
    in their lone surrogates become one (the later value wins). Iterative, so no nesting can exhaust
    Python's stack. (The checks are inlined: this walk runs on the event loop, over replies of up to
    `session_wire.MAX_FRAME`.)
    """
    if isinstance(value, str):
        return well_formed(value)
    search = _SURROGATE.search
    pending = [value]
    while pending:
        container = pending.pop()
        if isinstance(container, dict):
            for key, item in list(container.items()):  # a snapshot: keys may be replaced on the way
                if isinstance(item, str):
                    if not item.isascii() and search(item):
                        container[key] = _repaired(item)
                elif isinstance(item, dict | list):
                    pending.append(item)
                if isinstance(key, str) and not key.isascii() and search(key):
                    container[_repaired(key)] = container.pop(key)
        elif isinstance(container, list):
            for index, item in enumerate(container):
                if isinstance(item, str):
                    if not item.isascii() and search(item):
                        container[index] = _repaired(item)
                elif isinstance(item, dict | list):
                    pending.append(item)
    return value
