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
        422,
        "body: not valid UTF-8",
    ),
    ("utf16_with_bom", '{"url": "https://x.example"}'.encode("utf-16"), "application/json", 422, "body: starts with"),
    ("utf16", '{"url": "https://x.example"}'.encode("utf-16-le"), "application/json", 422, "body: encoded as UTF-16"),
    ("utf32", '{"url": "https://x.example"}'.encode("utf-32-be"), "application/json", 422, "body: encoded as UTF-32"),
    ("utf8_bom", b'\xef\xbb\xbf{"url": "https://x.example"}', "application/json", 422, "a UTF-8 byte order mark"),
    (
        "duplicate_key",
        b'{"url": "https://a.example", "url": "https://b.example"}',
        "application/json",
        422,
        "url: given twice",
    ),
    (
        "huge_integer",
        b'{"timeout_s": ' + b"9" * 5000 + b"}",
        "application/json",
        422,
        "timeout_s: an integer of 5000 digits",
    ),
    ("nan", b'{"timeout_s": NaN}', "application/json", 422, "timeout_s: NaN is not a JSON number"),
    (
        "wrong_types",
        b'{"url": 5, "code": 5, "q": 5, "input": 5, "timeout_s": "soon"}',
        "application/json",
        422,
        " must be ",
    ),
    (
        "unknown_field",
        b'{"url": "https://x.example", "code": "1", "q": "a", "input": "a", "surprise": 1}',
        "application/json",
        422,
        "surprise is not a field of this request; leave it out",
    ),
    ("json_array", b"[1, 2]", "application/json", 422, "the body must be a JSON object (got an array)"),
    ("json_null", b"null", "application/json", 422, "body: a JSON object is needed, not null"),
    ("empty_body", b"", "application/json", 422, "a JSON body is required"),
    (
        "not_json",
        b"url=https://x.example",
        "application/x-www-form-urlencoded",
        422,
        "the body must be a JSON object",
    ),
    (
        "deeply_nested",
        b"[" * 100_000 + b"]" * 100_000,
        "application/json",
        422,
        "body: nests arrays or objects too deeply",
    ),
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


def _json_routes() -> list[tuple[str, str]]:
    """Every route that takes a JSON body, from the OpenAPI description (path parameters filled in)."""
    schema = create_app(make_settings(Path("/nonexistent"))).openapi()
    found = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if "application/json" in operation.get("requestBody", {}).get("content", {}):
                found.append((method.upper(), path.replace("{session_id}", "ses_x")))
    return found


JSON_ROUTES = _json_routes()


def test_the_json_routes_include_every_tool_and_the_session_calls() -> None:
    assert {path for _, path in JSON_ROUTES} >= {*TOOL_PATHS, "/sessions", "/sessions/ses_x/execute"}


@pytest.mark.parametrize(("method", "path"), JSON_ROUTES)
@pytest.mark.parametrize(
    ("body", "field", "phrase"),
    [
        (b'{"code": "1", "code": "2"}', "code", "given twice"),
        (b'{"network": {"allow": ["a.example"], "allow": []}}', "network.allow", "given twice"),
        ('{"code": "1"}'.encode("utf-16-le"), "body", "encoded as UTF-16"),
        ('{"code": "1"}'.encode("utf-32"), "body", "UTF-32 byte order mark"),
        (b'{"timeout_s": 1' + b"0" * 4999 + b"}", "timeout_s", "an integer of 5000 digits is out of range"),
        (b'{"timeout_s": -Infinity}', "timeout_s", "not a JSON number"),
        (b'{"timeout_s": 1e400}', "timeout_s", "too large to represent"),
        (b"null", "body", "not null"),
    ],
    ids=["duplicate", "nested_duplicate", "utf16", "utf32", "5000_digits", "infinity", "overflow", "null"],
)
async def test_every_json_route_refuses_a_body_that_is_not_strict_json_with_a_422_naming_the_field(
    service: ServiceFactory, method: str, path: str, body: bytes, field: str, phrase: str
) -> None:
    async with service() as client:
        response = await client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["details"][0]["field"] == field, response.text
    assert phrase in response.json()["details"][0]["message"]
    assert response.json()["error"].startswith(f"Invalid request: {field}: ")


