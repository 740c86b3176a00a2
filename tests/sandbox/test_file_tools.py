"""The file tools (`session_files`, `session_read_file`, `session_write_file`): the file routes as tool
calls, with the file inside JSON as text or base64, bounded at 1 MiB, against the real engine."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import anyio
import httpx2
import mcp
import mcp.types as types
import pytest

from tests.sandbox.conftest import Sessions, audit_records

pytestmark = pytest.mark.docker

MIB = 1024 * 1024


def tool(sessions: Sessions, name: str, **arguments: Any) -> httpx2.Response:
    return sessions.request("POST", f"/tools/{name}", json=arguments)


def test_a_text_file_written_with_the_tool_is_what_code_and_the_file_route_read(sessions: Sessions) -> None:
    session_id = sessions.create()
    text = "city,temp\nLisboa,21\nOslo,4\n"
    written = tool(sessions, "session_write_file", session_id=session_id, path="data/in.csv", content=text)
    seen = sessions.run(session_id, "require('fs').readFileSync('data/in.csv', 'utf8').split('\\n').length")
    downloaded = sessions.request("GET", f"/sessions/{session_id}/files/data/in.csv")
    assert written.status_code == 200, written.text
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert written.json() == {"path": "data/in.csv", "size": len(text), "sha256": digest}
    assert seen["result"] == "4"
    assert downloaded.content == text.encode()
    record = [r for r in audit_records(sessions.service) if r.get("event") == "session.file_written"][-1]
    assert (record["session_id"], record["path"], record["sha256"]) == (session_id, "data/in.csv", digest)


def test_a_file_the_code_wrote_is_read_back_as_text_or_base64_and_listed(sessions: Sessions) -> None:
    session_id = sessions.create()
    sessions.run(session_id, "const fs = require('fs'); fs.writeFileSync('out.txt', 'né'); "
                 "fs.writeFileSync('raw.bin', Buffer.from([0, 255, 128]))")  # fmt: skip
    text = tool(sessions, "session_read_file", session_id=session_id, path="out.txt")
    binary = tool(sessions, "session_read_file", session_id=session_id, path="raw.bin", encoding="base64")
    not_text = tool(sessions, "session_read_file", session_id=session_id, path="raw.bin")
    listing = tool(sessions, "session_files", session_id=session_id)
    assert text.json() == {
        "path": "out.txt", "size": 3, "sha256": hashlib.sha256("né".encode()).hexdigest(),
        "encoding": "utf-8", "content": "né",
    }  # fmt: skip
    assert base64.b64decode(binary.json()["content"]) == bytes([0, 255, 128])
    assert not_text.status_code == 400
    assert "not valid UTF-8" in not_text.json()["error"]
    assert "base64" in not_text.json()["error"]
    assert [(f["path"], f["size"]) for f in listing.json()["files"]] == [("out.txt", 3), ("raw.bin", 3)]


def test_binary_content_round_trips_through_base64(sessions: Sessions) -> None:
    session_id = sessions.create()
    data = bytes(range(256)) * 16
    written = tool(
        sessions, "session_write_file", session_id=session_id, path="b.bin",
        content=base64.b64encode(data).decode(), encoding="base64",
    )  # fmt: skip
    read = tool(sessions, "session_read_file", session_id=session_id, path="b.bin", encoding="base64")
    assert written.json()["size"] == len(data)
    assert base64.b64decode(read.json()["content"]) == data
    assert read.json()["sha256"] == written.json()["sha256"] == hashlib.sha256(data).hexdigest()


def test_the_tools_bound_files_at_one_mib_and_point_to_the_file_routes(sessions: Sessions) -> None:
    session_id = sessions.create()
    exactly = tool(sessions, "session_write_file", session_id=session_id, path="max.txt", content="a" * MIB)
    larger = sessions.request("PUT", f"/sessions/{session_id}/files/big.txt", content=b"a" * (MIB + 1))
    read_larger = tool(sessions, "session_read_file", session_id=session_id, path="big.txt")
    write_larger = tool(
        sessions, "session_write_file", session_id=session_id, path="big2.bin",
        content=base64.b64encode(b"a" * (MIB + 1)).decode(), encoding="base64",
    )  # fmt: skip
    read_exactly = tool(sessions, "session_read_file", session_id=session_id, path="max.txt")
    assert exactly.status_code == 200
    assert larger.status_code == 201
    assert read_larger.status_code == 400
    assert f"GET /sessions/{session_id}/files/big.txt" in read_larger.json()["error"]
    assert write_larger.status_code == 413
    assert "PUT /sessions/" in write_larger.json()["error"]
    assert read_exactly.status_code == 200, read_exactly.text
    assert read_exactly.json()["size"] == MIB
    assert "big2.bin" not in {f["path"] for f in tool(sessions, "session_files", session_id=session_id).json()["files"]}


def test_paths_and_encodings_that_break_the_rules_are_refused_and_write_nothing(sessions: Sessions) -> None:
    session_id = sessions.create()
    for path in ("../escape", "/etc/passwd", "a//b", "x/./y", "nul\x00"):
        answer = tool(sessions, "session_write_file", session_id=session_id, path=path, content="x")
        assert answer.status_code == 400, (path, answer.text)
        assert "path" in answer.json()["error"].lower()
    bad_base64 = tool(
        sessions, "session_write_file", session_id=session_id, path="b.bin", content="not base64!", encoding="base64"
    )
    missing = tool(sessions, "session_read_file", session_id=session_id, path="nowhere.txt")
    unknown_session = tool(sessions, "session_files", session_id="ses_nope")
    assert bad_base64.status_code == 422
    assert "base64" in bad_base64.json()["error"]
    assert missing.status_code == 404
    assert unknown_session.status_code == 404
    assert tool(sessions, "session_files", session_id=session_id).json()["files"] == []


def test_after_close_the_file_tools_answer_410(sessions: Sessions) -> None:
    session_id = sessions.create()
    sessions.close(session_id)
    answer = tool(sessions, "session_read_file", session_id=session_id, path="x")
    assert answer.status_code == 410
    assert answer.json()["reason"] == "closed"


async def test_workspace_files_are_mcp_resources_of_the_callers_sessions(sessions: Sessions) -> None:
    session_id = sessions.create()
    tool(sessions, "session_write_file", session_id=session_id, path="data/notes é.txt", content="hello")
    sessions.request("PUT", f"/sessions/{session_id}/files/raw.bin", content=bytes([0, 255]))
    base = f"metaagent://sessions/{session_id}/files"
    with anyio.fail_after(60):
        async with mcp.Client(f"{sessions.service.base_url}/mcp") as client:
            templates = (await client.list_resource_templates()).resource_templates
            listed = (await client.list_resources()).resources
            text = (await client.read_resource(f"{base}/data/notes%20%C3%A9.txt")).contents
            blob = (await client.read_resource(f"{base}/raw.bin")).contents
            with pytest.raises(mcp.MCPError) as missing:
                await client.read_resource(f"{base}/nowhere.txt")
            with pytest.raises(mcp.MCPError) as escaping:
                await client.read_resource(f"{base}/../../etc/passwd")
            with pytest.raises(mcp.MCPError) as unknown:
                await client.read_resource("metaagent://sessions/ses_nope/files/x")
    assert [t.uri_template for t in templates] == ["metaagent://sessions/{session_id}/files/{path}"]
    assert listed == []  # listing every session's files would be a use of each (see workspace_resources)
    assert isinstance(text[0], types.TextResourceContents)
    assert (text[0].text, text[0].mime_type) == ("hello", "text/plain")
    assert isinstance(blob[0], types.BlobResourceContents)
    assert base64.b64decode(blob[0].blob) == bytes([0, 255])
    assert missing.value.error.code == -32002
    assert "No file" in missing.value.error.message
    assert escaping.value.error.code == types.INVALID_PARAMS
    assert unknown.value.error.code == -32002
    assert "session_create" in unknown.value.error.message  # the hint names the tool, as over MCP


@pytest.mark.parametrize("abandon", ["tool refusal", "client hang-up"])
def test_a_read_abandoned_before_the_files_end_leaves_the_session_serving_the_next_request(
    sessions: Sessions, abandon: str
) -> None:
    # The rest of the abandoned file still comes over the session's wire; the next request must not meet it.
    session_id = sessions.create()
    sessions.request("PUT", f"/sessions/{session_id}/files/big.bin", content=b"b" * (4 * MIB))
    sessions.request("PUT", f"/sessions/{session_id}/files/small.txt", content=b"small")
    for _ in range(3):
        if abandon == "tool refusal":  # over 1 MiB: refused once its size is known, its bytes unread
            assert tool(sessions, "session_read_file", session_id=session_id, path="big.bin").status_code == 400
        else:
            url = f"{sessions.service.base_url}/sessions/{session_id}/files/big.bin"
            with httpx2.stream("GET", url, timeout=120) as response:
                next(response.iter_bytes())  # the first piece only, then hang up
        small = sessions.request("GET", f"/sessions/{session_id}/files/small.txt")
        assert (small.status_code, small.content) == (200, b"small"), small.text
    assert sessions.run(session_id, "1 + 1")["result"] == "2"
