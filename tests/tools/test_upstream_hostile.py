"""Search and embeddings against hostile upstreams: answers that cannot be parsed are 502s, answers are
bounded before they are parsed, and an upstream that echoes a key never delivers it to the caller.

A real service (uvicorn on 127.0.0.1, in this process) and the fake Serper and OpenAI of
`tests.fake_upstreams`, scripted to answer what a hostile or compromised upstream would.
"""

from __future__ import annotations

import base64
import gzip
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaagent.app import create_app
from metaagent.validation import lone_surrogate_at
from tests.conftest import make_settings
from tests.fake_upstreams import OPENAI_KEY, SERPER_KEY, FakeUpstream, Scripted, fake_openai, fake_serper
from tests.live_service import serving
from tests.strategies import openai_answers, serper_answers, upstream_bodies

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[FakeUpstream, FakeUpstream]]:
    with fake_serper() as serper, fake_openai() as openai:
        yield serper, openai


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, upstreams: tuple[FakeUpstream, FakeUpstream]) -> Iterator[str]:
    serper, openai = upstreams
    settings = make_settings(
        tmp_path_factory.mktemp("upstreams"),
        allow_http_hosts='["127.0.0.1"]',
        serper_api_key=SERPER_KEY,
        serper_base_url=serper.url,
        openai_api_key=OPENAI_KEY,
        openai_base_url=openai.url,
        upstream_max_retries=0,
    )
    with serving(create_app(settings)) as url:
        yield url


@pytest.fixture
def serper(upstreams: tuple[FakeUpstream, FakeUpstream]) -> FakeUpstream:
    return upstreams[0]


@pytest.fixture
def openai(upstreams: tuple[FakeUpstream, FakeUpstream]) -> FakeUpstream:
    return upstreams[1]


def search(live: str, **body: Any) -> httpx2.Response:
    return httpx2.post(f"{live}/tools/search", json={"q": "x", **body}, timeout=60)


def embed(live: str, **body: Any) -> httpx2.Response:
    return httpx2.post(f"{live}/tools/embeddings", json={"input": "x", **body}, timeout=60)


def organic(**fields: Any) -> dict[str, Any]:
    return {"organic": [{"title": "t", "link": "https://example.com/", "snippet": "s", **fields}]}


def deep(levels: int) -> bytes:
    return b'{"organic": [], "answerBox": ' + b'{"a": ' * levels + b"1" + b"}" * levels + b"}"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (Scripted(200, b"[" * 50_000 + b"]" * 50_000), "nests too deeply"),
        (Scripted(200, b"[" * 100_000 + b"]" * 100_000), "more than 100000 JSON values"),
        (Scripted(200, deep(40)), "nests deeper than 32 levels"),
        (Scripted(200, b"not gzip", {"Content-Encoding": "gzip"}), "DecodingError"),
        (Scripted(200, gzip.compress(b'{"organic": []}')[:-12] + b"xxxx", {"Content-Encoding": "gzip"}), "malformed"),
        (Scripted(200, b'{"organic": [' + b"{}," * 500_000 + b"{}]}"), "more than 100000 JSON values"),
        (Scripted(200, b'{"organic": [], "answerBox": {"n": 1e400}}'), "out of range"),
        (Scripted(200, b'{"organic": [], "answerBox": {"n": ' + b"9" * 400 + b"}}"), "out of range"),
        (Scripted(200, b'{"organic": [], "answerBox": {"n": NaN}}'), "not a JSON number"),
        (Scripted(200, b'{"organic": [], "answerBox": {"n": -Infinity}}'), "not a JSON number"),
    ],
)
def test_a_search_answer_that_cannot_be_read_within_bounds_is_a_502(
    live: str, serper: FakeUpstream, answer: Scripted, says: str
) -> None:
    serper.script(answer)
    response = search(live)
    assert response.status_code == 502, response.text
    assert says in response.json()["error"]


