"""Bad input on every endpoint: a clear 4xx JSON answer, never a 5xx, and bodies past the limit refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from metaagent.app import TOOLS, create_app
from tests.conftest import ServiceFactory, make_settings
from tests.live_service import serving
from tests.test_mcp import MCP_HEADERS

TOOL_PATHS = [spec.path for spec in TOOLS if spec.path is not None]
LIMIT = 64 * 1024

# (name, body, content type, status, a phrase the message must hold)
BAD_BODIES = [
    ("malformed_json", b'{"url": "https://x.example", ', "application/json", 422, "not valid JSON"),
    (
        "invalid_utf8",
        b'{"url": "\xff\xfe", "code": "\xc3\x28", "q": "\xff", "input": "\xff"}',
        "application/json",
        400,
        "not valid UTF-8",
    ),
    (
        "wrong_types",
        b'{"url": 5, "code": 5, "q": 5, "input": 5, "timeout_s": "soon"}',
        "application/json",
        422,
        "Input should be a valid",
    ),
    (
        "unknown_field",
        b'{"url": "https://x.example", "code": "1", "q": "a", "input": "a", "surprise": 1}',
        "application/json",
        422,
        "surprise: Extra inputs are not permitted",
    ),
    ("json_array", b"[1, 2]", "application/json", 422, "body: Input should be a valid dictionary"),
    ("json_null", b"null", "application/json", 422, "body: Input should be a valid dictionary"),
    ("empty_body", b"", "application/json", 422, "body: Field required"),
    (
        "not_json",
        b"url=https://x.example",
        "application/x-www-form-urlencoded",
        422,
        "body: Input should be a valid dictionary",
    ),
    ("deeply_nested", b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "nests arrays or objects too deeply"),
]


@pytest.fixture
def live_service(tmp_path: Path) -> Iterator[str]:
    app = create_app(make_settings(tmp_path, allow_http_hosts='["127.0.0.1"]', max_request_body_bytes=LIMIT))
    with serving(app) as url:
        yield url


@pytest.mark.parametrize("path", TOOL_PATHS)
@pytest.mark.parametrize(
    ("name", "body", "content_type", "status", "phrase"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
async def test_bad_bodies_get_a_clear_4xx_json_error_on_every_tool(
    service: ServiceFactory, path: str, name: str, body: bytes, content_type: str, status: int, phrase: str
) -> None:
    async with service() as client:
        response = await client.post(path, content=body, headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    assert phrase in response.json()["error"], response.text


@pytest.mark.parametrize("path", TOOL_PATHS)
async def test_a_declared_body_past_the_limit_is_413_before_it_is_read(service: ServiceFactory, path: str) -> None:
    async with service(max_request_body_bytes=LIMIT) as client:
        response = await client.post(path, content=b"x" * (LIMIT + 1), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {
        "error": f"Request body too large: the limit is {LIMIT} bytes (METAAGENT_MAX_REQUEST_BODY_BYTES)"
    }


@pytest.mark.parametrize("path", [*TOOL_PATHS, "/mcp"])
def test_a_streamed_body_is_refused_with_413_as_soon_as_it_passes_the_limit(live_service: str, path: str) -> None:
    sent: list[int] = []

    def chunks() -> Iterator[bytes]:  # no Content-Length: the service must count as it reads
        yield b'{"code": "'
        for _ in range(1000):
            sent.append(8192)
            yield b"a" * 8192
        yield b'"}'

    try:
        response = httpx2.post(f"{live_service}{path}", content=chunks(), headers=MCP_HEADERS, timeout=30)
    except httpx2.WriteError:
        pytest.fail("the service closed the connection without answering")
    assert response.status_code == 413
    assert "Request body too large" in response.json()["error"]
    assert sum(sent) < 8 * 1024 * 1024  # it stopped long before the 8 MB the client had to send


def test_a_body_just_under_the_limit_is_read(live_service: str) -> None:
    body = b'{"url": "https://x.example/", "method": "POST", "body": "' + b"a" * (LIMIT - 100) + b'"}'
    response = httpx2.post(f"{live_service}/tools/http", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400  # read, validated, then blocked by the allow-list
    assert response.json()["error"] == "Blocked host: x.example"


@pytest.mark.parametrize("execution_id", ["%00", "..%2F..%2Fetc", "x" * 5000, "%F0%9F%9A%80", "%FF"])
async def test_odd_execution_ids_are_404(service: ServiceFactory, execution_id: str) -> None:
    async with service() as client:
        got = await client.get(f"/executions/{execution_id}")
        killed = await client.delete(f"/executions/{execution_id}")
    assert got.status_code == killed.status_code == 404
    assert got.json()["error"]  # "No running execution ..." or, for a path that leaves /executions, "Not Found"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"code": "1", "packages": ["x\udfff"]}, "packages"),
        ({"code": "1", "packages": ["lodash", "\ud800lodash"]}, "packages"),
        ({"code": "1", "network": {"allow": ["x\udfff"]}}, "network"),
        ({"code": "1", "network": {"allow": ["api.example.com", "\udc00\ud800"]}}, "network"),
    ],
)
def test_a_lone_surrogate_in_packages_or_network_allow_is_a_422_naming_the_field(
    live_service: str, body: dict[str, object], field: str
) -> None:
    """The finding: these answered 500, and the refusal's audit record was lost to a UnicodeEncodeError."""
    response = httpx2.post(
        f"{live_service}/tools/code-interpreter",
        content=json.dumps(body),  # a lone surrogate travels as its `\udfff` escape, as a hostile client sends it
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 422, response.text
    assert response.json()["details"][0]["field"].startswith(field)
    assert "lone UTF-16 surrogate" in response.json()["error"]
