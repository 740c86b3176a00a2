"""The embeddings tool end to end: the app in-process, OpenAI a fake that speaks its API on 127.0.0.1."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metaagent.tools.embeddings import batches
from tests.conftest import ServiceFactory
from tests.fake_upstreams import OPENAI_KEY, FakeUpstream, Scripted, fake_openai, vector_for

LOCAL = '["127.0.0.1"]'


@pytest.fixture
def openai() -> Iterator[FakeUpstream]:
    with fake_openai() as fake:
        yield fake


def configured(openai: FakeUpstream, **overrides: Any) -> dict[str, Any]:
    return {"allow_http_hosts": LOCAL, "openai_api_key": OPENAI_KEY, "openai_base_url": openai.url, **overrides}


async def test_a_single_text_returns_one_embedding(service: ServiceFactory, openai: FakeUpstream) -> None:
    async with service(**configured(openai)) as client:
        response = await client.post("/tools/embeddings", json={"input": "hello world"})
    assert response.status_code == 200
    assert response.json() == {
        "model": "text-embedding-3-small",
        "data": [{"index": 0, "embedding": vector_for("hello world")}],
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
        "redacted": 0,
    }


async def test_request_carries_the_bearer_key_model_and_dimensions(
    service: ServiceFactory, openai: FakeUpstream
) -> None:
    body = {"input": ["a", "b"], "model": "text-embedding-3-large", "dimensions": 6}
    async with service(**configured(openai)) as client:
        response = await client.post("/tools/embeddings", json=body)
    (request,) = openai.requests
    assert request.path == "/v1/embeddings"
    assert request.headers["authorization"] == f"Bearer {OPENAI_KEY}"
    assert request.body == {**body, "encoding_format": "base64"}
    assert response.json()["model"] == "text-embedding-3-large"
    assert [len(d["embedding"]) for d in response.json()["data"]] == [6, 6]


async def test_embeddings_come_back_in_input_order_whatever_order_the_upstream_uses(
    service: ServiceFactory,
) -> None:
    texts = ["first", "second text", "third, longer text"]
    with fake_openai(reverse_order=True) as openai:
        async with service(**configured(openai)) as client:
            result = (await client.post("/tools/embeddings", json={"input": texts})).json()
    assert [d["index"] for d in result["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in result["data"]] == [vector_for(t) for t in texts]


async def test_large_inputs_are_split_into_batches_within_the_upstream_limit(service: ServiceFactory) -> None:
    texts = [f"text number {i}" + "!" * i for i in range(7)]
    with fake_openai(max_inputs=2) as openai:
        async with service(**configured(openai, embeddings_batch_size=2)) as client:
            result = (await client.post("/tools/embeddings", json={"input": texts})).json()
    assert [r.body["input"] for r in openai.requests] == [texts[0:2], texts[2:4], texts[4:6], texts[6:7]]
    assert [d["embedding"] for d in result["data"]] == [vector_for(t) for t in texts]
    assert [d["index"] for d in result["data"]] == list(range(7))
    assert result["usage"] == {"prompt_tokens": 21, "total_tokens": 21}


async def test_batches_also_respect_the_byte_budget(service: ServiceFactory, openai: FakeUpstream) -> None:
    texts = ["a" * 40, "b" * 40, "c" * 40, "d"]
    async with service(**configured(openai, embeddings_batch_max_bytes=100)) as client:
        result = (await client.post("/tools/embeddings", json={"input": texts})).json()
    assert [len(r.body["input"]) for r in openai.requests] == [2, 2]
    assert [d["embedding"] for d in result["data"]] == [vector_for(t) for t in texts]


def test_batching_keeps_order_and_sends_an_oversized_text_alone() -> None:
    texts = ["aa", "é" * 10, "b", "c", "d"]
    assert batches(texts, max_items=3, max_bytes=5) == [slice(0, 1), slice(1, 2), slice(2, 5)]
    assert batches([], max_items=3, max_bytes=5) == []


async def test_plain_float_lists_from_compatible_servers_are_understood(service: ServiceFactory) -> None:
    with fake_openai(plain_floats=True) as openai:
        async with service(**configured(openai)) as client:
            result = (await client.post("/tools/embeddings", json={"input": ["x", "yy"]})).json()
    assert [d["embedding"] for d in result["data"]] == [vector_for("x"), vector_for("yy")]


async def test_missing_key_is_a_503_that_names_the_variable(service: ServiceFactory, openai: FakeUpstream) -> None:
    async with service(**configured(openai, openai_api_key=None)) as client:
        response = await client.post("/tools/embeddings", json={"input": "x"})
    assert response.status_code == 503
    assert "OPENAI_API_KEY" in response.json()["error"]
    assert openai.requests == []


@pytest.mark.security
async def test_blocked_openai_host_returns_400_with_a_hint_and_logs_the_security_line(
    service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async with service(allow_http_hosts=LOCAL, openai_api_key=OPENAI_KEY) as client:
        response = await client.post("/tools/embeddings", json={"input": "x"})
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "Blocked host: api.openai.com"
    assert "ALLOW_HTTP_HOSTS" in body["hint"]
    assert [r.getMessage() for r in caplog.records if r.name == "metaagent.security"] == [
        "[SECURITY] Blocked HTTP request to disallowed host: api.openai.com (POST https://api.openai.com/v1/embeddings)"
    ]


async def test_rate_limit_is_retried_honouring_retry_after_ms(service: ServiceFactory, openai: FakeUpstream) -> None:
    limited = {"error": {"message": "Rate limit reached", "type": "requests"}}
    openai.script(Scripted(429, limited, {"retry-after-ms": "20"}), Scripted(502, "Bad gateway", {"Retry-After": "0"}))
    async with service(**configured(openai)) as client:
        response = await client.post("/tools/embeddings", json={"input": "x"})
    assert response.status_code == 200
    assert len(openai.requests) == 3


async def test_openais_error_message_is_passed_on(service: ServiceFactory, openai: FakeUpstream) -> None:
    message = "This model's maximum context length is 8192 tokens, however you requested 9000 tokens."
    openai.script(Scripted(400, {"error": {"message": message, "type": "invalid_request_error"}}))
    async with service(**configured(openai)) as client:
        response = await client.post("/tools/embeddings", json={"input": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == f"OpenAI answered 400: {message}"
    assert response.json()["upstream_status"] == 400


async def test_persistent_server_errors_end_as_a_502_after_the_retries(
    service: ServiceFactory, openai: FakeUpstream
) -> None:
    failing = Scripted(500, {"error": {"message": "The server had an error"}}, {"Retry-After": "0"})
    openai.script(failing, failing)
    async with service(**configured(openai, upstream_max_retries=1)) as client:
        response = await client.post("/tools/embeddings", json={"input": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == "OpenAI answered 500 after 2 attempts: The server had an error"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("not json", "not JSON"),
        ({"object": "list"}, "expected an object with a 'data' list"),
        ({"data": [{"index": 5, "embedding": [1.0]}]}, "an embedding has no valid index (sent 1 inputs)"),
        ({"data": []}, "1 inputs sent but 0 embeddings returned"),
        ({"data": [{"index": 0, "embedding": "%%%"}]}, "an embedding is not valid base64"),
        ({"data": [{"index": 0, "embedding": ["a"]}]}, "an embedding is neither a list of numbers nor base64"),
    ],
)
async def test_malformed_openai_answer_is_a_502(
    service: ServiceFactory, openai: FakeUpstream, body: Any, why: str
) -> None:
    openai.script(Scripted(200, body))
    async with service(**configured(openai)) as client:
        response = await client.post("/tools/embeddings", json={"input": "x"})
    assert response.status_code == 502
    assert response.json()["error"] == f"OpenAI sent a malformed response: {why}"


@pytest.mark.security
async def test_openai_key_never_appears_in_responses_logs_or_audit_records(
    service: ServiceFactory, openai: FakeUpstream, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    openai.script(Scripted(500, {"error": {"message": f"oops {OPENAI_KEY}"}}, {"Retry-After": "0"}))
    bodies = []
    async with service(**configured(openai)) as client:
        bodies.append((await client.post("/tools/embeddings", json={"input": "x"})).text)
    wrong = OPENAI_KEY[:-1] + "X"  # the fake echoes a wrong key in full, as the real one does in part
    async with service(**configured(openai, openai_api_key=wrong)) as client:
        bodies.append((await client.post("/tools/embeddings", json={"input": "x"})).text)
    async with service(allow_http_hosts=LOCAL, openai_api_key=OPENAI_KEY) as client:
        bodies.append((await client.post("/tools/embeddings", json={"input": "x"})).text)
    assert "Incorrect API key provided: [redacted]" in json.loads(bodies[1])["error"]
    for text in [*bodies, caplog.text, (tmp_path / "audit.jsonl").read_text()]:
        assert OPENAI_KEY not in text
        assert OPENAI_KEY[:8] not in text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "float"}, "encoding_format"),
    ],
)
async def test_invalid_embeddings_fields_get_a_422_naming_the_field(
    service: ServiceFactory, openai: FakeUpstream, body: dict[str, Any], field: str
) -> None:
    async with service(**configured(openai)) as client:
        response = await client.post("/tools/embeddings", json=body)
    assert response.status_code == 422
    assert field in response.json()["error"]
    assert openai.requests == []
