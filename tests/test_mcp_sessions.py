"""MCP sessions are bounded per key and in all, idle ones are closed, and a session is its key's alone.

The finding: about 10,050 unclosed `initialize` requests filled the SDK's default of 10,000 sessions
(idle timeout 30 minutes, not counted per key); every new client, other keys included, then got 503.
Against a real service over loopback, with the official SDK's streamable HTTP server behind it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from metaagent.access import KeyRing
from metaagent.app import create_app, session_limits
from tests.conftest import make_settings
from tests.live_service import serving
from tests.service_process import service_process
from tests.test_access import ALICE, BOB, KEYS
from tests.test_mcp import INITIALIZE, MCP_HEADERS

pytestmark = pytest.mark.security

SESSION = "mcp-session-id"


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[str]:
    settings = make_settings(tmp_path, api_keys=KEYS, mcp_max_sessions=6, mcp_sessions_per_key=3)
    with serving(create_app(settings)) as url:
        yield url


def initialize(base: str, key: str | None = None, **headers: str) -> httpx2.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.post(f"{base}/mcp", json=INITIALIZE, headers={**MCP_HEADERS, **auth, **headers}, timeout=60)


def ping(base: str, session_id: str, key: str | None = None) -> httpx2.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    headers = {**MCP_HEADERS, **auth, SESSION: session_id, "mcp-protocol-version": "2025-06-18"}
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    return httpx2.post(f"{base}/mcp", json=body, headers=headers, timeout=60)


def close(base: str, session_id: str, key: str | None = None) -> httpx2.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    headers = {**auth, SESSION: session_id, "mcp-protocol-version": "2025-06-18"}
    return httpx2.delete(f"{base}/mcp", headers=headers, timeout=60)


def test_past_its_share_a_key_gets_429_and_other_keys_still_open_sessions(keyed: str) -> None:
    alice = [initialize(keyed, ALICE) for _ in range(3)]
    assert all(r.status_code == 200 for r in alice), [r.text for r in alice]
    refused = [initialize(keyed, ALICE) for _ in range(5)]  # the flood: unclosed initialize requests
    assert {r.status_code for r in refused} == {429}
    assert int(refused[0].headers["Retry-After"]) > 0
    assert "Key alice already has 3 MCP sessions open" in refused[0].json()["error"]
    assert "METAAGENT_MCP_SESSIONS_PER_KEY" in refused[0].json()["error"]
    bob = initialize(keyed, BOB)
    assert bob.status_code == 200, bob.text
    assert ping(keyed, bob.headers[SESSION], BOB).status_code == 200


def test_a_closed_session_frees_its_place_in_the_share(keyed: str) -> None:
    opened = [initialize(keyed, ALICE).headers[SESSION] for _ in range(3)]
    assert initialize(keyed, ALICE).status_code == 429
    assert close(keyed, opened[0], ALICE).status_code == 200
    assert initialize(keyed, ALICE).status_code == 200
    assert initialize(keyed, ALICE).status_code == 429


def test_another_keys_session_does_not_exist_for_it(keyed: str) -> None:
    session_id = initialize(keyed, ALICE).headers[SESSION]
    assert ping(keyed, session_id, BOB).status_code == 404
    assert close(keyed, session_id, BOB).status_code == 404
    assert ping(keyed, session_id, ALICE).status_code == 200


def test_the_global_cap_holds_for_callers_without_keys(tmp_path: Path) -> None:
    with serving(create_app(make_settings(tmp_path, mcp_max_sessions=4))) as base:
        answers = [initialize(base) for _ in range(7)]
    assert [r.status_code for r in answers] == [200] * 4 + [429] * 3  # one caller: its share is the whole


def test_an_idle_session_is_closed_and_its_place_freed(tmp_path: Path) -> None:
    # The refusal below must come while the first session still lives: the idle timeout is its margin
    # (with 1 s, a busy machine's pause between the two requests let it idle out, and the refusal was a
    # 200). The wait for its end is polled, so the test takes about this long.
    idle_timeout_s = 10
    settings = make_settings(tmp_path, mcp_max_sessions=1, mcp_session_idle_timeout_s=idle_timeout_s)
    with serving(create_app(settings)) as base:
        first = initialize(base)
        assert first.status_code == 200
        assert initialize(base).status_code == 429
        deadline = time.monotonic() + idle_timeout_s + 120  # a hang guard: the session goes once idle that long
        while (second := initialize(base)).status_code != 200:
            assert time.monotonic() < deadline, second.text
            time.sleep(0.2)
        assert ping(base, first.headers[SESSION]).status_code == 404


def test_the_limits_come_from_the_services_own_limits_and_the_keys(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, max_concurrent_executions=4, execution_queue_size=32, api_keys=KEYS)
    limits = session_limits(settings, KeyRing.from_settings(settings))
    assert limits.total == 4 * (4 + 32)
    assert limits.per_key == limits.total // 2  # two keys, each its half: no key can crowd out the other
    assert limits.idle_timeout_s == 300  # minutes, not the SDK's half hour
    alone = make_settings(tmp_path, max_concurrent_executions=4)
    assert session_limits(alone, KeyRing()).per_key == session_limits(alone, KeyRing()).total


def test_past_the_total_every_key_gets_the_sdks_503(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, api_keys=KEYS, mcp_max_sessions=4, mcp_sessions_per_key=3)
    with serving(create_app(settings)) as base:
        assert [initialize(base, ALICE).status_code for _ in range(3)] == [200] * 3
        assert initialize(base, BOB).status_code == 200
        assert initialize(base, BOB).status_code == 503  # the shares were set above the total's


@pytest.mark.slow
def test_a_flood_of_unclosed_initialize_requests_leaves_memory_bounded_and_other_keys_served(tmp_path: Path) -> None:
    """The finding, against a real `serve` process with its default limits: the flood fills one key's
    share and no more, so the resident memory stays within a generous bound and bob still gets a session."""
    flood = 2_000
    with service_process(tmp_path, METAAGENT_API_KEYS=KEYS) as service:
        assert initialize(service.base, BOB).status_code == 200  # every code path of a session has run once
        before = max(service.memory_kib("VmRSS"), service.memory_kib("VmHWM"))
        statuses: dict[int, int] = {}
        with httpx2.Client(base_url=service.base, timeout=60) as client:
            headers = {**MCP_HEADERS, "Authorization": f"Bearer {ALICE}"}
            for _ in range(flood):
                status = client.post("/mcp", json=INITIALIZE, headers=headers).status_code
                statuses[status] = statuses.get(status, 0) + 1
        opened = statuses.get(200, 0)
        assert 0 < opened < flood
        assert statuses.get(429) == flood - opened  # past alice's share, only refusals
        assert initialize(service.base, BOB).status_code == 200
        assert service.memory_kib("VmHWM") - before < 64 * 1024
