"""The HTTP tool against hostile callers and hostile upstreams: a 4xx for what a caller sends that HTTP
cannot carry, a 502 naming the problem for what an upstream sends that cannot be read; never a 500.

Real servers on 127.0.0.1: `raw_server` answers with exactly the bytes a test gives it.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client

from metaagent.app import create_app
from tests.conftest import make_settings
from tests.hostile_servers import RawServer, raw_server, response
from tests.live_service import serving
from tests.test_mcp import text_of

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def raw() -> Iterator[RawServer]:
    with raw_server() as server:
        yield server


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = make_settings(tmp_path_factory.mktemp("hostile"), allow_http_hosts='["127.0.0.1"]')
    with serving(create_app(settings)) as url:
        yield url


def call(live: str, body: dict[str, Any]) -> httpx2.Response:
    # json.dumps escapes what UTF-8 cannot carry (a lone surrogate becomes `\udfff`), as a hostile client would.
    return httpx2.post(
        f"{live}/tools/http", content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize("name", ["é", "Hoſt", "Ｈost", "\u212aeep-Alive", "X Trace", "", "X-A:b", "X\r\nInjected"])  # noqa: RUF001  # look-alike letters are the hostile input
def test_a_header_name_that_is_not_an_http_token_is_a_400(live: str, raw: RawServer, name: str) -> None:
    before = len(raw.requests)
    answer = call(live, {"url": raw.url, "headers": {name: "1"}})
    assert answer.status_code == 400, answer.text
    assert "not valid in HTTP" in answer.json()["error"]
    assert len(raw.requests) == before


@pytest.mark.parametrize("value", ["€uro", "a\nb", "a\r\nX-Injected: 1", "nul\x00", "esc\x1b", "del\x7f", "nel\x85"])
def test_a_header_value_http_cannot_carry_is_a_400_not_a_502(live: str, raw: RawServer, value: str) -> None:
    before = len(raw.requests)
    answer = call(live, {"url": raw.url, "headers": {"X-Note": value}})
    assert answer.status_code == 400, answer.text
    assert "cannot be sent in HTTP" in answer.json()["error"]
    assert len(raw.requests) == before


def test_a_latin1_header_value_is_sent_as_its_byte_and_spaces_around_it_are_dropped(live: str, raw: RawServer) -> None:
    answer = call(live, {"url": raw.url, "headers": {"X-Name": "  café\tau lait "}})
    assert answer.status_code == 200, answer.text
    assert b"\r\nX-Name: caf\xe9\tau lait\r\n" in raw.requests[-1] + b"\r\n"


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("headers", {"headers": {"X-A": "x\udfff"}}),
        ("headers", {"headers": {"X-\ud800": "x"}}),
        ("body", {"method": "POST", "body": "x\udfff"}),
        ("url", {"url": "http://127.0.0.1/\udfff"}),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_422_naming_the_field(
    live: str, raw: RawServer, field: str, body: dict[str, Any]
) -> None:
    answer = call(live, {"url": raw.url, **body})
    assert answer.status_code == 422, answer.text
    assert answer.json()["details"][0]["field"] == field


@pytest.mark.parametrize(("raw_char", "encoded"), [("\x7f", "%7F"), ("\x1b", "%1B"), ("\x01", "%01"), (" ", "%20")])
def test_control_characters_in_the_url_are_sent_percent_encoded(
    live: str, raw: RawServer, raw_char: str, encoded: str
) -> None:
    answer = call(live, {"url": f"{raw.url}/a{raw_char}b?q={raw_char}c"})
    assert answer.status_code == 200, answer.text
    assert raw.requests[-1].split(b"\r\n")[0] == f"GET /a{encoded}b?q={encoded}c HTTP/1.1".encode()


def gzipped(data: bytes, times: int = 1) -> bytes:
    for _ in range(times):
        data = gzip.compress(data)
    return data


@pytest.mark.parametrize(
    ("headers", "body", "says"),
    [
        ([(b"Content-Encoding", b"gzip")], b"this is not gzip", "DecodingError"),
        ([(b"Content-Encoding", b"deflate")], b"nor deflate", "DecodingError"),
        ([(b"Content-Encoding", b", ".join([b"gzip"] * 6))], gzipped(b"deep", 6), "content encodings"),
        ([(b"Content-Encoding", b"gzip, deflate")], zlib.compress(b"gzip inside deflate missing"), "DecodingError"),
        ([(b"Content-Length", b"12")], b"", "RemoteProtocolError"),
    ],
)
def test_an_answer_the_client_cannot_decode_is_a_502_that_names_it(
    live: str, raw: RawServer, headers: list[tuple[bytes, bytes]], body: bytes, says: str
) -> None:
    raw.answer(response("200 OK", headers, body))
    answer = call(live, {"url": raw.url})
    assert answer.status_code == 502, answer.text
    assert says in answer.json()["error"]


def test_two_stacked_codings_within_the_library_limit_are_decoded(live: str, raw: RawServer) -> None:
    raw.answer(response("200 OK", [(b"Content-Encoding", b"gzip, gzip")], gzipped(b"twice", 2)))
    answer = call(live, {"url": raw.url})
    assert answer.status_code == 200, answer.text
    assert answer.json()["body"] == "twice"


@pytest.mark.parametrize(
    ("location", "status", "says"),
    [
        (b"http://0177.0.0.2/", 400, "Blocked host: 127.0.0.2"),
        ("http://ｅｖｉｌ.com/".encode(), 400, "Blocked host: evil.com"),  # noqa: RUF001  # look-alike letters are the hostile input
        (b"http://[::1/", 502, "redirected to a URL that cannot be read"),
        (b"http://exa\x7fmple.com/", 400, "Blocked host: "),
        (b"http://exa\x01mple.com/", 400, "Blocked host: "),
        (b"http://%zz/", 400, "Blocked host: %zz"),
        (b"ftp://127.0.0.1/", 400, "Only http and https"),
    ],
)
def test_a_redirect_location_the_client_cannot_parse_is_judged_by_the_guard_first(
    live: str, raw: RawServer, location: bytes, status: int, says: str
) -> None:
    raw.answer(response("302 Found", [(b"Location", location)], b""))
    answer = call(live, {"url": raw.url})
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]


@pytest.mark.parametrize(
    ("location", "line"),
    [
        (b"/next\x7fpage", b"GET /next%7Fpage HTTP/1.1"),
        (b"/next\x01page", b"GET /next%01page HTTP/1.1"),
        (b"\\\\127.0.0.1:{port}\\slash", b"GET /slash HTTP/1.1"),
    ],
)
def test_a_redirect_location_with_control_bytes_is_followed_percent_encoded(
    live: str, raw: RawServer, location: bytes, line: bytes
) -> None:
    port = raw.url.rsplit(":", 1)[1].encode()
    raw.answer(response("302 Found", [(b"Location", location.replace(b"{port}", port))], b""))
    answer = call(live, {"url": raw.url})
    assert answer.status_code == 200, answer.text
    assert raw.requests[-1].split(b"\r\n")[0] == line


def test_a_tab_in_a_redirects_host_is_removed_as_browsers_do(live: str, raw: RawServer) -> None:
    port = raw.url.rsplit(":", 1)[1]
    raw.answer(response("302 Found", [(b"Location", f"http://127.0.0.\t1:{port}/tabbed".encode())], b""))
    answer = call(live, {"url": raw.url})
    assert answer.status_code == 200, answer.text
    assert raw.requests[-1].split(b"\r\n")[0] == b"GET /tabbed HTTP/1.1"


async def test_the_same_hostile_inputs_over_mcp_are_tool_errors_not_internal_errors(
    tmp_path: Path, raw: RawServer
) -> None:
    app = create_app(make_settings(tmp_path, allow_http_hosts='["127.0.0.1"]'))
    async with app.router.lifespan_context(app), Client(app.state.mcp_server) as client:
        for arguments, says in [
            ({"url": raw.url, "headers": {"Hoſt": "x"}}, "not valid in HTTP"),  # noqa: RUF001  # look-alike letters are the hostile input
            ({"url": raw.url, "headers": {"X-A": "a\nb"}}, "cannot be sent in HTTP"),
            ({"url": raw.url, "body": "x\udfff", "method": "POST"}, "Invalid request: body"),
            ({"url": raw.url, "headers": {"X-A": "\udfff"}}, "Invalid request: headers"),
        ]:
            result = await client.call_tool("http", arguments)
            assert result.is_error, arguments
            assert says in text_of(result), text_of(result)
        raw.answer(response("200 OK", [(b"Content-Encoding", b"gzip")], b"not gzip"))
        result = await client.call_tool("http", {"url": raw.url})
        assert result.is_error
        assert "DecodingError" in text_of(result)
