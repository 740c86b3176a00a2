"""`metaagent repl`: an interactive JavaScript or Python REPL in a session of a running service.

The input is cut into blocks, one call each:
- on a terminal, in JavaScript a block ends at the end of a line once every bracket, template literal and
  block comment in it is closed, as the Node.js REPL decides for most input (`needs_more`); in Python as
  Python's own REPL decides (`python_needs_more`, by `codeop.compile_command`): a line ending in `:` or
  inside an open bracket or string continues, and a compound statement ends with a blank line. Until then
  the prompt is `... `. `.break` (or Ctrl-C) drops an unfinished block;
- from a pipe or a file, a block is everything up to a blank line.

At the start it names the service it reached (its URL and version, from `GET /health`), or says that
none answers there. Each call's output streams as it comes; then its `result` is printed the way the
language's REPL prints it (JavaScript: `undefined` when the session answers none; Python: the repr, nothing
for None). A Python call's figures (`images`) are saved as files in a temporary folder of this REPL's, kept
after it ends, and each is named on stdout: `[image 1: image/png, 23017 bytes: /tmp/metaagent-repl-.../ses_...-2-1.png]`
(the session, the call's number, the figure's). `.exit` or the end of input closes
the session, and so do Ctrl-C outside a terminal, SIGTERM and SIGHUP. On a terminal, Ctrl-C during a
call interrupts the call (the client hangs up, which the service takes as an interrupt) and the session
keeps its state.
"""

from __future__ import annotations

import ast
import codeop
import signal
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx2

from metaagent.client import Client, Finished, Output, OutputDropped, SessionExecuteResponse
from metaagent.errors import ServiceError
from metaagent.terminal import Terminal

PROMPT = "> "
PYTHON_PROMPT = ">>> "
CONTINUATION = "... "
_EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/svg+xml": ".svg"}
HELP = """.break   drop the unfinished block
.exit    close the session and leave (as does Ctrl-D)
.help    this list"""

_CLOSERS = {"(": ")", "[": "]", "{": "}", "${": "}"}
# After these a `/` starts a regular expression, not a division (the usual heuristic of JavaScript lexers).
_REGEX_AFTER_PUNCTUATION = frozenset("(,=:[!&|?{};+-*%<>~^")
_REGEX_AFTER_WORDS = frozenset(
    {"return", "typeof", "instanceof", "in", "of", "new", "delete", "void", "throw", "case", "do", "else"}
    | {"yield", "await"}
)
_OPEN = -1  # a scan that reached the end of the input inside its token


def needs_more(source: str) -> bool:
    """True while `source` has a bracket, template literal, block comment or continued string still open.

    A closing bracket without its opener is a syntax error: the block is complete, and the service says so.
    """
    stack: list[str] = []  # the open "(", "[", "{", "`" and "${", innermost last
    last = ""  # the last token outside strings and comments: a punctuation character or a word
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if stack and stack[-1] == "`":  # inside a template literal's text
            if c == "\\":
                i += 2
            elif c == "`":
                stack.pop()
                last, i = "`", i + 1
            elif source.startswith("${", i):
                stack.append("${")
                last, i = "{", i + 2
            else:
                i += 1
            continue
        if c.isspace():
            i += 1
        elif source.startswith("//", i):
            end = source.find("\n", i)
            i = n if end < 0 else end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            if end < 0:
                return True
            i = end + 2
        elif c in "'\"" or (c == "/" and (not last or last in _REGEX_AFTER_PUNCTUATION or last in _REGEX_AFTER_WORDS)):
            i = _skip_string(source, i) if c != "/" else _skip_regex(source, i)
            if i == _OPEN:
                return True
            last = c
        elif c == "`":
            stack.append("`")
            i += 1
        elif c in "([{":
            stack.append(c)
            last, i = c, i + 1
        elif c in ")]}":
            if not stack or _CLOSERS[stack.pop()] != c:
                return False
            last, i = c, i + 1
        elif c.isalnum() or c in "_$":
            j = i + 1
            while j < n and (source[j].isalnum() or source[j] in "_$"):
                j += 1
            last, i = source[i:j], j
        else:
            last, i = c, i + 1
    return bool(stack)


# codeop's compiler with top-level await allowed, as the sessions run Python (`async for` at the prompt).
_PYTHON_COMPILER = codeop.CommandCompiler()
_PYTHON_COMPILER.compiler.flags |= ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