def test_a_search_answer_past_its_decoded_size_is_refused_while_it_streams(live: str, serper: FakeUpstream) -> None:
    bomb = gzip.compress(b'{"organic": [' + b'{"title": "x", "link": "y"},' * 200_000 + b"{}]}", 9)
    serper.script(Scripted(200, bomb, {"Content-Encoding": "gzip"}))
    response = search(live)
    assert response.status_code == 502
    assert f"more than {4 * 1024 * 1024} bytes (decoded)" in response.json()["error"]


def test_lone_surrogate_escapes_from_serper_are_answered_as_replacement_characters(
    live: str, serper: FakeUpstream
) -> None:
    serper.script(Scripted(200, json.dumps(organic(snippet="bad \udfff text", title="\ud800"))))
    response = search(live)
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["snippet"] == "bad \ufffd text"
    assert response.json()["results"][0]["title"] == "\ufffd"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ({"data": [{"index": 0, "embedding": [10**400]}]}, "out of range"),
        (
            {
                "data": [
                    {"index": 0, "embedding": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}
                ]
            },
            "neither a list of numbers nor base64",
        ),
        ({"data": [{"index": 0, "embedding": [1e400]}]}, "out of range"),
        (
            {"data": [{"index": 0, "embedding": base64.b64encode(struct.pack("<2f", 1.0, float("nan"))).decode()}]},
            "not finite",
        ),
        ({"data": [{"index": 0, "embedding": [0.5] * 17_000}]}, "more than 16384"),
        ({"data": [{"index": 0, "embedding": [0.5] * 20_000}]}, "JSON values"),
        ({"data": [{"index": 0, "embedding": base64.b64encode(b"\0" * 4 * 20_000).decode()}]}, "more than 16384"),
        ({"data": [{"index": 0, "embedding": [0.5, 0.5, 0.5]}]}, "more than 2"),
    ],
)
def test_an_embeddings_answer_out_of_range_is_a_502(
    live: str, openai: FakeUpstream, answer: dict[str, Any], says: str
) -> None:
    openai.script(Scripted(200, json.dumps(answer).replace("Infinity", "1e400").encode()))
    response = embed(live, dimensions=2) if says == "more than 2" else embed(live)
    assert response.status_code == 502, response.text
    assert says in response.json()["error"]


def test_a_huge_vector_is_refused_while_it_streams(live: str, openai: FakeUpstream) -> None:
    body = b'{"data": [{"index": 0, "embedding": [' + b"0.1," * 2_000_000 + b"0.1]}]}"
    openai.script(Scripted(200, gzip.compress(body), {"Content-Encoding": "gzip"}))
    response = embed(live)
    assert response.status_code == 502
    assert "bytes (decoded), more than this answer can need" in response.json()["error"]


# The keys as an upstream could echo them: verbatim, in another case, base64, spaced out, cut short.
def variants(key: str) -> list[str]:
    return [
        key,
        key.upper(),
        base64.b64encode(key.encode()).decode(),
        " ".join(key),
        key[4:],
        f"Bearer {key}",
        "Basic " + base64.b64encode(f"user:{key}".encode()).decode(),
    ]


@pytest.mark.parametrize("variant", variants(SERPER_KEY) + variants(OPENAI_KEY))
@pytest.mark.parametrize("field", ["title", "link", "snippet", "answerBox", "knowledgeGraph", "related", "key"])
def test_a_key_echoed_in_any_field_of_a_search_answer_is_redacted_and_counted(
    live: str, serper: FakeUpstream, field: str, variant: str
) -> None:
    answer: dict[str, Any] = organic()
    if field in ("title", "link", "snippet"):
        answer["organic"][0][field] = f"see {variant} here"
    elif field == "related":
        answer["relatedSearches"] = [{"query": variant}]
    elif field == "key":
        answer["answerBox"] = {variant: "a key as an object key"}
    else:
        answer[field] = {"nested": [{"deeper": variant}]}
    answer["peopleAlsoAsk"] = [{"question": variant}]
    serper.script(Scripted(200, answer))
    response = search(live)
    assert response.status_code == 200, response.text
    for secret in (SERPER_KEY, OPENAI_KEY):
        for form in variants(secret):
            assert form not in response.text
    assert response.json()["redacted"] == 2
    assert "[redacted]" in response.text


