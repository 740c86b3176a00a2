"""Capped capture of a container's multiplexed output stream, and the listeners that see it as it comes.

Without a TTY the engine sends stdout and stderr on one stream in frames: one byte for the stream
(1 = stdout, 2 = stderr), three zero bytes, a big-endian 32-bit length, then that many bytes. We keep at
most `cap` bytes of each stream and count the rest, so the service's memory stays bounded whatever a
program prints.

Each stream's kept bytes are decoded as they arrive, by one incremental UTF-8 decoder, and each piece
of text goes to the listener at once: a character split across frames is held back until it is whole.
The buffered answer is the same pieces joined, so what a listener saw and what the answer says cannot
differ (past the cap the answer adds its truncation marker; a listener never sees it).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from pydantic import BaseModel

from metaagent import text as sandbox_text

STDOUT, STDERR = 1, 2
_HEADER = struct.Struct(">BxxxI")

Stream = Literal["stdout", "stderr"]
# Called with each piece of text that passed the cap, at once and in order within its stream. It runs in
# the task that reads the container's stream: it must not block (hand the text over and return).
OutputListener = Callable[[Stream, str], None]


class OutputSink(Protocol):
    """Where one execution's (or one session call's) output goes while it runs, e.g. to an event stream.

    `started()` says the code has been handed over, so no refusal (400, 404, 410, 422, 429, 503) can
    follow; it is called at most once. `output()` is an `OutputListener`. Output may also come without
    `started()` (a runner that failed to start and said why); neither may block.
    """

    def started(self) -> None: ...

    def output(self, stream: Stream, text: str) -> None: ...


# A call whose output goes to the sink it is given (one execution; one session call), answering with its
# response model: what `metaagent.api.events.event_stream` and `metaagent.progress.with_progress` run.
SinkCall = Callable[[OutputSink], Awaitable[BaseModel]]


class ByteSink(Protocol):
    """Where a stream's raw bytes go: a CappedBuffer, or (for a session) its frame decoder."""

    def add(self, data: bytes) -> None: ...


