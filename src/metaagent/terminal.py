"""The terminal of `metaagent run` and `metaagent repl`: the program's output as it comes, on its own
stream; the tool's own words apart, on stderr, on lines that start with `metaagent: `."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import TextIO

# The marker the service puts at the end of capped output (metaagent.sandbox.output); shown as a line of
# the tool's own, so that the program's stream holds the program's bytes alone.
_MARKER = re.compile(r"\n?\[(output truncated: [^\]\n]*)\]\n?\Z")


class Terminal:
    """An output sink that writes to this process's stdout and stderr.

    Output is capped (50 KiB and 25 KiB), so a pipe that nobody reads cannot block these writes for long.
    A pipe whose reader went away (`metaagent run x.js | head -1`) stops the run, as SIGPIPE stops a
    program in a shell pipeline: `on_reader_gone` is called once, and nothing more is written.
    """

    def __init__(self) -> None:
        self.printed = {"stdout": 0, "stderr": 0}  # characters of each stream printed (of this call)
        self.on_reader_gone: Callable[[], None] = lambda: None
        self.reader_gone = False
        self._line_start = True

    def started(self) -> None:
        pass

    def begin(self) -> None:
        """A new call starts: its output is counted from nothing."""
        self.printed = {"stdout": 0, "stderr": 0}

    @property
    def at_line_start(self) -> bool:
        """Whether the last thing written ended its line."""
        return self._line_start

    def output(self, stream: str, text: str) -> None:
        if self._write(sys.stdout if stream == "stdout" else sys.stderr, text):
            self.printed[stream] += len(text)
            if text:
                self._line_start = text.endswith("\n")

    def finish(self, texts: Mapping[str, str]) -> None:
        """Writes what did not come as it happened: each stream's text past what was printed (all of it
        after a client fell behind), its truncation marker as a line of the tool's own."""
        for stream in ("stdout", "stderr"):
            rest = texts.get(stream, "")[self.printed[stream] :]
            marker = _MARKER.search(rest)
            if body := rest[: marker.start()] if marker else rest:
                self.output(stream, body)
            if marker:
                self.say(marker.group(1).replace("output truncated", f"{stream} truncated", 1))

    def say(self, message: str) -> None:
        """One line of the tool's own on stderr, `metaagent: ` first, never glued to the program's last line."""
        if self._write(sys.stderr, ("" if self._line_start else "\n") + f"metaagent: {message}\n"):
            self._line_start = True

    def _write(self, target: TextIO, text: str) -> bool:
        if self.reader_gone:
            return False
        try:
            target.write(text)
            target.flush()
        except BrokenPipeError:
            self.reader_gone = True
            _discard_further_writes(target)
            self.on_reader_gone()
            return False
        return True


def _discard_further_writes(target: TextIO) -> None:
    """Points the stream at /dev/null, so that what is still buffered cannot fail again at exit."""
    with suppress(OSError, ValueError):  # not a real file (a test's capture): nothing left to fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, target.fileno())
        os.close(devnull)