def test_an_honest_search_answer_reports_nothing_redacted(live: str) -> None:
    response = search(live, q="model context protocol")
    assert response.status_code == 200
    assert response.json()["redacted"] == 0
    assert response.json()["results"][0]["title"] == "model context protocol result 1"


@pytest.mark.parametrize("variant", variants(OPENAI_KEY) + variants(SERPER_KEY))
def test_a_key_echoed_as_the_embeddings_model_is_redacted_and_counted(
    live: str, openai: FakeUpstream, variant: str
) -> None:
    vector = base64.b64encode(struct.pack("<2f", 0.5, 0.25)).decode()
    openai.script(Scripted(200, {"data": [{"index": 0, "embedding": vector}], "model": variant}))
    response = embed(live)
    assert response.status_code == 200, response.text
    assert response.json()["redacted"] == 1
    assert OPENAI_KEY not in response.text
    assert SERPER_KEY not in response.text
    assert response.json()["data"][0]["embedding"] == [0.5, 0.25]


def test_redaction_is_stated_in_the_openapi_description(tmp_path: Path) -> None:
    description = create_app(make_settings(tmp_path)).openapi()["components"]["schemas"]
    assert "redacted" in description["SearchResponse"]["properties"]
    assert "redacted" in description["EmbeddingsResponse"]["properties"]


def test_a_deeply_nested_embeddings_answer_is_a_502(live: str, openai: FakeUpstream) -> None:
    openai.script(Scripted(200, b'{"data": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"))
    response = embed(live)
    assert response.status_code == 502
    assert "nests too deeply" in response.json()["error"]


# Hypothesis as the hostile upstream: whatever Serper or OpenAI answer, the caller gets a 200 or a 502
# (the documented answer for what an upstream sends), never a 500, and never a key.
ECHOED = tuple(form for key in (SERPER_KEY, OPENAI_KEY) for form in variants(key))
STATUSES = st.sampled_from([200, 200, 200, 201, 400, 404, 500, 503])
UPSTREAM_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def assert_answered_without_a_key(response: httpx2.Response) -> None:
    assert response.status_code in (200, 502), response.text
    body = response.json()
    if response.status_code == 502:
        assert body["error"]
    for secret in (SERPER_KEY, OPENAI_KEY):
        for form in variants(secret):
            assert form not in response.text
    assert lone_surrogate_at(body) is None  # text the caller gets is well-formed


@UPSTREAM_FUZZ
@given(status=STATUSES, answer=upstream_bodies(serper_answers(ECHOED)))
def test_any_serper_answer_is_a_200_or_a_502_without_a_key(
    live: str, serper: FakeUpstream, status: int, answer: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = answer
    serper.script(Scripted(status, body, headers))
    assert_answered_without_a_key(search(live))


@UPSTREAM_FUZZ
@given(status=STATUSES, answer=upstream_bodies(openai_answers(ECHOED)))
def test_any_embeddings_answer_is_a_200_or_a_502_without_a_key(
    live: str, openai: FakeUpstream, status: int, answer: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = answer
    openai.script(Scripted(status, body, headers))
    response = embed(live)
    assert_answered_without_a_key(response)
    if response.status_code == 200:
        assert len(response.json()["data"]) == 1


def test_a_large_honest_embeddings_answer_is_parsed_off_the_event_loop_and_answered(
    live: str, openai: FakeUpstream
) -> None:
    inputs = 80  # 80 vectors of 3072 numbers as JSON lists: over 1 MiB, so parsed in a worker thread
    answer = {"data": [{"index": i, "embedding": [0.5] * 3072} for i in range(inputs)], "model": "m"}
    assert len(json.dumps(answer)) > 1024 * 1024
    openai.script(Scripted(200, answer))
    response = embed(live, input=[f"text {i}" for i in range(inputs)])
    assert response.status_code == 200, response.text[:300]
    assert [len(e["embedding"]) for e in response.json()["data"]] == [3072] * inputs
