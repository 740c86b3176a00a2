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


def test_a_listener_gets_whole_characters_however_the_bytes_are_split() -> None:
    pieces: list[tuple[str, str]] = []
    demux = Demultiplexer(100, 100)
    demux.listen(lambda stream, text: pieces.append((stream, text)))
    text = "a€🚀 日本"
    for byte in text.encode():  # one frame per byte: every multi-byte character is split across frames
        demux.feed(frame(STDOUT, bytes([byte])))
    demux.finish()
    assert "".join(t for _, t in pieces) == text
    assert all(stream == "stdout" for stream, _ in pieces)
    assert [t for _, t in pieces] == list(text)  # each piece is sent as soon as its character is whole
    assert demux.stdout.text() == text


def test_what_a_listener_got_is_the_buffered_text_without_the_truncation_marker() -> None:
    pieces: list[str] = []
    demux = Demultiplexer(7, 100)
    demux.listen(lambda _stream, text: pieces.append(text))
    demux.feed(frame(STDOUT, "ab€€".encode()))  # 8 bytes: the cap of 7 cuts the second € after 2 of its 3
    demux.finish()
    assert "".join(pieces) == "ab€"
    assert demux.stdout.text() == "ab€\n[output truncated: 8 bytes produced, the first 5 shown]\n"


def test_an_incomplete_character_at_the_end_of_the_stream_is_a_replacement_character_in_both() -> None:
    pieces: list[str] = []
    demux = Demultiplexer(100, 100)
    demux.listen(lambda _stream, text: pieces.append(text))
    demux.feed(frame(STDERR, b"x\xe2\x82"))
    assert demux.stderr.text() == "x\ufffd"  # the buffered answer reads the same before and after the end
    demux.finish()
    assert "".join(pieces) == "x\ufffd" == demux.stderr.text()


def test_a_listener_attached_late_gets_what_was_kept_before_it_first() -> None:
    pieces: list[tuple[str, str]] = []
    demux = Demultiplexer(100, 100)
    demux.feed(frame(STDERR, b"early ") + frame(STDOUT, b"out"))
    demux.listen(lambda stream, text: pieces.append((stream, text)))
    demux.feed(frame(STDERR, b"late"))
    assert pieces == [("stdout", "out"), ("stderr", "early "), ("stderr", "late")]
