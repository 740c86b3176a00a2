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


@pytest.mark.security
def test_a_reply_holding_lone_surrogates_comes_out_as_well_formed_text() -> None:
    # What JSON.stringify sends for a result of new Error('\ud800'), a forged listing, a refusal's message;
    # and the raw three bytes of a surrogate, which Python's JSON parser would take as one.
    reply = (
        b'{"id": 3, "status": "ok", "result": "Error: \\ud800", "files": [{"path": "a\\udc00.txt", "size": 1}],'
        b' "message": "x\xed\xa0\x80y", "\\udfff": ["\\ud83d\\ude00", "\\ude00\\ud83d"]}'
    )
    decoder = wire.FrameDecoder()
    decoder.add(frame(wire.REPLY, reply))
    (decoded,) = decoder.take()
    assert decoded.message == {
        "id": 3,
        "status": "ok",
        "result": "Error: \ufffd",
        "files": [{"path": "a\ufffd.txt", "size": 1}],
        "message": "x\ufffd\ufffd\ufffdy",  # bytes that are not UTF-8, as in stdout: one U+FFFD each
        "\ufffd": ["\U0001f600", "\ufffd\ufffd"],
    }
    json.dumps(decoded.message, ensure_ascii=False).encode("utf-8")  # every face can write it
