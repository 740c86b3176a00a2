"""The demultiplexer of a container's output stream: frames, caps, the runner's ready line and its told end."""

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


TOKEN = "0123456789abcdef" * 2


def told_end(code: int, token: str = TOKEN) -> bytes:
    return b"\0metaagent-end " + token.encode() + b" " + str(code).encode() + b"\n"


def test_the_told_end_is_taken_off_both_streams_even_split_byte_by_byte() -> None:
    demux = Demultiplexer(100, 100)
    demux.expect_end(TOKEN)
    feed_bytewise(demux, frame(STDOUT, b"out\0" + told_end(3)) + frame(STDERR, b"err m"))
    assert demux.told_exit_code is None  # stderr has not told it yet: its output may still be coming
    feed_bytewise(demux, frame(STDERR, b"ore" + told_end(3)))
    assert demux.told_exit_code == 3
    demux.finish()
    assert demux.stdout.text() == "out\0"
    assert demux.stderr.text() == "err more"


def test_bytes_that_only_begin_like_the_end_are_output_once_the_stream_ends() -> None:
    demux = Demultiplexer(100, 100)
    demux.expect_end(TOKEN)
    demux.feed(frame(STDOUT, b"a\0metaagent-e"))
    assert demux.stdout.text() == "a"  # the tail could be the end's beginning: it waits
    demux.finish()
    assert demux.stdout.text() == "a\0metaagent-e"
    assert demux.told_exit_code is None


def test_an_end_with_another_token_or_malformed_is_output_and_ends_nothing() -> None:
    demux = Demultiplexer(1000, 1000)
    demux.expect_end(TOKEN)
    forged = told_end(0, "f" * 32) + told_end(256) + b"\0metaagent-end " + TOKEN.encode() + b" x\n"
    demux.feed(frame(STDOUT, forged) + frame(STDERR, forged))
    demux.finish()
    assert demux.told_exit_code is None
    assert demux.stdout.text() == forged.decode()
    assert demux.stderr.text() == forged.decode()


def test_the_two_streams_must_tell_the_same_code() -> None:
    demux = Demultiplexer(100, 100)
    demux.expect_end(TOKEN)
    demux.feed(frame(STDOUT, told_end(0)) + frame(STDERR, told_end(1)))
    assert demux.told_exit_code is None


def test_many_malformed_ends_in_one_chunk_are_output_without_deep_recursion() -> None:
    demux = Demultiplexer(1 << 20, 100)
    demux.expect_end(TOKEN)
    bad = (b"\0metaagent-end " + TOKEN.encode() + b" 9999\n") * 5000
    demux.feed(frame(STDOUT, bad + told_end(0)) + frame(STDERR, told_end(0)))
    assert demux.told_exit_code == 0
    assert demux.stdout.produced == len(bad)


def test_what_comes_after_the_told_end_is_not_output() -> None:
    demux = Demultiplexer(100, 100)
    demux.expect_end(TOKEN)
    demux.feed(frame(STDOUT, b"x" + told_end(0) + b"after"))
    demux.feed(frame(STDOUT, b"more"))
    demux.finish()
    assert demux.stdout.text() == "x"
