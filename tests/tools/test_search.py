"""The search tool end to end: the app in-process, Serper a fake that speaks its API on 127.0.0.1."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from metaagent.tools._upstream import RetryPolicy
from tests.conftest import ServiceFactory
from tests.fake_upstreams import SERPER_KEY, FakeUpstream, Scripted, fake_serper

LOCAL = '["127.0.0.1"]'


@pytest.fixture
def serper() -> Iterator[FakeUpstream]:
    with fake_serper() as fake:
        yield fake


def configured(serper: FakeUpstream, **overrides: Any) -> dict[str, Any]:
    return {"allow_http_hosts": LOCAL, "serper_api_key": SERPER_KEY, "serper_base_url": serper.url, **overrides}


async def test_search_returns_results_with_title_link_snippet_and_position(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    async with service(**configured(serper)) as client:
        response = await client.post("/tools/search", json={"q": "model context protocol", "num": 3})
    assert response.status_code == 200
    result = response.json()
    assert result["type"] == "search"
    assert [r["position"] for r in result["results"]] == [1, 2, 3]
    first = result["results"][0]
    assert first["title"] == "model context protocol result 1"
    assert first["link"] == "https://example.com/1"
    assert first["snippet"] == "About model context protocol, number 1."


async def test_search_posts_the_query_to_serper_with_the_key_header(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    async with service(**configured(serper)) as client:
        await client.post("/tools/search", json={"q": "weather", "num": 5, "gl": "DE", "hl": "de"})
    (request,) = serper.requests
    assert request.path == "/search"
    assert request.headers["x-api-key"] == SERPER_KEY
    assert request.headers["content-type"] == "application/json"
    assert request.body == {"q": "weather", "num": 5, "gl": "de", "hl": "de"}


async def test_answer_box_knowledge_graph_and_related_searches_are_passed_on(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    async with service(**configured(serper)) as client:
        result = (await client.post("/tools/search", json={"q": "life"})).json()
    assert result["answerBox"] == {"title": "life", "answer": "42", "link": "https://example.com/answer"}
    assert result["knowledgeGraph"]["description"] == "life is a thing."
    assert result["peopleAlsoAsk"][0]["question"] == "What is life?"
    assert result["relatedSearches"] == ["life meaning", "life history"]


async def test_news_search_maps_serpers_news_list(service: ServiceFactory, serper: FakeUpstream) -> None:
    async with service(**configured(serper)) as client:
        result = (await client.post("/tools/search", json={"q": "rust", "type": "news", "num": 2})).json()
    assert serper.requests[0].path == "/news"
    assert result["type"] == "news"
    assert result["results"][1] == {
        "title": "News about rust 2",
        "link": "https://news.example.com/2",
        "snippet": "Today in rust.",
        "position": 2,
        "date": "2 hours ago",
        "source": "Example News",
        "imageUrl": "https://news.example.com/2.jpg",
        "thumbnailUrl": None,
    }
    assert result["answerBox"] is None


async def test_image_search_maps_serpers_images_list(service: ServiceFactory, serper: FakeUpstream) -> None:
    async with service(**configured(serper)) as client:
        result = (await client.post("/tools/search", json={"q": "cats", "type": "images", "num": 1})).json()
    assert serper.requests[0].path == "/images"
    (image,) = result["results"]
    assert image["link"] == "https://img.example.com/page/1"
    assert image["imageUrl"] == "https://img.example.com/1.png"
    assert image["thumbnailUrl"] == "https://thumb.example.com/1.png"
    assert image["snippet"] == ""


async def test_results_without_a_position_are_numbered_in_order(service: ServiceFactory, serper: FakeUpstream) -> None:
    organic = [{"title": "a", "link": "https://a.example"}, {"title": "b", "link": "https://b.example"}]
    serper.script(Scripted(200, {"organic": organic}))
    async with service(**configured(serper)) as client:
        result = (await client.post("/tools/search", json={"q": "x"})).json()
    assert [(r["title"], r["position"]) for r in result["results"]] == [("a", 1), ("b", 2)]


async def test_base_url_with_a_path_prefix_is_honoured(service: ServiceFactory, serper: FakeUpstream) -> None:
    async with service(**configured(serper, serper_base_url=f"{serper.url}/proxy/")) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert serper.requests[0].path == "/proxy/search"
    assert response.status_code == 200


async def test_missing_key_is_a_503_that_names_the_variable(service: ServiceFactory, serper: FakeUpstream) -> None:
    async with service(**configured(serper, serper_api_key=None)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 503
    assert "SERPER_API_KEY" in response.json()["error"]
    assert serper.requests == []


@pytest.mark.security
async def test_blocked_serper_host_returns_400_with_a_hint_and_logs_the_security_line(
    service: ServiceFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with service(allow_http_hosts=LOCAL, serper_api_key=SERPER_KEY) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "Blocked host: google.serper.dev"
    assert body["host"] == "google.serper.dev"
    assert "ALLOW_HTTP_HOSTS" in body["hint"]
    assert [r.getMessage() for r in caplog.records if r.name == "metaagent.security"] == [
        "[SECURITY] Blocked HTTP request to disallowed host: google.serper.dev (POST https://google.serper.dev/search)"
    ]
    record = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
    assert (record["event"], record["tool"], record["host"]) == ("egress.blocked", "search", "google.serper.dev")


async def test_rate_limited_search_is_retried_after_retry_after(service: ServiceFactory, serper: FakeUpstream) -> None:
    serper.script(
        Scripted(429, {"message": "Too many requests", "statusCode": 429}, {"Retry-After": "0"}),
        Scripted(429, {"message": "Too many requests", "statusCode": 429}, {"Retry-After": "0.05"}),
    )
    async with service(**configured(serper)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 200
    assert len(serper.requests) == 3


async def test_server_error_is_retried_with_backoff(service: ServiceFactory, serper: FakeUpstream) -> None:
    serper.script(Scripted(500, {"message": "Internal error", "statusCode": 500}))
    async with service(**configured(serper, upstream_max_retry_wait_s=0.05)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 200
    assert len(serper.requests) == 2


def test_backoff_doubles_with_jitter_and_never_exceeds_the_maximum_wait() -> None:
    policy = RetryPolicy(max_retries=3, max_wait_s=1.5, base_s=0.5)
    no_hint = httpx2.Headers()
    for attempt, ceiling in enumerate([0.5, 1.0, 1.5]):
        for _ in range(50):
            delay = policy.delay(attempt, no_hint)
            assert delay is not None
            assert ceiling / 2 <= delay <= ceiling
    assert policy.delay(3, no_hint) is None  # the retries are used up


def test_retry_after_is_honoured_up_to_the_maximum_wait() -> None:
    policy = RetryPolicy(max_retries=2, max_wait_s=5)
    assert policy.delay(0, httpx2.Headers({"Retry-After": "2"})) == 2
    assert policy.delay(0, httpx2.Headers({"retry-after-ms": "250"})) == 0.25
    assert policy.delay(0, httpx2.Headers({"Retry-After": "3600"})) is None  # give up rather than hold the caller


async def test_persistent_rate_limit_gives_up_after_the_retries_with_serpers_message(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    limited = Scripted(429, {"message": "Rate limit exceeded", "statusCode": 429}, {"Retry-After": "0"})
    serper.script(limited, limited, limited, limited)
    async with service(**configured(serper, upstream_max_retries=2)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == "Serper answered 429 after 3 attempts: Rate limit exceeded"
    assert response.json()["upstream_status"] == 429
    assert len(serper.requests) == 3


async def test_retry_after_longer_than_the_maximum_wait_is_not_waited_for(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    serper.script(Scripted(503, {"message": "Maintenance", "statusCode": 503}, {"Retry-After": "3600"}))
    async with service(**configured(serper, upstream_max_retry_wait_s=5)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == "Serper answered 503: Maintenance"
    assert len(serper.requests) == 1  # given up at once: the hour asked for is past the maximum wait


async def test_rejected_key_is_a_502_with_serpers_message_and_no_retry(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    async with service(**configured(serper, serper_api_key="wrong-key")) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == "Serper answered 403: Unauthorized."
    assert len(serper.requests) == 1


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"<html>Bad gateway</html>", "not JSON"),
        ([1, 2, 3], "expected a JSON object"),
        ({"organic": "nothing"}, "'organic' is not a list"),
        ({"organic": [{"title": "no link"}]}, "no entry of 'organic' has a link"),
    ],
)
async def test_malformed_serper_answer_is_a_502(
    service: ServiceFactory, serper: FakeUpstream, body: Any, why: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    serper.script(Scripted(200, raw))
    async with service(**configured(serper)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == f"Serper sent a malformed response: {why}"


async def test_slow_serper_is_a_504(service: ServiceFactory, serper: FakeUpstream) -> None:
    serper.script(Scripted(200, {"organic": []}, delay_s=2))
    async with service(**configured(serper, upstream_timeout_s=0.3, upstream_max_retries=0)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 504
    assert response.json()["error"] == "Serper did not answer within 0.3 s"


@pytest.mark.security
async def test_redirect_from_serper_is_not_followed_so_the_key_stays_put(
    service: ServiceFactory, serper: FakeUpstream
) -> None:
    serper.script(Scripted(307, b"", {"Location": f"{serper.url}/elsewhere"}))
    async with service(**configured(serper)) as client:
        response = await client.post("/tools/search", json={"q": "x"})
    assert response.status_code == 502
    assert "redirect" in response.json()["error"]
    assert [r.path for r in serper.requests] == ["/search"]


@pytest.mark.security
async def test_serper_key_never_appears_in_responses_logs_or_audit_records(
    service: ServiceFactory, serper: FakeUpstream, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    serper.script(
        Scripted(429, {"message": f"slow down, {SERPER_KEY}"}, {"Retry-After": "0"}),
        Scripted(500, f"internal error for key {SERPER_KEY}", {"Retry-After": "0"}),
        Scripted(500, f"internal error for key {SERPER_KEY}", {"Retry-After": "0"}),
        Scripted(401, {"message": f"Key {SERPER_KEY} is not valid"}),
    )
    bodies = []
    async with service(**configured(serper, upstream_max_retries=2)) as client:
        for _ in range(3):
            bodies.append((await client.post("/tools/search", json={"q": "x"})).text)  # noqa: PERF401 -- awaits in turn
    async with service(allow_http_hosts=LOCAL, serper_api_key=SERPER_KEY) as client:
        bodies.append((await client.post("/tools/search", json={"q": "x"})).text)  # blocked host
    assert "[redacted]" in bodies[0]
    assert "[redacted]" in bodies[1]
    for text in [*bodies, caplog.text, (tmp_path / "audit.jsonl").read_text()]:
        assert SERPER_KEY not in text
        assert SERPER_KEY[:8] not in text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "q"),
        ({"q": ""}, "q"),
        ({"q": "x", "num": 0}, "num"),
        ({"q": "x", "num": 101}, "num"),
        ({"q": "x", "type": "videos"}, "type"),
        ({"q": "x", "gl": "usa"}, "gl"),
        ({"q": "x", "key": "mine"}, "key"),
    ],
)
async def test_invalid_search_fields_get_a_422_naming_the_field(
    service: ServiceFactory, serper: FakeUpstream, body: dict[str, Any], field: str
) -> None:
    async with service(**configured(serper)) as client:
        response = await client.post("/tools/search", json=body)
    assert response.status_code == 422
    assert field in response.json()["error"]
    assert serper.requests == []