def python_needs_more(source: str) -> bool:
    """True while `source` is an unfinished Python statement, as Python's REPL decides: a compound statement
    until a blank line, an open bracket or triple-quoted string. Invalid input is complete: the service says
    what is wrong."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a SyntaxWarning of the user's code is the service's to show
        try:
            return _PYTHON_COMPILER(source.removesuffix("\n"), "<input>", "single") is None
        except (SyntaxError, ValueError, OverflowError):
            return False


@dataclass(frozen=True)
class Dialect:
    """What the REPL does differently per language: its prompt, when a block is complete, and what it shows
    for a call without a result."""

    prompt: str
    needs_more: Callable[[str], bool]
    no_result: str | None  # printed when `result` is null; None: nothing


DIALECTS = {
    "javascript": Dialect(PROMPT, needs_more, "undefined"),
    "python": Dialect(PYTHON_PROMPT, python_needs_more, None),
}


def _skip_string(source: str, start: int) -> int:
    """The index after a quoted string; at a bare newline the string is unterminated (node says so);
    `_OPEN` when a backslash continues it past the end of the input."""
    quote, i = source[start], start + 1
    while i < len(source):
        if source[i] == "\\":
            i += 2
        elif source[i] == quote:
            return i + 1
        elif source[i] == "\n":
            return i
        else:
            i += 1
    return _OPEN


def _skip_regex(source: str, start: int) -> int:
    """The index after a regular expression literal and its flags (at a newline it was none: node says so)."""
    in_class, i = False, start + 1
    while i < len(source):
        c = source[i]
        if c == "\\":
            i += 2
            continue
        if c == "\n":
            return i
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "/":
            i += 1
            while i < len(source) and (source[i].isalnum() or source[i] in "_$"):
                i += 1
            return i
        i += 1
    return len(source)


def piped_blocks(lines: Iterable[str]) -> Iterator[str]:
    """The blocks of input that is not a terminal: each runs up to a blank line; `.exit` ends the input."""
    block: list[str] = []
    for line in lines:
        if line.strip():
            if not block and line.strip() == ".exit":
                return
            block.append(line)
        elif block:
            yield "".join(block)
            block = []
    if block:
        yield "".join(block)


class _Stopped(BaseException):
    """A signal that ends the REPL (SIGTERM, SIGHUP): the session is closed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stopped(signum)


