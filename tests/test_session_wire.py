"""The session wire's decoder: whatever bytes the runner's stdout carries (the program shares that
process), only well-formed frames come out, and anything else is a WireError that ends the session."""

from __future__ import annotations

import json
import struct

import pytest

from metaagent.sandbox import session_wire as wire


def frame(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">cI", kind, len(payload)) + payload


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    stream = (
        frame(wire.STDOUT, b"hello ") + frame(wire.REPLY, json.dumps({"id": 7}).encode()) + frame(wire.STDERR, b"x")
    )
    decoder = wire.FrameDecoder()
    for i in range(len(stream)):  # one byte at a time: every split point
        decoder.add(stream[i : i + 1])
    frames = decoder.take()
    assert [(f.kind, f.payload) for f in frames] == [
        (wire.STDOUT, b"hello "),
        (wire.REPLY, b'{"id": 7}'),
        (wire.STDERR, b"x"),
    ]
    assert frames[1].id == 7
    assert decoder.take() == []


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (frame(b"q", b""), "unknown type"),
        (struct.pack(">cI", wire.REPLY, 0xFFFFFFFF), "bytes"),  # a 4 GiB reply: refused from its header
        (b"garbage that is not a frame", "unknown type"),
        (frame(wire.REPLY, b"not json"), "not JSON"),
        (frame(wire.REPLY, b"[1]"), "integer id"),
        (frame(wire.REPLY, b'{"id": "7"}'), "integer id"),
        (frame(wire.END, b'{"id": true}'), "integer id"),
        (frame(wire.REPLY, b"[" * 100_000), "not JSON"),
    ],
)
def test_a_malformed_frame_is_a_wire_error(data: bytes, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.FrameDecoder().add(data)
