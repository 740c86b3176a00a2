"""Each face speaks its own language: a hint names a tool to a tool caller (MCP, `POST /tools/{name}`) and a
route to a caller of the resource routes (issue 23, item 7); validation messages are plain sentences
without pydantic's prefixes (item 9)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import anyio
import mcp.types as types
import pytest
from mcp import Client
from pydantic import BaseModel, ValidationError, field_validator, model_validator

from metaagent import hints
from metaagent.app import create_app
from metaagent.errors import describe_validation_errors
from tests.conftest import ServiceFactory, make_settings
from tests.live_service import serving

TIMEOUT_S = 30
UNKNOWN = "ses_doesnotexist"
# A route as a hint would name one: a method, a space, a path.
ROUTE = re.compile(r"\b(?:GET|POST|PUT|DELETE) /")


@pytest.fixture
def live_service(tmp_path: Path) -> Iterator[str]:
    with serving(create_app(make_settings(tmp_path))) as url:
        yield url


def text_of(result: types.CallToolResult) -> str:
    (block,) = result.content
    assert isinstance(block, types.TextContent)
    return block.text


def test_every_action_has_a_route_form_and_a_tool_form_that_names_no_route() -> None:
    for action in hints.ACTIONS.values():
        assert ROUTE.match(action.for_face(hints.Face.ROUTES))
        tool_form = action.for_face(hints.Face.TOOLS, session_id="ses_1", path="a.txt")
        assert tool_form.startswith("call ")
        assert not ROUTE.search(tool_form), tool_form


def test_a_hint_names_the_route_by_default_and_the_tool_while_speaking_tools() -> None:
    assert hints.hint(hints.CREATE_SESSION) == "POST /sessions"
    assert hints.hint(hints.LIST_FILES, session_id="ses_1") == "GET /sessions/ses_1/files"
    with hints.speaking(hints.Face.TOOLS):
        assert hints.hint(hints.CREATE_SESSION) == "call session_create"
        assert hints.hint(hints.LIST_FILES, session_id="ses_1") == "call session_files with session_id ses_1"
        assert hints.hint(hints.CLOSE_SESSION) == "call session_close"
        assert hints.hint(hints.RUN_IN_SESSION) == "call code_interpreter with session_id"
        assert hints.hint(hints.READ_FILE, session_id="ses_1", path="a.txt") == (
            "call session_read_file with session_id ses_1 and path a.txt"
        )
    assert hints.hint(hints.CLOSE_SESSION) == "DELETE /sessions/{id}"


async def test_an_unknown_session_over_mcp_is_a_tool_error_that_names_session_create_and_no_route(
    live_service: str,
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{live_service}/mcp") as client:
            run = await client.call_tool("code_interpreter", {"code": "1", "session_id": UNKNOWN})
            close = await client.call_tool("session_close", {"session_id": UNKNOWN})
    for result in (run, close):
        assert result.is_error is True
        assert text_of(result) == f"No session {UNKNOWN!r}; to create one, call session_create"


async def test_an_unknown_session_at_post_tools_by_name_names_session_create_and_no_route(
    service: ServiceFactory,
) -> None:
    async with service() as client:
        run = await client.post("/tools/code_interpreter", json={"code": "1", "session_id": UNKNOWN})
        close = await client.post("/tools/session_close", json={"session_id": UNKNOWN})
    for response in (run, close):
        assert response.status_code == 404
        assert response.json() == {"error": f"No session {UNKNOWN!r}; to create one, call session_create"}


async def test_an_unknown_session_on_the_resource_routes_and_the_older_tool_path_names_the_route(
    service: ServiceFactory,
) -> None:
    async with service() as client:
        execute = await client.post(f"/sessions/{UNKNOWN}/execute", json={"code": "1"})
        record = await client.get(f"/sessions/{UNKNOWN}")
        older = await client.post("/tools/code-interpreter", json={"code": "1", "session_id": UNKNOWN})
    for response in (execute, record, older):
        assert response.status_code == 404
        assert response.json() == {"error": f"No session {UNKNOWN!r}; to create one, POST /sessions"}


async def test_an_unknown_session_in_a_streamed_call_by_name_names_the_tool(service: ServiceFactory) -> None:
    """A streamed call runs in the response's own task, after the route handler returned."""
    async with service() as client:
        response = await client.post(
            "/tools/code_interpreter",
            json={"code": "1", "session_id": UNKNOWN},
            headers={"Accept": "text/event-stream"},
        )
    assert response.status_code == 404
    assert response.json()["error"].endswith("call session_create")


async def test_a_validation_error_over_http_is_a_sentence_naming_the_field_without_pydantic_prefixes(
    service: ServiceFactory,
) -> None:
    async with service() as client:
        response = await client.post("/tools/code-interpreter", json={"code": "1", "timeout_s": 900})
        by_name = await client.post("/tools/code_interpreter", json={"code": "1", "timeout_s": 900, "extra": 1})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Invalid request: timeout_s must be at most 300 (got 900)",
        "details": [{"field": "timeout_s", "message": "timeout_s must be at most 300 (got 900)"}],
    }
    assert by_name.status_code == 422
    assert by_name.json()["error"] == (
        "Invalid request: timeout_s must be at most 300 (got 900); extra is not a field of this request; leave it out"
    )


async def test_a_validation_error_over_mcp_is_the_same_sentence(live_service: str) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{live_service}/mcp") as client:
            result = await client.call_tool("code_interpreter", {"code": "1", "timeout_s": 900})
    assert result.is_error is True
    assert text_of(result) == "Invalid request: timeout_s must be at most 300 (got 900)"


def test_a_validators_own_words_lose_pydantics_value_error_and_assertion_prefixes() -> None:
    class Request(BaseModel):
        a: int = 0
        b: int = 0

        @field_validator("a")
        @classmethod
        def _a(cls, value: int) -> int:
            if value == 1:  # not `assert`: pytest's rewriting would add its own words to the message
                raise AssertionError("a may not be 1")
            return value

        @model_validator(mode="after")
        def _whole(self) -> Request:
            if self.b == 2:
                raise ValueError("memory_mb, packages, language belong to the session")
            return self

    for data, expected in [
        ({"a": 1}, "Invalid request: a is not valid: a may not be 1"),
        ({"b": 2}, "Invalid request: memory_mb, packages, language belong to the session"),
    ]:
        with pytest.raises(ValidationError) as caught:
            Request.model_validate(data)
        message, details = describe_validation_errors(caught.value.errors(), root=())
        assert message == expected
        assert "Value error" not in str(details)
        assert "Assertion failed" not in str(details)