@dataclass
class Repl:
    """One REPL over one session: `run()` reads the blocks, makes the calls, and closes the session."""

    client: Client
    session_config: dict[str, Any]
    timeout_s: int
    interactive: bool
    read_line: Callable[[str], str] = input
    terminal: Terminal = field(default_factory=Terminal)
    session_id: str = ""
    language: str = "javascript"
    calls: int = 0
    images_dir: Path | None = None  # made at the first figure

    @property
    def dialect(self) -> Dialect:
        return DIALECTS[self.language]

    def run(self) -> int:
        """The exit status: 0, the status of a call that ended the session, 1 when the service refused or
        went away, or 128 + the signal that ended the REPL."""
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _stop)
        if not self._connect():
            return 1
        try:
            record = self.client.create_session(**self.session_config)
            self.language = record.language
        except ServiceError as exc:
            self.terminal.say(f"no session: {exc.message}")
            return 1
        except httpx2.TransportError as exc:
            self.terminal.say(f"no session: the service does not answer ({exc})")
            return 1
        self.session_id = record.session_id
        ends = ".exit or Ctrl-D closes it" if self.interactive else "the end of the input closes it"
        self.terminal.say(
            f"session {self.session_id} ({record.language}, memory {record.memory_mb} MiB, "
            f"idle timeout {record.idle_timeout_s} s); {ends}"
        )
        try:
            return self._calls()
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        except _Stopped as stopped:
            return 128 + stopped.signum
        finally:
            self._close()

    def _connect(self) -> bool:
        """Names the service at the client's URL (so that a REPL never talks to the wrong one unawares), or
        says that nothing, or nothing like this service, answers there."""
        url = self.client.base_url
        try:
            health = self.client.health()
        except httpx2.TransportError as exc:
            self.terminal.say(
                f"no service answers at {url} ({exc}); start one with `metaagent serve`, or name it with --url"
            )
            return False
        except ServiceError as exc:
            self.terminal.say(
                f"{url} is not a metaagent service: GET /health answered {exc.status_code}: {exc.message}"
            )
            return False
        version = health.get("version")
        named = f"metaagent {version}" if isinstance(version, str) else "metaagent (version not shown without a key)"
        self.terminal.say(f"connected to {named} at {url}")
        return True

    def _calls(self) -> int:
        blocks = self._terminal_blocks() if self.interactive else piped_blocks(sys.stdin)
        for block in blocks:
            status = self._call(block)
            if status is not None:
                return status
        return 0

    def _terminal_blocks(self) -> Iterator[str]:
        """Blocks typed at the prompt; Ctrl-C drops the unfinished one, and twice on an empty prompt leaves."""
        import readline  # noqa: F401  # line editing and history for input(), on a terminal only

        lines: list[str] = []
        interrupted = False
        while True:
            try:
                line = self.read_line(CONTINUATION if lines else self.dialect.prompt)
            except EOFError:
                sys.stdout.write("\n")
                return
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                if interrupted and not lines:
                    return
                if not lines:
                    self.terminal.say("(to leave, press Ctrl-C again or Ctrl-D, or type .exit)")
                interrupted, lines = not lines, []
                continue
            interrupted = False
            command = line.strip()
            if command in (".exit", ".break", ".help") and (command != ".exit" or not lines):
                if command == ".exit":
                    return
                if command == ".help":
                    print(HELP)
                lines = []
                continue
            lines.append(line + "\n")
            block = "".join(lines)
            if block.strip() and not self.dialect.needs_more(block):
                lines = []
                yield block
            elif not block.strip():
                lines = []

    def _call(self, code: str) -> int | None:
        """Runs one block; None to go on, or the REPL's exit status."""
        self.terminal.begin()
        self.calls += 1
        result: SessionExecuteResponse | None = None
        try:
            for event in self.client.stream_session_execute(self.session_id, code, timeout_s=self.timeout_s):
                if isinstance(event, Output):
                    self.terminal.output(event.stream, event.text)
                elif isinstance(event, OutputDropped):
                    self.terminal.say(event.message)
                elif isinstance(event, Finished):
                    result = event.result
                if self.terminal.reader_gone:
                    return 128 + signal.SIGPIPE
        except KeyboardInterrupt:
            if not self.interactive:
                raise
            self.terminal.output("stderr", "\n")  # past the terminal's ^C
            self.terminal.say("interrupted; the session keeps its state")
            return None
        except ServiceError as exc:
            self.terminal.say(exc.message)
            return 1 if exc.status_code in (404, 410) else None  # the session is gone, or the call was refused
        except httpx2.TransportError as exc:
            self.terminal.say(f"the service does not answer ({exc})")
            return 1
        return self._show(result) if result is not None else None

    def _show(self, result: SessionExecuteResponse) -> int | None:
        """Prints what the stream did not bring, then the result as the language's REPL does, and names the
        saved figures; the status if it ended."""
        self.terminal.finish({"stdout": result.stdout, "stderr": result.stderr})
        if result.exit_code == 0:
            shown = result.result if result.result is not None else self.dialect.no_result
            if shown is not None:
                newline = "" if self.terminal.at_line_start else "\n"
                self.terminal.output("stdout", f"{newline}{shown}\n")
        self._save_images(result)
        if result.timed_out:
            self.terminal.say(f"interrupted at the timeout ({self.timeout_s} s)")
        elif result.killed:
            self.terminal.say("the call was killed")
        if not result.session_ended:
            return 128 + signal.SIGPIPE if self.terminal.reader_gone else None
        try:
            self.client.session_record(self.session_id)
            self.terminal.say("the session ended")
        except (ServiceError, httpx2.TransportError) as exc:  # its 410 names how the session ended
            self.terminal.say(exc.message if isinstance(exc, ServiceError) else "the session ended")
        code = result.exit_code
        return code if code is not None and code != 0 else 1

    def _save_images(self, result: SessionExecuteResponse) -> None:
        """Saves each figure of the call in this REPL's folder and names it on stdout."""
        for number, image in enumerate(result.images, 1):
            if self.images_dir is None:
                self.images_dir = Path(tempfile.mkdtemp(prefix="metaagent-repl-"))
            data = image.decoded()
            path = self.images_dir / f"{self.session_id}-{self.calls}-{number}{_EXTENSIONS.get(image.mime, '')}"
            path.write_bytes(data)
            newline = "" if self.terminal.at_line_start else "\n"
            self.terminal.output("stdout", f"{newline}[image {number}: {image.mime}, {len(data)} bytes: {path}]\n")
        if result.images_truncated:
            self.terminal.say("more figures were left out (at most 8 per call, 4 MiB in all)")

    def _close(self) -> None:
        """Closes the session, whatever ended the REPL; a second Ctrl-C cannot cut this short."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            with suppress(ServiceError, httpx2.TransportError):  # ended already (410), or the service is gone
                self.client.close_session(self.session_id)
                self.terminal.say(f"session {self.session_id} closed")
        finally:
            signal.signal(signal.SIGINT, previous)
