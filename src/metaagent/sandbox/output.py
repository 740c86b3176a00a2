"""Capped capture of a container's multiplexed output stream.

Without a TTY the engine sends stdout and stderr on one stream in frames: one byte for the stream
(1 = stdout, 2 = stderr), three zero bytes, a big-endian 32-bit length, then that many bytes. We keep at
most `cap` bytes of each stream and count the rest, so the service's memory stays bounded whatever a
program prints.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Protocol

STDOUT, STDERR = 1, 2
_HEADER = struct.Struct(">BxxxI")


class ByteSink(Protocol):
    def add(self, data: bytes) -> None: ...


@dataclass
class CappedBuffer:
    cap: int
    kept: bytearray = field(default_factory=bytearray)
    produced: int = 0

    def add(self, data: bytes) -> None:
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.produced += len(data)

    @property
    def truncated(self) -> bool:
        return self.produced > self.cap

    def text(self) -> str:
        """The kept bytes as text, cut on a UTF-8 boundary, with a marker when bytes were dropped."""
        data = bytes(self.kept)
        if not self.truncated:
            return data.decode("utf-8", errors="replace")
        cut = utf8_boundary(data)
        text = data[:cut].decode("utf-8", errors="replace")
        return f"{text}\n[output truncated: {self.produced} bytes produced, the first {cut} shown]\n"


def utf8_boundary(data: bytes) -> int:
    """The length of `data` without a trailing, incomplete UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # ASCII or the lead byte of a multi-byte character
            need = 1 if byte < 0x80 else _char_length(byte)
            return len(data) - back if need > back else len(data)
    return len(data)


def _char_length(lead: int) -> int:
    if lead >= 0xF0:
        return 4
    if lead >= 0xE0:
        return 3
    return 2


class Demultiplexer:
    """Feeds raw stream bytes in; routes each frame's payload to the stdout or stderr buffer.

    With `ready_marker`, the stream must begin with those bytes on stderr (the runner's word that node
    is loaded and waiting for its payload, written before any user code exists): they are taken off
    the stream and set `ready`. Anything else first means the runner failed to start (`start_failed`);
    what it printed is then kept as output, so the reason is visible.
    """

    def __init__(self, stdout_cap: int, stderr_cap: int, ready_marker: bytes = b"") -> None:
        self.stdout = CappedBuffer(stdout_cap)
        self.stderr = CappedBuffer(stderr_cap)
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
