"""Hosts and origins on every route: DNS rebinding (a foreign `Host`) is a 421, a foreign `Origin` on
anything that runs or changes something is a 403, against a real service over loopback.

A rebinding page's requests carry its own name: `Host: evil.test:3102`, `Origin: http://evil.test:3102`.
Sending those headers from a test is exactly what the browser sends after the name resolved to 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from metaagent.app import create_app
from metaagent.hosts import is_own_origin
from metaagent.settings import Settings
from tests.conftest import make_settings
from tests.fake_upstreams import SERPER_KEY, FakeUpstream, fake_serper
from tests.live_service import serving
from tests.test_mcp import INITIALIZE, MCP_HEADERS

pytestmark = pytest.mark.security

EVIL = "evil.test:3102"
# Every route of the service, with a body that would be served (or refused by policy) from loopback.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/health", None),
    ("GET", "/tools", None),
    ("GET", "/executions", None),
    ("GET", "/executions/exe_0", None),
    ("DELETE", "/executions/exe_0", None),
    ("POST", "/tools/http", {"url": "http://127.0.0.1:9/"}),
    ("POST", "/tools/code-interpreter", {"code": "console.log(1)"}),
    ("POST", "/tools/search", {"q": "spend the operator's key"}),
    ("POST", "/tools/embeddings", {"input": "spend the operator's key"}),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("POST", "/mcp", INITIALIZE),
]
CHANGING = [route for route in ROUTES if route[0] not in ("GET", "HEAD", "OPTIONS")]


@pytest.fixture(scope="module")
def serper() -> Iterator[FakeUpstream]:
    with fake_serper() as fake:
        yield fake


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, serper: FakeUpstream) -> Iterator[str]:
    settings = make_settings(
        tmp_path_factory.mktemp("hosts"),
        allow_http_hosts='["127.0.0.1"]',
        allow_private_networks=True,
        serper_api_key=SERPER_KEY,
        serper_base_url=serper.url,
        allowed_hosts='["tools.internal", "other.internal:8080"]',
    )
    with serving(create_app(settings)) as url:
        yield url


def send(live: str, method: str, path: str, body: dict[str, Any] | None, **headers: str) -> httpx2.Response:
    extra = MCP_HEADERS if path == "/mcp" else {}
    with httpx2.Client(base_url=live, timeout=60) as client:
        return client.request(method, path, json=body, headers={**extra, **headers})


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_a_rebinding_request_is_421_on_every_route_and_reaches_nothing(
    live: str, serper: FakeUpstream, method: str, path: str, body: dict[str, Any] | None
) -> None:
    before = len(serper.requests)
    response = send(live, method, path, body, Host=EVIL, Origin=f"http://{EVIL}")
    assert response.status_code == 421, response.text
    assert "METAAGENT_ALLOWED_HOSTS" in response.json()["error"]
    assert EVIL in response.json()["error"]
    assert len(serper.requests) == before  # the operator's Serper key was not spent


@pytest.mark.parametrize("host", ["evil.test", "127.0.0.1.evil.test", "localhost.evil.test:80", "10.0.0.5:3102", ""])
def test_a_foreign_or_missing_host_is_421_without_an_origin_too(live: str, host: str) -> None:
    assert send(live, "GET", "/executions", None, Host=host).status_code == 421


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.1:3102", "localhost", "localhost:1", "[::1]:3102", "tools.internal:443"]
)
def test_loopback_names_on_any_port_and_listed_hosts_are_answered(live: str, host: str) -> None:
    assert send(live, "GET", "/executions", None, Host=host).status_code == 200


def test_a_listed_host_with_a_port_is_answered_on_that_port_only(live: str) -> None:
    assert send(live, "GET", "/health", None, Host="other.internal:8080").status_code == 200
    assert send(live, "GET", "/health", None, Host="other.internal:8081").status_code == 421


@pytest.mark.parametrize(("method", "path", "body"), CHANGING)
@pytest.mark.parametrize("origin", ["http://evil.test:3102", "http://localhost:8080", "null", "https://127.0.0.1.evil"])
def test_a_foreign_origin_is_403_on_every_route_that_runs_or_changes_anything(
    live: str, serper: FakeUpstream, method: str, path: str, body: dict[str, Any] | None, origin: str
) -> None:
    before = len(serper.requests)
    host = live.removeprefix("http://")
    response = send(live, method, path, body, Host=host, Origin=origin)
    assert response.status_code == 403, response.text
    assert response.json()["error"].startswith("Cross-origin request refused")
    assert len(serper.requests) == before


def test_the_services_own_origin_may_post(live: str, serper: FakeUpstream) -> None:
    host = live.removeprefix("http://")
    response = send(live, "POST", "/tools/search", {"q": "own page"}, Host=host, Origin=f"http://{host}")
    assert response.status_code == 200, response.text
    assert serper.requests[-1].body["q"] == "own page"


def test_a_foreign_origin_may_still_read(live: str) -> None:
    """A cross-origin GET changes nothing (and the browser keeps its answer from the page: no CORS)."""
    host = live.removeprefix("http://")
    assert send(live, "GET", "/health", None, Host=host, Origin="http://evil.test").status_code == 200


def test_own_origin_is_the_scheme_and_the_host_the_request_was_sent_to() -> None:
    assert is_own_origin("http://127.0.0.1:3102", "127.0.0.1:3102")
    assert is_own_origin("HTTP://LocalHost:3102", "localhost:3102")
    assert is_own_origin("https://tools.internal", "tools.internal:443")
    assert is_own_origin("http://tools.internal:80", "tools.internal")
    assert is_own_origin("http://[::1]:3102", "[::1]:3102")
    assert not is_own_origin("http://localhost:3103", "localhost:3102")
    assert not is_own_origin("http://127.0.0.1:3102", "localhost:3102")
    assert not is_own_origin("file://", "localhost:3102")
    assert not is_own_origin("http://user@localhost:3102", "localhost:3102")
    assert not is_own_origin("http://[::1", "[::1]:3102")
    assert not is_own_origin("null", "localhost")


def test_a_star_turns_the_check_off(tmp_path: Path) -> None:
    with serving(create_app(make_settings(tmp_path, allowed_hosts="*"))) as url:
        assert send(url, "GET", "/health", None, Host=EVIL).status_code == 200


def test_the_older_mcp_setting_is_read_as_the_same_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("METAAGENT_MCP_ALLOWED_HOSTS", '["legacy.internal"]')
    settings = Settings(_env_file=None, audit_log=tmp_path / "audit.jsonl", sandbox_build_on_start=False)  # type: ignore[call-arg]  # pydantic-settings' init-only option
    assert settings.allowed_hosts == '["legacy.internal"]'
    with serving(create_app(settings)) as url:
        assert send(url, "GET", "/tools", None, Host="legacy.internal:3102").status_code == 200
        assert send(url, "POST", "/mcp", INITIALIZE, Host="legacy.internal").status_code == 200
        assert send(url, "GET", "/tools", None, Host=EVIL).status_code == 421
    monkeypatch.setenv("METAAGENT_ALLOWED_HOSTS", '["new.internal"]')
    both = Settings(_env_file=None, audit_log=tmp_path / "audit.jsonl")  # type: ignore[call-arg]  # as above
    assert both.allowed_hosts == '["new.internal"]'