# (route, a valid body but for the integer field, that field)
INTEGER_FIELDS = [
    ("/tools/code-interpreter", {"code": "1"}, "timeout_s"),
    ("/tools/code-interpreter", {"code": "1"}, "memory_mb"),
    ("/tools/search", {"q": "a"}, "num"),
    ("/tools/embeddings", {"input": "a"}, "dimensions"),
    ("/sessions", {}, "memory_mb"),
    ("/sessions", {}, "idle_timeout_s"),
    ("/sessions/ses_x/execute", {"code": "1"}, "timeout_s"),
]


@pytest.mark.parametrize(("path", "body", "field"), INTEGER_FIELDS)
@pytest.mark.parametrize("value", [True, False, "5", 5.5, "1" * 5000], ids=["true", "false", "text", "float", "digits"])
async def test_an_integer_field_takes_no_boolean_string_or_fraction(
    service: ServiceFactory, path: str, body: dict[str, object], field: str, value: object
) -> None:
    """The finding: `timeout_s: true` and `"5"` ran, as 1 and 5."""
    async with service() as client:
        response = await client.post(path, json={**body, field: value})
    assert response.status_code == 422, response.text
    assert response.json()["details"][0]["field"] == field
    assert response.json()["error"].startswith(f"Invalid request: {field} must be an integer (got ")
    assert "Input should" not in response.text


async def test_a_number_field_still_takes_an_integer_but_no_boolean(service: ServiceFactory) -> None:
    async with service() as client:
        whole = await client.post("/tools/http", json={"url": "https://x.example/", "timeout_s": 5})
        boolean = await client.post("/tools/http", json={"url": "https://x.example/", "timeout_s": True})
    assert whole.status_code == 400  # read and validated, then blocked by the allow-list
    assert whole.json()["error"] == "Blocked host: x.example"
    assert boolean.status_code == 422
    assert boolean.json()["error"] == "Invalid request: timeout_s must be a number (got true)"


async def test_post_sessions_with_the_body_null_is_a_422_and_creates_nothing(service: ServiceFactory) -> None:
    async with service() as client:
        response = await client.post("/sessions", content=b"null", headers={"Content-Type": "application/json"})
        listed = await client.get("/sessions")
    assert response.status_code == 422
    assert response.json()["error"].startswith("Invalid request: body: a JSON object is needed, not null")
    assert listed.json() == {"sessions": []}


def test_a_huge_integer_is_refused_over_real_http_by_name_not_as_a_400(live_service: str) -> None:
    """Python's int-from-text limit (4300 digits) raised inside the JSON parser, which answered 400."""
    response = httpx2.post(
        f"{live_service}/tools/http",
        content=b'{"url": "https://x.example/", "timeout_s": ' + b"7" * 5000 + b"}",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 422
    assert response.json()["details"] == [
        {
            "field": "timeout_s",
            "message": "an integer of 5000 digits is out of range (no field takes more than 32 digits); "
            "send a number within the field's range",
        }
    ]


async def test_a_content_length_of_5000_digits_is_a_413_not_a_500(service: ServiceFactory) -> None:
    """Python will not turn more than 4300 digits into an int: the limit check must not try."""
    async with service(max_request_body_bytes=LIMIT) as client:
        response = await client.post(
            "/tools/http", content=b"{}", headers={"Content-Type": "application/json", "Content-Length": "9" * 5000}
        )
    assert response.status_code == 413
    assert response.json()["error"].startswith("Request body too large")


async def test_a_repeated_key_that_cannot_be_encoded_or_is_huge_is_still_a_422_naming_it(
    service: ServiceFactory,
) -> None:
    huge = b"k" * 200_000
    async with service() as client:
        surrogate = await client.post(
            "/tools/http", content=b'{"\\udfff": 1, "\\udfff": 2}', headers={"Content-Type": "application/json"}
        )
        long_key = await client.post(
            "/tools/http",
            content=b'{"' + huge + b'": 1, "' + huge + b'": 2}',
            headers={"Content-Type": "application/json"},
        )
    assert surrogate.status_code == 422
    assert surrogate.json()["details"][0]["field"] == "\udfff"  # quoted back as its JSON escape
    assert long_key.status_code == 422
    assert long_key.json()["details"][0]["field"] == "k" * 100 + "..."
    assert len(long_key.content) < 2000
