"""Logging set-up: human lines by default, JSON lines on request; everything goes to stderr.

Security lines (`[SECURITY] ...`) are written exactly as the seed shows them in text mode, so that
operators can grep for them; in JSON mode they are the `message` field.

No log line can be forged. Callers control much of what is logged (URLs, paths, hosts, headers, tool
arguments, and whatever third-party libraries such as the MCP SDK or uvicorn quote from a request), so
the escaping is done once, by the formatters, for every record of every logger, in both formats:
`escape_for_log` turns every character that some reader takes for a line break, or that the output
encoding cannot carry, into a visible escape. A record is therefore always exactly one line, plus, for
an exception, its traceback lines, each indented: a line that starts in column 0 always starts a record.
Access lines (uvicorn's) never carry a query string, which is where credentials travel in URLs.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from metaagent.disconnects import DropHangUpTracebacks

# Every character some reader (a terminal, `str.splitlines`, a browser, a JSON viewer) ends a line at, or
# that hides text: C0 controls, DEL, C1 controls (NEL is U+0085), the Unicode line and paragraph
# separators. Lone surrogates are escaped too: UTF-8 cannot carry them, and a write would fail.
_LINE_BREAKERS = frozenset("\u2028\u2029")
ACCESS_LOGGER = "uvicorn.access"
_TRACEBACK_INDENT = "    "


def escape_for_log(text: str) -> str:
    """The one escaping of caller-controlled text in logs: a visible escape for each control, line
    separator and lone surrogate, and a doubled backslash, so that an escape can never be faked."""
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text  # the common case, at C speed
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif ch in _LINE_BREAKERS or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def _traceback_lines(text: str) -> list[str]:
    """A traceback as indented lines, each escaped: an exception's message cannot start a log line."""
    return [_TRACEBACK_INDENT + escape_for_log(line) for line in text.rstrip("\n").split("\n")]


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = escape_for_log(record.getMessage())
        line = message if record.name == "metaagent.security" else f"{record.levelname.lower()}: {message}"
        if record.exc_info:
            line = "\n".join([line, *_traceback_lines(self.formatException(record.exc_info))])
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            # The same text as the text format's, so that both formats say the same thing.
            "message": escape_for_log(record.getMessage()),
        }
        if record.exc_info:
            entry["exception"] = "\n".join(_traceback_lines(self.formatException(record.exc_info)))
        return json.dumps(entry, ensure_ascii=False)


class DropQueryString(logging.Filter):
    """Cuts the query string off uvicorn's access lines: `?api_key=...` must not reach the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def formatter(log_format: str) -> logging.Formatter:
    return _JsonFormatter() if log_format == "json" else _TextFormatter()


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    handler.addFilter(DropHangUpTracebacks())  # a hang-up is one info line, never a traceback
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, DropQueryString) for f in access.filters):
        access.addFilter(DropQueryString())