class CappedBuffer:
    """One stream's first `cap` bytes, as text; `produced` counts every byte, kept or not."""

    def __init__(self, cap: int, stream: Stream = "stdout", listener: OutputListener | None = None) -> None:
        self.cap = cap
        self.stream: Stream = stream
        self.produced = 0
        self.kept_bytes = 0
        self._pieces: list[str] = []
        self._decoder = sandbox_text.decoder()  # the one rule for a sandbox's text
        self._listener = listener
        self._finished = False

    def listen(self, listener: OutputListener | None) -> None:
        """Sends every later piece to `listener`, after what was kept so far (one piece, if any)."""
        self._listener = listener
        kept = "".join(self._pieces)
        if listener is not None and kept:
            listener(self.stream, kept)

    def add(self, data: bytes) -> None:
        room = self.cap - self.kept_bytes
        if room > 0 and data:
            kept = data[:room]
            self.kept_bytes += len(kept)
            self._emit(self._decoder.decode(kept))
        self.produced += len(data)

    def skipped(self, count: int) -> None:
        """`count` more bytes were produced, and dropped before they reached the service."""
        self.produced += count

    def finish(self) -> None:
        """The stream ended: a trailing incomplete character becomes U+FFFD, unless the cap cut it off."""
        if not self._finished and not self.truncated:
            self._emit(self._decoder.decode(b"", final=True))
        self._finished = True

    def _emit(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            if self._listener is not None:
                self._listener(self.stream, text)

    @property
    def truncated(self) -> bool:
        return self.produced > self.cap

    @property
    def shown_bytes(self) -> int:
        """The kept bytes that are whole characters (the cap may cut the last one)."""
        pending, _flag = self._decoder.getstate()
        return self.kept_bytes - len(pending)

    def text(self) -> str:
        """What a listener was sent, joined; with a marker when bytes were dropped."""
        text = "".join(self._pieces)
        if not self.truncated:
            pending, _flag = self._decoder.getstate()  # empty after finish(); before it, what finish() adds
            return text + sandbox_text.decode(pending)
        return f"{text}\n[output truncated: {self.produced} bytes produced, the first {self.shown_bytes} shown]\n"


END_MARKER = b"\0metaagent-end "  # then the execution's end token, a space, the exit code and a newline
_MAX_CODE_DIGITS = 3
_MAX_EXIT_CODE = 255


class EndWatch:
    """One stream's end as the runner tells it: `\\0metaagent-end <token> <code>\\n`, the last bytes the
    runner writes on each stream once its program has exited and been drained.

    The bytes before the marker pass on to `sink` at once, except a tail that could be the marker's
    beginning, which waits for the next bytes (or for `finish`). The marker and whatever follows it
    are not output. A marker with another token, or a malformed one, is output like any other bytes:
    the token is the execution's own, and the program never sees it."""

    def __init__(self, token: str, sink: ByteSink) -> None:
        self._marker = END_MARKER + token.encode("ascii") + b" "
        self._sink = sink
        self._held = b""
        self.code: int | None = None  # the exit code the runner told; None until told

    def add(self, data: bytes) -> None:
        if self.code is not None:
            return  # past the end: a runner writes nothing after it
        data, self._held = self._held + data, b""
        searched = 0
        while (start := data.find(self._marker, searched)) >= 0:
            told = data[start + len(self._marker) :]
            newline = told.find(b"\n", 0, _MAX_CODE_DIGITS + 1)
            if newline < 0 and len(told) <= _MAX_CODE_DIGITS:
                self._pass(data[:start])
                self._held = data[start:]  # the code is still coming
                return
            if newline > 0 and told[:newline].isdigit() and int(told[:newline]) <= _MAX_EXIT_CODE:
                self._pass(data[:start])
                self.code = int(told[:newline])
                return
            searched = start + 1  # malformed: output like the rest
        keep = next(
            (n for n in range(min(len(self._marker) - 1, len(data)), 0, -1) if self._marker.startswith(data[-n:])), 0
        )
        self._pass(data[: len(data) - keep])
        self._held = data[len(data) - keep :]

    def finish(self) -> None:
        """The stream ended without (the rest of) a marker: what was held back is output after all."""
        held, self._held = self._held, b""
        self._pass(held)

    def _pass(self, data: bytes) -> None:
        if data:
            self._sink.add(data)


class Demultiplexer:
    """Feeds raw stream bytes in; routes each frame's payload to the stdout or stderr buffer.

    With `ready_marker`, the stream must begin with those bytes on stderr (the runner's word that node
    is loaded and waiting for its payload, written before any user code exists): they are taken off
    the stream and set `ready`. Anything else first means the runner failed to start (`start_failed`);
    what it printed is then kept as output, so the reason is visible.
    """

    def __init__(self, stdout_cap: int, stderr_cap: int, ready_marker: bytes = b"") -> None:
        self.stdout = CappedBuffer(stdout_cap, "stdout")
        self.stderr = CappedBuffer(stderr_cap, "stderr")
        self._pending = bytearray()
        self._stream = 0
        self._remaining = 0
        self._marker = ready_marker
        self._preamble = bytearray()
        self.ready = not ready_marker
        self.start_failed = False
        self._sinks: tuple[ByteSink, ByteSink] | None = None
        self._ends: tuple[EndWatch, EndWatch] | None = None

    def expect_end(self, token: str) -> None:
        """The runner will tell its program's end on both streams with `token` (see `EndWatch`)."""
        self._ends = (EndWatch(token, self.stdout), EndWatch(token, self.stderr))

    @property
    def told_exit_code(self) -> int | None:
        """The program's exit code once the runner told its end on both streams: all of both streams'
        output has then arrived (each stream keeps its order; the two do not keep theirs between them)."""
        if self._ends is None or self._ends[0].code is None or self._ends[1].code is None:
            return None
        return self._ends[1].code if self._ends[0].code == self._ends[1].code else None

    def _route(self, stream: int, data: bytes) -> None:
        if not self.ready and not self.start_failed:
            if stream == STDERR:
                room = len(self._marker) - len(self._preamble)
                self._preamble += data[:room]
                data = data[room:]
                if not self._marker.startswith(self._preamble):
                    self.start_failed = True
                    self.stderr.add(bytes(self._preamble))
                elif len(self._preamble) == len(self._marker):
                    self.ready = True
            else:
                self.start_failed = True
            if not data:
                return
        if self._sinks is not None:
            self._sinks[1 if stream == STDERR else 0].add(data)
            return
        if self._ends is not None:
            self._ends[1 if stream == STDERR else 0].add(data)
            return
        (self.stderr if stream == STDERR else self.stdout).add(data)

    def redirect(self, stdout: ByteSink, stderr: ByteSink) -> None:
        """From now on, each stream's bytes go to these sinks (a session's frames and raw stderr)."""
        self._sinks = (stdout, stderr)

    def listen(self, listener: OutputListener | None) -> None:
        """Sends both streams' text to `listener` from now on (after what each kept so far)."""
        self.stdout.listen(listener)
        self.stderr.listen(listener)

    def finish(self) -> None:
        """The stream ended: flush what each decoder still holds (see `CappedBuffer.finish`)."""
        for watch in self._ends or ():
            watch.finish()
        self.stdout.finish()
        self.stderr.finish()

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._remaining == 0:
                need = _HEADER.size - len(self._pending)
                self._pending += view[:need]
                view = view[need:]
                if len(self._pending) < _HEADER.size:
                    return
                self._stream, self._remaining = _HEADER.unpack(self._pending)
                self._pending.clear()
                continue
            chunk = view[: self._remaining]
            view = view[len(chunk) :]
            self._remaining -= len(chunk)
            self._route(self._stream, bytes(chunk))
