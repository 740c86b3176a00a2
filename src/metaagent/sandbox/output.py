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
