"""`metaagent.Client` and `metaagent.AsyncClient` against the real service on 127.0.0.1, and against mocks."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

import metaagent
import metaagent.client
from metaagent.app import TOOLS, create_app
from metaagent.client import (
    CodeInterpreterResponse,
    EmbeddingsResponse,
    ExecutionInfo,
    ExecutionList,
    HttpResponse,
    ImageOut,
    KillResult,
    SearchResponse,
    SessionExecuteResponse,
    SessionRecord,
)
from metaagent.errors import MetaAgentError, ServiceError
from tests.conftest import make_settings
from tests.fake_upstreams import OPENAI_KEY, SERPER_KEY, fake_openai, fake_serper, vector_for
from tests.live_service import serving


@pytest.fixture
def live_service(tmp_path: Path) -> Iterator[str]:
    """The service with search and embeddings pointed at fake upstreams, all on 127.0.0.1."""
    with fake_serper() as serper, fake_openai() as openai:
        settings = make_settings(
            tmp_path,
            allow_http_hosts='["127.0.0.1"]',
            serper_api_key=SERPER_KEY,
            serper_base_url=serper.url,
            openai_api_key=OPENAI_KEY,
            openai_base_url=openai.url,
        )
        with serving(create_app(settings)) as url:
            yield url


def test_client_round_trips_tools_health_http_search_and_embeddings(live_service: str, upstream: str) -> None:
    with metaagent.Client(live_service) as client:
        tools = client.tools()["tools"]
        health = client.health()
        fetched = client.http(f"{upstream}/echo", "POST", headers={"X-A": "1"}, body="hi", timeout_s=10)
        found = client.search("mcp", num=2, type="news")
        embedded = client.embeddings(["a", "bb"], dimensions=3)
        routed = client.call_tool("search", {"q": "mcp", "num": 1})
    assert [t["name"] for t in tools] == [spec.name for spec in TOOLS]
    assert health["status"] in ("ok", "degraded")
    assert isinstance(fetched, HttpResponse)
    assert fetched.status == 200
    assert json.loads(fetched.body)["body"] == "hi"
    assert isinstance(found, SearchResponse)
    assert [r.link for r in found.results] == ["https://news.example.com/1", "https://news.example.com/2"]
    assert isinstance(embedded, EmbeddingsResponse)
    assert [d.embedding for d in embedded.data] == [vector_for("a", 3), vector_for("bb", 3)]
    assert len(routed["results"]) == 1  # call_tool answers the JSON as it came, for the model


async def test_async_client_round_trips_tools_health_http_search_and_embeddings(
    live_service: str, upstream: str
) -> None:
    async with metaagent.AsyncClient(live_service) as client:
        tools = (await client.tools())["tools"]
        health = await client.health()
        fetched = await client.http(f"{upstream}/hello")
        found = await client.search("mcp", num=3)
        embedded = await client.embeddings("hello")
        executions = await client.executions()
    assert {"http", "search", "embeddings"} <= {t["name"] for t in tools}
    assert "checks" in health
    assert fetched.body == "hello from upstream"
    assert [r.position for r in found.results] == [1, 2, 3]
    assert found.answerBox is not None
    assert found.answerBox["answer"] == "42"
    assert [(d.index, d.embedding) for d in embedded.data] == [(0, vector_for("hello"))]
    assert executions == ExecutionList(executions=[])


def test_an_error_status_raises_service_error_with_the_status_and_the_services_message(live_service: str) -> None:
    with metaagent.Client(live_service) as client, pytest.raises(ServiceError) as caught:
        client.http("https://malicious.com/api")
    assert caught.value.status_code == 400
    assert caught.value.message == "Blocked host: malicious.com"
    assert caught.value.extra == {"host": "malicious.com"}
    assert isinstance(caught.value, MetaAgentError)
    assert isinstance(caught.value, metaagent.client.Refused)


async def test_an_unknown_execution_raises_a_404_service_error(live_service: str) -> None:
    async with metaagent.AsyncClient(live_service) as client:
        with pytest.raises(ServiceError) as missing:
            await client.execution("no-such-execution")
        with pytest.raises(ServiceError) as not_killed:
            await client.kill_execution("no-such-execution")
    assert (missing.value.status_code, not_killed.value.status_code) == (404, 404)
    assert isinstance(missing.value, metaagent.client.NotFound)
    assert missing.value.message


def test_invalid_arguments_raise_a_422_service_error_naming_the_field(live_service: str) -> None:
    with metaagent.Client(live_service) as client, pytest.raises(ServiceError) as caught:
        client.search("x", num=1000)
    assert caught.value.status_code == 422
    assert "num" in caught.value.message


Captured = list[httpx2.Request]


def mocked(captured: Captured, status: int = 200, answer: Any = None) -> httpx2.MockTransport:
    def handle(request: httpx2.Request) -> httpx2.Response:
        captured.append(request)
        return httpx2.Response(status, json={"ok": True} if answer is None else answer)

    return httpx2.MockTransport(handle)


RAN = {
    "execution_id": "exe_1",
    "exit_code": 0,
    "stdout": "1\n",
    "stderr": "",
    "stdout_truncated": False,
    "stderr_truncated": False,
    "timed_out": False,
    "oom_killed": False,
    "duration_ms": 5,
}
FETCHED = {
    "status": 200,
    "headers": {},
    "body": "",
    "encoding": "utf-8",
    "truncated": False,
    "url": "https://x.example",
}
EMBEDDED = {"model": "m", "data": [{"index": 0, "embedding": [0.5]}], "usage": {"prompt_tokens": 1, "total_tokens": 1}}
OPENED = {
    "session_id": "ses_1",
    "language": "python",
    "memory_mb": 256,
    "packages": [],
    "network": None,
    "idle_timeout_s": 60,
    "created_at": "2026-12-01T15:45:19Z",
    "last_used_at": "2026-12-01T15:45:19Z",
    "expires_at": "2026-12-01T15:46:19Z",
    "state": "idle",
    "executions": 0,
}
RUNNING = {
    "execution_id": "a/b",
    "container_id": None,
    "started_at": "2026-12-01T15:45:19Z",
    "timeout_s": 8,
    "memory_mb": 256,
    "state": "running",
}


@pytest.mark.parametrize(
    ("call", "method", "path", "body", "answer", "model"),
    [
        (
            lambda c: c.http("https://x.example"),
            "POST",
            "/tools/http",
            {"url": "https://x.example"},
            FETCHED,
            HttpResponse,
        ),
        (
            lambda c: c.code_interpreter("console.log(1)", timeout_s=5, packages=["lodash"]),
            "POST",
            "/tools/code-interpreter",
            {"code": "console.log(1)", "timeout_s": 5, "packages": ["lodash"]},
            RAN,
            CodeInterpreterResponse,
        ),
        (
            lambda c: c.code_interpreter("print(1)", language="python"),
            "POST",
            "/tools/code-interpreter",
            {"code": "print(1)", "language": "python"},
            RAN,
            CodeInterpreterResponse,
        ),
        (
            lambda c: c.create_session(language="python", idle_timeout_s=60),
            "POST",
            "/sessions",
            {"language": "python", "idle_timeout_s": 60},
            OPENED,
            SessionRecord,
        ),
        (
            lambda c: c.call_tool("code_interpreter", {"code": "1"}),
            "POST",
            "/tools/code_interpreter",
            {"code": "1"},
            RAN,
            dict,
        ),
        (
            lambda c: c.search("q", gl="de"),
            "POST",
            "/tools/search",
            {"q": "q", "gl": "de"},
            {"type": "search", "results": []},
            SearchResponse,
        ),
        (
            lambda c: c.embeddings("t", model="m"),
            "POST",
            "/tools/embeddings",
            {"input": "t", "model": "m"},
            EMBEDDED,
            EmbeddingsResponse,
        ),
        (lambda c: c.tools(), "GET", "/tools", None, {"tools": []}, dict),
        (lambda c: c.health(), "GET", "/health", None, {"status": "ok"}, dict),
        (lambda c: c.executions(), "GET", "/executions", None, {"executions": [RUNNING]}, ExecutionList),
        (lambda c: c.execution("a/b"), "GET", "/executions/a%2Fb", None, RUNNING, ExecutionInfo),
        (
            lambda c: c.kill_execution("e1"),
            "DELETE",
            "/executions/e1",
            None,
            {"execution_id": "e1", "killed": True},
            KillResult,
        ),
    ],
)
def test_each_method_sends_the_documented_request_and_answers_the_services_model(
    call: Any, method: str, path: str, body: dict[str, Any] | None, answer: dict[str, Any], model: type[Any]
) -> None:
    captured: Captured = []
    with metaagent.Client("http://service.test", transport=mocked(captured, answer=answer)) as client:
        result = call(client)
    assert type(result) is model
    assert result == (answer if model is dict else model.model_validate(answer))
    (request,) = captured
    assert (request.method, request.url.raw_path.decode()) == (method, path)
    assert (json.loads(request.content) if request.content else None) == body


def test_fields_a_newer_service_adds_are_ignored_and_a_malformed_answer_is_a_502_service_error() -> None:
    newer = {**RAN, "images": [], "a_field_of_tomorrow": 1}
    with metaagent.Client("http://service.test", transport=mocked([], answer=newer)) as client:
        assert client.code_interpreter("1").stdout == "1\n"
    malformed = metaagent.Client("http://service.test", transport=mocked([], answer={"exit_code": "x"}))
    with malformed, pytest.raises(ServiceError) as caught:
        malformed.code_interpreter("1")
    assert caught.value.status_code == 502
    assert "execution_id" in caught.value.message


def test_a_python_session_call_answers_its_figures_as_typed_images_and_its_error_as_a_call_error() -> None:
    png = b"\x89PNG\r\n\x1a\nfigure"
    answer = {
        **RAN,
        "exit_code": 1,
        "session_id": "ses_1",
        "result": None,
        "result_truncated": False,
        "error": {"name": "ValueError", "message": "bad", "stack": "Traceback (most recent call last):\n..."},
        "images": [{"mime": "image/png", "data": base64.b64encode(png).decode()}],
        "images_truncated": False,
        "session_ended": False,
    }
    with metaagent.Client("http://service.test", transport=mocked([], answer=answer)) as client:
        ran = client.session_execute("ses_1", "plt.show(); raise ValueError('bad')")
    assert isinstance(ran, SessionExecuteResponse)
    assert ran.error is not None
    assert ran.error.name == "ValueError"
    (image,) = ran.images
    assert isinstance(image, ImageOut)
    assert (image.mime, image.decoded()) == ("image/png", png)


async def test_the_async_client_answers_the_same_models() -> None:
    transport = httpx2.MockTransport(lambda _request: httpx2.Response(200, json=RAN))
    async with metaagent.AsyncClient("http://service.test", transport=transport) as client:
        ran = await client.code_interpreter("1")
        routed = await client.call_tool("code_interpreter", {"code": "1"})
    assert ran == CodeInterpreterResponse.model_validate(RAN)
    assert routed == RAN


@pytest.mark.security
async def test_the_api_key_is_sent_as_a_bearer_token() -> None:
    captured: Captured = []
    async with metaagent.AsyncClient("http://service.test", api_key="k-123", transport=mocked(captured)) as client:
        await client.health()
    assert captured[0].headers["authorization"] == "Bearer k-123"
    with metaagent.Client("http://service.test", transport=mocked(captured)) as anonymous:
        anonymous.health()
    assert "authorization" not in captured[1].headers


def test_an_error_without_a_json_body_still_raises_service_error() -> None:
    def handle(_request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(502, text="<html>Bad Gateway</html>")

    client = metaagent.Client("http://service.test", transport=httpx2.MockTransport(handle))
    with client, pytest.raises(ServiceError) as caught:
        client.health()
    assert caught.value.status_code == 502
    assert "Bad Gateway" in caught.value.message


def test_import_metaagent_stays_cheap_until_a_client_is_asked_for() -> None:
    probe = (
        "import sys, metaagent; "
        "print(sorted(m for m in ('httpx2', 'fastapi', 'mcp', 'metaagent.client') if m in sys.modules)); "
        "metaagent.Client; print('metaagent.client' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split("\n")[:2] == ["[]", "True"]


@pytest.mark.security
async def test_a_client_without_arguments_reads_metaagent_url_and_metaagent_api_key(
    live_service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("METAAGENT_URL", live_service)
    monkeypatch.delenv("METAAGENT_API_KEY", raising=False)
    with metaagent.Client() as client:
        assert client.health()["status"] in ("ok", "degraded")
    captured: Captured = []
    monkeypatch.setenv("METAAGENT_API_KEY", "k-from-env")
    with metaagent.Client(transport=mocked(captured)) as from_env:
        from_env.health()
    async with metaagent.AsyncClient("http://service.test", api_key="k-given", transport=mocked(captured)) as given:
        await given.health()
    assert captured[0].url.host == "127.0.0.1"
    assert captured[0].headers["authorization"] == "Bearer k-from-env"
    assert captured[1].headers["authorization"] == "Bearer k-given"  # what is given wins over the environment


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (404, {"error": "No session 'x'"}, "NotFound"),
        (410, {"error": "Session s has ended: idle", "reason": "idle"}, "SessionEnded"),
        (429, {"error": "At capacity", "retry_after_s": 3}, "RateLimited"),
        (413, {"error": "Too large"}, "PayloadTooLarge"),
        (507, {"error": "The workspace is full"}, "WorkspaceFull"),
        (400, {"error": "Blocked host: x"}, "Refused"),
        (403, {"error": "Forbidden"}, "Refused"),
        (422, {"error": "Invalid request: code: required"}, "Refused"),
        (503, {"error": "The container engine is unavailable"}, "Unavailable"),
        (401, {"error": "Missing API key"}, "ServiceError"),
    ],
)
def test_each_error_status_raises_the_service_error_that_names_its_meaning(
    status: int, body: dict[str, Any], kind: str
) -> None:
    client = metaagent.Client("http://service.test", transport=mocked([], status, body))
    with client, pytest.raises(ServiceError) as caught:
        client.health()
    assert type(caught.value).__name__ == kind
    assert (caught.value.status_code, caught.value.message) == (status, body["error"])
    if kind == "SessionEnded":
        assert caught.value.reason == "idle"  # type: ignore[attr-defined]  # the subclass checked above
    if kind == "RateLimited":
        assert caught.value.retry_after == 3.0  # type: ignore[attr-defined]  # the subclass checked above


def test_a_network_failure_raises_the_transport_error_the_client_module_exports() -> None:
    with metaagent.Client("http://127.0.0.1:9") as client, pytest.raises(metaagent.client.TransportError):
        client.health()
