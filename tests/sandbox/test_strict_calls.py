"""Strict-mode calls of every tool: every property present, null where the caller has no value, over
function calling (`POST /tools/{name}`) and MCP, against the real engine and local fake upstreams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client

from metaagent.app import TOOLS
from tests.fake_upstreams import OPENAI_KEY, SERPER_KEY, fake_openai, fake_serper
from tests.sandbox.conftest import Service, running_service
from tests.test_mcp import text_of

pytestmark = pytest.mark.docker

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    """The service with search and embeddings at fake upstreams; the Serper fake also answers `http`."""
    with (
        fake_serper() as serper,
        fake_openai() as openai,
        running_service(
            tmp_path_factory.mktemp("strict"),
            SERPER_API_KEY=SERPER_KEY,
            METAAGENT_SERPER_BASE_URL=serper.url,
            OPENAI_API_KEY=OPENAI_KEY,
            OPENAI_BASE_URL=openai.url,
        ) as running,
    ):
        yield running, serper.url


def every_property(name: str, **given: Any) -> dict[str, Any]:
    """The arguments of a strict-mode call of tool `name`: `given`, and null for every other property."""
    spec = next(spec for spec in TOOLS if spec.name == name)
    properties = spec.function_schema(strict=True)["parameters"]["properties"]
    assert set(given) <= set(properties)
    return {prop: given.get(prop) for prop in properties}


def strict_calls(upstream: str) -> Iterator[tuple[str, dict[str, Any] | Any]]:
    """(tool, arguments) of a whole strict-mode run; a callable argument takes the session id."""
    yield "http", every_property("http", url=f"{upstream}/search")
    yield "search", every_property("search", q="gvisor")
    yield "embeddings", every_property("embeddings", input="a text")
    yield "code_interpreter", every_property("code_interpreter", code="console.log(6 * 7)")
    yield "session_create", every_property("session_create")


def session_calls(session_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("session_write_file", every_property("session_write_file", session_id=session_id, path="in.txt", content="5")),
        (
            "code_interpreter",
            every_property(
                "code_interpreter",
                session_id=session_id,
                code="const n = Number(require('fs').readFileSync('in.txt', 'utf8')); n * 2",
            ),
        ),
        # the session's own values, echoed: a strict model sends the defaults it read in the schema
        (
            "code_interpreter",
            every_property(
                "code_interpreter", session_id=session_id, code="n + 1", language="javascript", memory_mb=256
            ),
        ),
        ("session_files", every_property("session_files", session_id=session_id)),
        ("session_read_file", every_property("session_read_file", session_id=session_id, path="in.txt")),
        ("session_close", every_property("session_close", session_id=session_id)),
    ]


def check_answers(answers: dict[str, list[dict[str, Any]]]) -> None:
    assert answers["http"][0]["status"] == 501  # the Serper fake's answer to a GET: the call reached it
    assert len(answers["search"][0]["results"]) == 10  # num null: the default
    assert len(answers["embeddings"][0]["data"]) == 1
    one_shot, doubled, added = answers["code_interpreter"]
    assert one_shot["stdout"] == "42\n"
    assert (doubled["result"], added["result"]) == ("10", "6")
    assert answers["session_files"][0]["files"][0]["path"] == "in.txt"
    assert answers["session_read_file"][0]["content"] == "5"
    assert answers["session_close"][0]["closed"] is True
    # every tool was called, in strict form
    assert set(answers) == {spec.name for spec in TOOLS}


def test_strict_mode_calls_of_every_tool_over_function_calling(service: tuple[Service, str]) -> None:
    running, upstream = service
    answers: dict[str, list[dict[str, Any]]] = {}

    def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        response = httpx2.post(f"{running.base_url}/tools/{name}", json=arguments, timeout=TIMEOUT_S)
        assert response.status_code in (200, 201), (name, response.text)
        answer: dict[str, Any] = response.json()
        answers.setdefault(name, []).append(answer)
        return answer

    for name, arguments in strict_calls(upstream):
        created = call(name, arguments)
    for name, arguments in session_calls(created["session_id"]):
        call(name, arguments)
    check_answers(answers)


async def test_strict_mode_calls_of_every_tool_over_mcp(service: tuple[Service, str]) -> None:
    running, upstream = service
    answers: dict[str, list[dict[str, Any]]] = {}
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{running.base_url}/mcp") as client:

            async def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                result = await client.call_tool(name, arguments)
                assert result.is_error is False, (name, text_of(result))
                assert result.structured_content is not None
                answers.setdefault(name, []).append(result.structured_content)
                return result.structured_content

            for name, arguments in strict_calls(upstream):
                created = await call(name, arguments)
            for name, arguments in session_calls(created["session_id"]):
                await call(name, arguments)
    check_answers(answers)


def test_a_session_call_with_a_value_other_than_the_sessions_is_a_422_naming_it(service: tuple[Service, str]) -> None:
    running, _ = service
    session_id = running.post("/sessions", {}).json()["session_id"]
    try:
        arguments = every_property("code_interpreter", session_id=session_id, code="1", memory_mb=512)
        response = httpx2.post(f"{running.base_url}/tools/code_interpreter", json=arguments, timeout=TIMEOUT_S)
    finally:
        httpx2.delete(f"{running.base_url}/sessions/{session_id}", timeout=TIMEOUT_S)
    assert response.status_code == 422
    assert "memory_mb" in response.json()["error"]
    assert "256" in response.json()["error"]  # the session's own value


def test_the_strict_calls_here_cover_every_tool() -> None:
    called = {name for name, _ in strict_calls("http://127.0.0.1:9")} | {name for name, _ in session_calls("ses_x")}
    assert called == {spec.name for spec in TOOLS}
