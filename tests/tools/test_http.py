"""The HTTP tool end to end: the app in-process, the upstreams real servers on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import logging
import socket
from pathlib import Path

import pytest

from tests.conftest import ServiceFactory, running_upstream

pytestmark = pytest.mark.security

LOCAL = '["127.0.0.1"]'


def security_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "metaagent.security"]


async def test_allowed_host_returns_the_upstream_response(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/hello"})
    assert response.status_code == 200
    result = response.json()
    assert result["status"] == 200
    assert result["body"] == "hello from upstream"
    assert result["encoding"] == "utf-8"
    assert result["truncated"] is False
    assert result["headers"]["content-type"] == "text/plain; charset=utf-8"
    assert result["url"] == f"{upstream}/hello"


async def test_method_headers_and_body_reach_the_upstream(service: ServiceFactory, upstream: str) -> None:
    request = {"url": f"{upstream}/echo?q=1", "method": "PUT", "headers": {"X-Trace": "abc"}, "body": "payload"}
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json=request)
    echo = json.loads(response.json()["body"])
    assert echo["method"] == "PUT"
    assert echo["path"] == "/echo?q=1"
    assert echo["headers"]["x-trace"] == "abc"
    assert echo["headers"]["host"] == upstream.removeprefix("http://")
    assert echo["body"] == "payload"


async def test_blocked_host_returns_400_and_logs_the_security_line(
    service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async with service(allow_http_hosts='["api.openai.com"]') as client:
        response = await client.post("/tools/http", json={"url": "https://malicious.com/api", "method": "GET"})
    assert response.status_code == 400
    assert response.json() == {"error": "Blocked host: malicious.com", "host": "malicious.com"}
    assert security_lines(caplog) == [
        "[SECURITY] Blocked HTTP request to disallowed host: malicious.com (GET https://malicious.com/api)"
    ]


async def test_blocked_request_writes_an_audit_record(service: ServiceFactory, tmp_path: Path) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        await client.post("/tools/http", json={"url": "https://malicious.com/api", "method": "POST"})
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "egress.blocked"
    assert records[-1]["host"] == "malicious.com"
    assert records[-1]["method"] == "POST"
    assert records[-1]["tool"] == "http"


@pytest.mark.parametrize(
    ("url", "host", "reason"),
    [
        ("http://a..b/x", "a..b", "The host 'a..b' has an empty label"),
        ("http://256.1.1.1/", "256.1.1.1", "Invalid IPv4 address '256.1.1.1': a part is out of range"),
        ("http://[::1/", "[::1", "Unclosed IPv6 bracket in URL: 'http://[::1/'"),
        ("http://%ff.com/", "%ff.com", "The host '%ff.com' is not valid UTF-8 after percent-decoding"),
        ("http://exa mple.com/", "exa mple.com", "The host 'exa mple.com' contains characters a host cannot have"),
    ],
)
async def test_a_malformed_host_is_blocked_with_the_seeds_message_and_the_reason_beside_it(
    service: ServiceFactory, caplog: pytest.LogCaptureFixture, tmp_path: Path, url: str, host: str, reason: str
) -> None:
    async with service(allow_http_hosts='["api.openai.com"]') as client:
        response = await client.post("/tools/http", json={"url": url})
    assert response.status_code == 400
    assert response.json() == {"error": f"Blocked host: {host}", "host": host, "reason": reason}
    assert security_lines(caplog) == [f"[SECURITY] Blocked HTTP request to disallowed host: {host} (GET {url})"]
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert (records[-1]["event"], records[-1]["host"], records[-1]["reason"]) == ("egress.blocked", host, reason)


async def test_userinfo_trick_is_judged_by_the_real_host(
    service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async with service(allow_http_hosts='["api.openai.com"]') as client:
        response = await client.post("/tools/http", json={"url": "https://api.openai.com@evil.com/"})
    assert response.status_code == 400
    assert response.json()["host"] == "evil.com"


async def test_redirect_to_a_blocked_host_returns_400(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/redirect?to=http://evil.example/steal"})
    assert response.status_code == 400
    assert response.json()["error"] == "Blocked host: evil.example"


async def test_redirect_to_a_malformed_host_is_blocked_with_the_seeds_message(
    service: ServiceFactory, upstream: str
) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/redirect?to=http://a..b/steal"})
    assert response.status_code == 400
    assert response.json() == {
        "error": "Blocked host: a..b",
        "host": "a..b",
        "reason": "The host 'a..b' has an empty label",
    }


async def test_redirect_within_the_allow_list_is_followed(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/redirect?to=/hello"})
    assert response.status_code == 200
    assert response.json()["body"] == "hello from upstream"
    assert response.json()["url"] == f"{upstream}/hello"


async def test_redirect_to_another_origin_drops_credentials(service: ServiceFactory, upstream: str) -> None:
    with running_upstream() as other:
        async with service(allow_http_hosts=LOCAL) as client:
            response = await client.post(
                "/tools/http",
                json={
                    "url": f"{upstream}/redirect?to={other}/echo",
                    "headers": {"Authorization": "Bearer s3cret", "X-Keep": "1"},
                },
            )
    echo = json.loads(response.json()["body"])
    assert response.json()["url"] == f"{other}/echo"
    assert "authorization" not in echo["headers"]
    assert echo["headers"]["x-keep"] == "1"


async def test_redirect_within_the_origin_keeps_credentials(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post(
            "/tools/http",
            json={"url": f"{upstream}/redirect?to=/echo", "headers": {"Authorization": "Bearer s3cret"}},
        )
    assert json.loads(response.json()["body"])["headers"]["authorization"] == "Bearer s3cret"


async def test_too_many_redirects_is_a_502(service: ServiceFactory, upstream: str) -> None:
    loop = f"{upstream}/redirect?to=/redirect%3Fto%3D/redirect%253Fto%253D/hello"
    async with service(allow_http_hosts=LOCAL, http_max_redirects=1) as client:
        response = await client.post("/tools/http", json={"url": loop})
    assert response.status_code == 502
    assert "Too many redirects" in response.json()["error"]


async def test_allowed_name_resolving_to_loopback_is_refused_by_default(
    service: ServiceFactory, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = upstream.replace("127.0.0.1", "localhost") + "/hello"
    async with service(allow_http_hosts='["localhost"]') as client:
        response = await client.post("/tools/http", json={"url": url})
    assert response.status_code == 400
    assert "loopback" in response.json()["error"]
    assert "METAAGENT_ALLOW_PRIVATE_NETWORKS" in response.json()["error"]
    assert any("loopback address: localhost" in line for line in security_lines(caplog))


async def test_allowed_name_resolving_to_loopback_works_with_private_networks_allowed(
    service: ServiceFactory, upstream: str
) -> None:
    url = upstream.replace("127.0.0.1", "localhost") + "/hello"
    async with service(allow_http_hosts='["localhost"]', allow_private_networks=True) as client:
        response = await client.post("/tools/http", json={"url": url})
    # localhost may resolve to ::1 first, where the test server does not listen: the guard tries each address.
    assert response.status_code == 200
    assert response.json()["body"] == "hello from upstream"


@pytest.mark.parametrize("spelling", ["2130706433", "0x7f.0.0.1", "0177.0.0.1", "127.1"])
async def test_ip_spellings_of_an_allowed_address_reach_it(
    service: ServiceFactory, upstream: str, spelling: str
) -> None:
    url = upstream.replace("127.0.0.1", spelling) + "/hello"
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": url})
    assert response.status_code == 200


async def test_ip_spellings_of_a_blocked_address_are_blocked(service: ServiceFactory) -> None:
    async with service(allow_http_hosts='["10.0.0.1"]') as client:
        response = await client.post("/tools/http", json={"url": "http://0x7f.1:9/"})
    assert response.status_code == 400
    assert response.json()["host"] == "127.0.0.1"


async def test_non_http_scheme_is_refused(service: ServiceFactory) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": "file:///etc/passwd"})
    assert response.status_code == 400
    assert "Only http and https" in response.json()["error"]


async def test_connection_refused_is_a_502(service: ServiceFactory) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"http://127.0.0.1:{port}/"})
    assert response.status_code == 502
    assert "Could not reach" in response.json()["error"]


async def test_slow_upstream_is_a_504(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/slow?s=3", "timeout_s": 0.5})
    assert response.status_code == 504
    assert "0.5 s" in response.json()["error"]


async def test_body_over_the_cap_is_truncated(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL, http_max_response_bytes=1000) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/bytes?n=50000"})
    result = response.json()
    assert result["truncated"] is True
    assert result["body"] == "x" * 1000


async def test_binary_body_is_returned_as_base64(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json={"url": f"{upstream}/binary"})
    result = response.json()
    assert result["encoding"] == "base64"
    assert base64.b64decode(result["body"]) == bytes(range(256))


async def test_empty_allow_list_blocks_every_request(
    service: ServiceFactory, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with service(allow_http_hosts="") as client:
            response = await client.post("/tools/http", json={"url": f"{upstream}/hello"})
    assert response.status_code == 400
    assert any("every outbound request is blocked" in r.getMessage() for r in caplog.records)


async def test_empty_items_in_comma_separated_lists_are_ignored_with_one_warning_line_each(
    service: ServiceFactory, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with service(allow_http_hosts="127.0.0.1,, ", npm_allowed_packages="lodash,") as client:
            response = await client.post("/tools/http", json={"url": f"{upstream}/hello"})
    assert response.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "empty item" in r.getMessage()]
    assert lines == [
        "ALLOW_HTTP_HOSTS has 2 empty items (stray or trailing commas); ignored",
        "METAAGENT_NPM_ALLOWED_PACKAGES has 1 empty item (stray or trailing commas); ignored",
    ]


async def test_a_list_of_only_empty_items_blocks_every_request_as_an_empty_one_does(
    service: ServiceFactory, upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with service(allow_http_hosts=" , ,") as client:
            response = await client.post("/tools/http", json={"url": f"{upstream}/hello"})
    assert response.status_code == 400
    messages = [r.getMessage() for r in caplog.records]
    assert "ALLOW_HTTP_HOSTS has 3 empty items (stray or trailing commas); ignored" in messages
    assert any("every outbound request is blocked" in m for m in messages)


async def test_host_header_from_the_caller_is_refused(service: ServiceFactory, upstream: str) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post(
            "/tools/http", json={"url": f"{upstream}/echo", "headers": {"Host": "internal.example"}}
        )
    assert response.status_code == 400
    assert "Host header" in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "https://x.com", "timeout_s": 0}, "timeout_s"),
        ({"url": "https://x.com", "timeout_s": 121}, "timeout_s"),
        ({"url": "https://x.com", "method": "TRACE"}, "method"),
        ({}, "url"),
        ({"url": "https://x.com", "surprise": 1}, "surprise"),
    ],
)
async def test_invalid_fields_get_a_422_naming_the_field(
    service: ServiceFactory, body: dict[str, object], field: str
) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", json=body)
    assert response.status_code == 422
    assert field in response.json()["error"]


async def test_malformed_json_gets_a_422(service: ServiceFactory) -> None:
    async with service(allow_http_hosts=LOCAL) as client:
        response = await client.post("/tools/http", content=b'{"url": ', headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert "error" in response.json()
