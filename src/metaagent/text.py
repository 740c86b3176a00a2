"""The one rule for text that comes out of a sandbox: it is well-formed Unicode before the service holds it.

Everything a sandboxed program says reaches the service's data model through this module: its stdout
and stderr as bytes (`decoder`, `decode`), and a session runner's JSON replies (results, error text,
file listings, refusal messages) as decoded values (`well_formed_json`). From there the same text goes
to JSON answers, Server-Sent Events, MCP and the audit log, none of which has to repair it again, and
none of which can forget to.

The rule is the one JavaScript itself applies when it turns a string into bytes (`TextEncoder`,
`Buffer.from`, `String.prototype.toWellFormed`) and the WHATWG decoder applies to bytes: every code
unit that is not part of a character becomes U+FFFD (REPLACEMENT CHARACTER), and everything else is
kept as it is.

- Bytes: each maximal invalid UTF-8 subsequence becomes one U+FFFD, as `TextDecoder` does; that
  includes the three-byte encoding of a surrogate (`ED A0 80`), which is not UTF-8.
- Decoded JSON: JSON can spell a lone UTF-16 surrogate (`"\\ud800"`), and Python's parser hands it
  over as a `str` that UTF-8 cannot encode: a 500 waiting to happen in whichever face meets it first.
  Each lone surrogate becomes one U+FFFD; a high surrogate followed by a low one is the character they
  encode (as JavaScript reads them). Object keys are made well-formed as well as values.

A surrogate is the only thing a Python `str` can hold that UTF-8 cannot encode, so a well-formed
string encodes everywhere the service writes text. Control characters and NUL are kept: they are
valid Unicode, and JSON escapes them.
"""

from __future__ import annotations

import codecs
from typing import Any

REPLACEMENT = "\ufffd"


def decoder() -> codecs.IncrementalDecoder:
    """An incremental UTF-8 decoder for a stream of sandbox bytes (a character split across chunks is
    held back until it is whole; invalid bytes become U+FFFD)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def decode(data: bytes) -> str:
    """Sandbox bytes as text, invalid UTF-8 replaced."""
    return data.decode("utf-8", errors="replace")


def is_well_formed(text: str) -> bool:
    """True when `text` holds no lone surrogate (so UTF-8 can encode it)."""
    if text.isascii():  # a flag of the string: no scan
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD (and a high-low pair joined into its character)."""
    if is_well_formed(text):
        return text
    # UTF-16 reads a pair as one character and cannot decode a lone surrogate: `replace` gives U+FFFD.
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def well_formed_json(value: Any) -> Any:
    """A decoded JSON value with every string in it (object keys included) made `well_formed`.

    Containers are changed in place and `value` is returned: it is a tree fresh from the parser, which
    nothing else holds yet. Two keys that differ only in their lone surrogates become one (the later
    value wins). Iterative, so no nesting can exhaust Python's stack.
    """
    if isinstance(value, str):
        return well_formed(value)
    pending = [value]
    while pending:
        container = pending.pop()
        if isinstance(container, dict):
            for key in [k for k in container if isinstance(k, str) and not is_well_formed(k)]:
                container[well_formed(key)] = container.pop(key)
            slots: Any = container.items()
        elif isinstance(container, list):
            slots = enumerate(container)
        else:
            continue
        for slot, item in slots:
            if isinstance(item, str):
                if not is_well_formed(item):
                    container[slot] = well_formed(item)  # the same slot: no change of size while iterating
            elif isinstance(item, dict | list):
                pending.append(item)
    return value
