"""Tenancy end to end: with API keys each caller lists, reads and kills only its own executions; another's
id is the 404 of an id that never existed; an operator's key (`name:key:admin`) sees and stops them all.

The finding: bob's `GET /executions` listed alice's execution (her container id, `"caller": "alice"`),
and bob's `DELETE` killed it. Here a real service, a real engine, a real running execution of alice's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import docker
import httpx2
import pytest

from tests.sandbox.conftest import Service, running_service
from tests.test_access import ALICE, BOB

pytestmark = [pytest.mark.docker, pytest.mark.security]

OPERATOR = "ops-4f1e9a7c2b8d0e6f3a5c"
KEYS = f"alice:{ALICE},bob:{BOB},ops:{OPERATOR}:admin"
LONG_RUN = {"code": "console.log('up'); setInterval(() => {}, 1000)", "timeout_s": 120}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("tenancy"), METAAGENT_API_KEYS=KEYS) as running:
        yield running


def listed(service: Service, key: str) -> list[dict[str, object]]:
    response = httpx2.get(f"{service.base_url}/executions", headers=bearer(key), timeout=30)
    assert response.status_code == 200, response.text
    executions: list[dict[str, object]] = response.json()["executions"]
    return executions


def start_alices_execution(service: Service, answers: list[httpx2.Response]) -> threading.Thread:
    def run() -> None:
        url = f"{service.base_url}/tools/code-interpreter"
        answers.append(httpx2.post(url, json=LONG_RUN, headers=bearer(ALICE), timeout=180))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not any(e["state"] == "running" for e in listed(service, ALICE)):
        assert time.monotonic() < deadline, "alice's execution did not start"
        time.sleep(0.1)
    return thread


def test_a_caller_sees_and_kills_only_its_own_executions(service: Service) -> None:
    answers: list[httpx2.Response] = []
    thread = start_alices_execution(service, answers)
    try:
        (mine,) = listed(service, ALICE)
        execution_id = str(mine["execution_id"])
        assert mine["caller"] == "alice"

        assert listed(service, BOB) == []
        unknown = httpx2.get(f"{service.base_url}/executions/exe_000000000000000000000000", headers=bearer(BOB))
        for method in ("GET", "DELETE"):
            theirs = httpx2.request(method, f"{service.base_url}/executions/{execution_id}", headers=bearer(BOB))
            assert theirs.status_code == 404
            # The same answer as for an id that was never there: an id says nothing about whose it is.
            assert theirs.json()["error"] == unknown.json()["error"].replace(
                "exe_000000000000000000000000", execution_id
            )
        assert [e["execution_id"] for e in listed(service, ALICE)] == [execution_id]  # bob's DELETE did nothing
        own = httpx2.get(f"{service.base_url}/executions/{execution_id}", headers=bearer(ALICE))
        assert own.status_code == 200
        assert own.json()["container_id"]
    finally:
        for execution in listed(service, ALICE):
            httpx2.delete(f"{service.base_url}/executions/{execution['execution_id']}", headers=bearer(ALICE))
        thread.join(timeout=120)
    assert answers[0].json()["killed"] is True


def test_an_operators_key_sees_and_kills_every_callers_executions(service: Service) -> None:
    answers: list[httpx2.Response] = []
    thread = start_alices_execution(service, answers)
    try:
        (seen,) = listed(service, OPERATOR)
        assert seen["caller"] == "alice"
        read = httpx2.get(f"{service.base_url}/executions/{seen['execution_id']}", headers=bearer(OPERATOR))
        assert read.status_code == 200
        killed = httpx2.delete(f"{service.base_url}/executions/{seen['execution_id']}", headers=bearer(OPERATOR))
        assert killed.json() == {"execution_id": seen["execution_id"], "killed": True}
    finally:
        thread.join(timeout=120)
    assert answers[0].status_code == 200
    assert answers[0].json()["killed"] is True
    assert listed(service, ALICE) == []


def test_each_key_holds_an_equal_share_of_the_sessions_and_an_operator_more(
    tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient
) -> None:
    """The finding: METAAGENT_SESSIONS_PER_KEY defaulted to all of METAAGENT_SESSION_MAX, so one key could
    hold every session and every other key got 429. Three keys and 4 sessions: a share of 1 each."""
    with running_service(
        tmp_path_factory.mktemp("session-share"),
        METAAGENT_API_KEYS=KEYS,
        METAAGENT_SESSION_MAX="4",
        METAAGENT_POOL_ENABLED="false",
    ) as service:
        opened: list[tuple[str, str]] = []

        def create(key: str) -> httpx2.Response:
            response = httpx2.post(
                f"{service.base_url}/sessions", json={"memory_mb": 128}, headers=bearer(key), timeout=180
            )
            if response.status_code == 201:
                opened.append((key, response.json()["session_id"]))
            return response

        try:
            assert create(ALICE).status_code == 201
            second = create(ALICE)
            assert second.status_code == 429
            assert int(second.headers["Retry-After"]) > 0
            assert second.json()["error"] == (
                "Key alice already has 1 sessions open, its share (METAAGENT_SESSIONS_PER_KEY: 1); close one first "
                "(DELETE /sessions/{id})"
            )
            assert create(BOB).status_code == 201  # alice's sessions left bob his share
            assert [create(OPERATOR).status_code for _ in range(2)] == [201, 201]  # an operator may hold more
            full = create(BOB)
            assert full.status_code == 429
            assert "its share" in full.json()["error"]
            key, alices = opened.pop(0)
            assert httpx2.delete(f"{service.base_url}/sessions/{alices}", headers=bearer(key), timeout=60).is_success
            assert create(OPERATOR).status_code == 201
            # Alice is under her share, the service is full: the refusal gives her own count, not the service's.
            at_capacity = create(ALICE)
            assert at_capacity.status_code == 429
            assert at_capacity.json()["error"] == (
                "At capacity: the service has as many sessions open as it may (METAAGENT_SESSION_MAX), 0 of them "
                "yours; close one (DELETE /sessions/{id}) or retry later"
            )
        finally:
            for key, session_id in opened:
                httpx2.delete(f"{service.base_url}/sessions/{session_id}", headers=bearer(key), timeout=60)
