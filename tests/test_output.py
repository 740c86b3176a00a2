"""The demultiplexer of a container's output stream: frames, caps and the runner's ready line."""

from __future__ import annotations

import struct

from metaagent.sandbox.output import STDERR, STDOUT, Demultiplexer

MARKER = b"metaagent-runner: ready\n"


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxI", stream, len(data)) + data


def feed_bytewise(demux: Demultiplexer, data: bytes) -> None:
    for i in range(len(data)):
        demux.feed(data[i : i + 1])


def test_frames_split_anywhere_reach_their_streams() -> None:
    demux = Demultiplexer(100, 100)
    feed_bytewise(demux, frame(STDOUT, b"out") + frame(STDERR, b"err") + frame(STDOUT, b"put"))
    assert demux.stdout.text() == "output"
    assert demux.stderr.text() == "err"


def test_the_ready_line_is_taken_off_the_stream_even_split_across_frames() -> None:
    demux = Demultiplexer(100, 100, MARKER)
    demux.feed(frame(STDERR, MARKER[:5]))
    assert not demux.ready
    feed_bytewise(demux, frame(STDERR, MARKER[5:] + b"user stderr") + frame(STDOUT, b"user stdout"))
    assert demux.ready
    assert not demux.start_failed
    assert demux.stderr.text() == "user stderr"
    assert demux.stdout.text() == "user stdout"


def test_a_runner_that_fails_before_its_ready_line_keeps_what_it_printed() -> None:
    demux = Demultiplexer(100, 100, MARKER)
    demux.feed(frame(STDERR, b"node: bad option\n"))
    assert demux.start_failed
    assert not demux.ready
    assert demux.stderr.text() == "node: bad option\n"


def test_stdout_before_the_ready_line_is_a_failed_start() -> None:
    demux = Demultiplexer(100, 100, MARKER)
    demux.feed(frame(STDOUT, b"forged"))
    demux.feed(frame(STDERR, MARKER))
    assert demux.start_failed
    assert not demux.ready
    assert demux.stdout.text() == "forged"


def test_caps_count_what_they_drop() -> None:
    demux = Demultiplexer(4, 2)
    demux.feed(frame(STDOUT, b"abcdefgh") + frame(STDERR, b"xyz"))
    assert demux.stdout.produced == 8
    assert demux.stdout.truncated
    assert demux.stdout.text() == "abcd\n[output truncated: 8 bytes produced, the first 4 shown]\n"
    assert demux.stderr.truncated
