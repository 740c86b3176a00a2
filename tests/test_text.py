"""The one rule for a sandbox's text (metaagent.text): whatever string comes out, what the service holds
is well-formed Unicode, equal to the input wherever the input was already well-formed, and exactly what
JavaScript's `String.prototype.toWellFormed` makes of it (each lone surrogate one U+FFFD)."""

from __future__ import annotations

import json
from typing import Any

import mcp.types as types
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.sse import format_sse_event
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from metaagent.sandbox import session_wire as wire
from metaagent.sandbox.output import CappedBuffer
from metaagent.sandbox.session_container import CallOutcome
from metaagent.sessions.models import FileInfo, FileList
from metaagent.sessions.service import _response
from metaagent.text import decode, decoder, is_well_formed, loads, well_formed, well_formed_json
from metaagent.validation import lone_surrogate_at
from tests.strategies import any_text

PROPERTY = settings(max_examples=300, deadline=None)


def to_well_formed(text: str) -> str:
    """A reference model: JavaScript's toWellFormed over the string read as UTF-16 code units."""
    out: list[str] = []
    i = 0
    while i < len(text):
        unit = ord(text[i])
        following = ord(text[i + 1]) if i + 1 < len(text) else 0
        if 0xD800 <= unit <= 0xDBFF and 0xDC00 <= following <= 0xDFFF:
            out.append(chr(0x10000 + ((unit - 0xD800) << 10) + (following - 0xDC00)))
            i += 2
            continue
        out.append("\ufffd" if 0xD800 <= unit <= 0xDFFF else text[i])
        i += 1
    return "".join(out)


@PROPERTY
@given(any_text())
def test_any_string_becomes_well_formed_text_as_javascripts_to_well_formed_makes_it(text: str) -> None:
    shown = well_formed(text)
    shown.encode("utf-8")  # never raises
    assert is_well_formed(shown)
    assert shown == to_well_formed(text)
    assert well_formed(shown) == shown


@PROPERTY
@given(st.text())
def test_well_formed_text_is_kept_as_it_is(text: str) -> None:
    assert is_well_formed(text)
    assert well_formed(text) is text


def test_each_lone_surrogate_is_one_replacement_character_and_a_pair_is_its_character() -> None:
    assert well_formed("a\ud800b") == "a\ufffdb"
    assert well_formed("\udc00\ud800") == "\ufffd\ufffd"
    assert well_formed("\ud83d\ude00") == "\U0001f600"
    assert well_formed("\ufeff\ud800") == "\ufeff\ufffd"  # a leading BOM character is text, not a mark
    assert well_formed("\ud800\ud800\udc00\udc00") == "\ufffd\U00010000\ufffd"
    assert well_formed("\ud800" * 100_000) == "\ufffd" * 100_000


def json_trees() -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), any_text(12))
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(any_text(8), inner, max_size=5)),
        max_leaves=30,
    )


def reference_tree(value: Any) -> Any:
    if isinstance(value, str):
        return to_well_formed(value)
    if isinstance(value, list):
        return [reference_tree(item) for item in value]
    if isinstance(value, dict):
        return {to_well_formed(key): reference_tree(item) for key, item in value.items()}
    return value


@PROPERTY
@given(json_trees())
def test_every_string_of_a_decoded_reply_keys_included_becomes_well_formed(value: Any) -> None:
    # As a runner's reply arrives: JSON text with `\\ud800` escapes, read by Python's parser.
    decoded = json.loads(json.dumps(value))
    shown = well_formed_json(decoded)
    json.dumps(shown, ensure_ascii=False).encode("utf-8")  # every face can write it
    assert shown == reference_tree(json.loads(json.dumps(value)))


@PROPERTY
@given(json_trees(), st.booleans())
def test_a_reply_parsed_from_the_runners_bytes_holds_only_well_formed_text(value: Any, escaped: bool) -> None:
    # JSON.stringify escapes a lone surrogate; a forged frame may carry its raw bytes instead.
    text = json.dumps(value, ensure_ascii=escaped)
    shown = loads(text.encode("utf-8", "surrogatepass"))
    assert lone_surrogate_at(shown) is None
    if escaped:
        assert shown == reference_tree(value)


@PROPERTY
@given(st.binary(max_size=200))
def test_any_bytes_parse_to_well_formed_json_or_not_at_all(payload: bytes) -> None:
    try:
        shown = loads(payload)
    except ValueError:
        return
    assert lone_surrogate_at(shown) is None


def test_a_deep_reply_is_made_well_formed_without_exhausting_the_stack() -> None:
    deep: Any = "\ud800"
    for _ in range(100_000):
        deep = [deep]
    shown = well_formed_json(deep)
    for _ in range(100_000):
        shown = shown[0]
    assert shown == "\ufffd"


@PROPERTY
@given(st.binary(), st.integers(min_value=0, max_value=64))
def test_sandbox_bytes_decode_to_well_formed_text_however_they_are_split(data: bytes, split: int) -> None:
    incremental = decoder()
    text = incremental.decode(data[:split]) + incremental.decode(data[split:], final=True)
    assert text == decode(data)
    assert is_well_formed(text)


def test_the_utf8_like_encoding_of_a_surrogate_is_not_text() -> None:
    assert decode(b"a\xed\xa0\x80b") == "a\ufffd\ufffd\ufffdb"  # each invalid byte, as TextDecoder does


# --- every face, from what a runner sends ----------------------------------------------------------------


def reply_frame(message: dict[str, Any]) -> bytes:
    """A runner's REPLY frame as JSON.stringify writes it (a lone surrogate as its `\\ud800` escape)."""
    payload = json.dumps(message).encode()
    return b"r" + len(payload).to_bytes(4, "big") + payload


def faces(model: BaseModel) -> None:
    """Writes `model` as each face does: a JSON answer, an SSE result event, an MCP tool result."""
    JSONResponse(jsonable_encoder(model)).render(jsonable_encoder(model))
    format_sse_event(data_str=model.model_dump_json(), event="result")
    structured = model.model_dump(mode="json")
    text = json.dumps(structured, ensure_ascii=False, indent=2)
    types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured).model_dump_json()


@PROPERTY
@given(any_text(), any_text(), st.binary(max_size=64), st.binary(max_size=64))
def test_whatever_text_a_runner_sends_every_face_can_write_the_answer(
    result: str, path: str, stdout: bytes, stderr: bytes
) -> None:
    decoder = wire.FrameDecoder()
    decoder.add(reply_frame({"id": 2, "status": "ok", "result": result, "result_bytes": 0}))
    decoder.add(reply_frame({"id": 3, "files": [{"path": path, "size": 1, "modified_at": "2026-01-01T00:00:00Z"}]}))
    call, listing = (frame.message or {} for frame in decoder.take())
    out, err = CappedBuffer(1024, "stdout"), CappedBuffer(1024, "stderr")
    out.add(stdout)
    err.add(stderr)
    out.finish()
    err.finish()
    outcome = CallOutcome("ok", out, err, 1, result=call["result"])
    answer = _response("ses_x", "exe_x", outcome, 0, timeout_s=8, memory_mb=256)
    faces(answer)
    assert answer.result == to_well_formed(result)
    files = FileList(files=[FileInfo.model_validate(entry) for entry in listing["files"]])
    faces(files)
    assert files.files[0].path == to_well_formed(path)
