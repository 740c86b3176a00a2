"""Two replicas over one real Redis act as one service: whatever one holds, the other answers for.

Here both replicas are real `metaagent serve` processes on loopback beside one engine (each owns and
sweeps only its own containers), with a redis-server of the test's own. What crosses between them is real
HTTP: the forwarded calls, streams and file bodies, the listings, and the leases in Redis.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import docker
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from metaagent.sandbox.engine import OWNER_PID_LABEL
from tests.redis_server import RedisServer
from tests.sandbox.conftest import Service, running_service
from tests.sandbox.test_tenancy import KEYS, LONG_RUN, OPERATOR, bearer
from tests.test_access import ALICE, BOB
from tests.test_cli import free_port

pytestmark = [pytest.mark.docker, pytest.mark.redis, pytest.mark.slow]

TOKEN = secrets.token_urlsafe(32)


def replica(workdir: Path, redis: RedisServer, **env: str) -> Iterator[Service]:
    port = free_port()
    return running_service(
        workdir,
        port=port,
        METAAGENT_REDIS_URL=redis.url,
        METAAGENT_NODE_URL=f"http://127.0.0.1:{port}",
        METAAGENT_FLEET_TOKEN=TOKEN,
        METAAGENT_API_KEYS=KEYS,
        METAAGENT_POOL_SIZE="1",  # two services on two cores beside the other tests: a small pool each
        **env,
    )


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient
) -> Iterator[tuple[Service, Service]]:
    redis = RedisServer(tmp_path_factory.mktemp("redis", numbered=True))
    redis.start()
    limits = {"METAAGENT_SESSION_MAX": "3", "METAAGENT_SESSIONS_PER_KEY": "2", "METAAGENT_MAX_EXECUTIONS_PER_KEY": "2"}
    try:
        with (
            replica(tmp_path_factory.mktemp("a"), redis, **limits) as a,
            replica(tmp_path_factory.mktemp("b"), redis, **limits) as b,
        ):
            yield a, b
    finally:
        redis.stop()


def call(service: Service, method: str, path: str, key: str = ALICE, **kwargs: object) -> httpx2.Response:
    return httpx2.request(method, f"{service.base_url}{path}", headers=bearer(key), timeout=120, **kwargs)  # type: ignore[arg-type]


def test_a_session_opened_on_one_replica_is_used_and_closed_through_the_other(fleet: tuple[Service, Service]) -> None:
    a, b = fleet
    created = call(a, "POST", "/sessions", json={})
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]

    first = call(b, "POST", f"/sessions/{session_id}/execute", json={"code": "globalThis.x = 41; x + 1"})
    assert (first.status_code, first.json()["result"]) == (200, "42"), first.text
    again = call(a, "POST", f"/sessions/{session_id}/execute", json={"code": "x"})
    assert again.json()["result"] == "41"  # one session, one state, whichever replica was asked

    with httpx2.stream(
        "POST", f"{b.base_url}/sessions/{session_id}/execute", json={"code": "console.log('a'); console.log('b'); 7"},
        headers={**bearer(ALICE), "Accept": "text/event-stream"}, timeout=120,
    ) as stream:  # fmt: skip
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [(sse.event, sse.json()) for sse in httpx2.EventSource(stream)]
    assert "".join(data["text"] for kind, data in events if kind == "stdout") == "a\nb\n"
    assert events[-1][0] == "result"
    assert events[-1][1]["result"] == "7"

    body = os.urandom(3 * 1024 * 1024 + 17)  # several chunks each way
    put = call(b, "PUT", f"/sessions/{session_id}/files/data/random.bin", content=body)
    assert put.status_code in (200, 201), put.text
    downloaded = call(b, "GET", f"/sessions/{session_id}/files/data/random.bin")
    assert downloaded.status_code == 200
    assert downloaded.content == body
    assert call(a, "GET", f"/sessions/{session_id}/files/data/random.bin").content == body
    listed = call(b, "GET", f"/sessions/{session_id}/files").json()
    assert [f["path"] for f in listed["files"]] == ["data/random.bin"]

    assert [s["session_id"] for s in call(b, "GET", "/sessions").json()["sessions"]] == [session_id]
    assert call(b, "GET", f"/sessions/{session_id}").json()["executions"] == 3
    # Another key is told nothing, through either replica; the owner checked it again.
    for service in (a, b):
        assert call(service, "GET", f"/sessions/{session_id}", key=BOB).status_code == 404
        assert call(service, "POST", f"/sessions/{session_id}/execute", key=BOB, json={"code": "1"}).status_code == 404
        assert call(service, "GET", "/sessions", key=BOB).json()["sessions"] == []

    closed = call(b, "DELETE", f"/sessions/{session_id}")
    assert closed.status_code == 200, closed.text
    for service in (a, b):
        gone = call(service, "GET", f"/sessions/{session_id}")
        assert (gone.status_code, gone.json()["reason"]) == (410, "closed"), gone.text
        assert call(service, "GET", f"/sessions/{session_id}", key=BOB).status_code == 404


def test_a_forward_without_the_fleet_token_is_refused(fleet: tuple[Service, Service]) -> None:
    a, _ = fleet
    caller = json.dumps({"key_id": "ops", "operator": True})
    for token in ("wrong" * 8, ""):
        refused = httpx2.get(
            f"{a.base_url}/sessions",
            headers={"x-metaagent-fleet-token": token, "x-metaagent-fleet-caller": caller},
            timeout=30,
        )
        assert refused.status_code == 401, refused.text
        assert "fleet token" in refused.json()["error"]
    assert TOKEN not in a.stderr_path.read_text()


def test_a_running_execution_is_listed_and_killed_through_the_other_replica(fleet: tuple[Service, Service]) -> None:
    a, b = fleet
    answers: list[httpx2.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(call(a, "POST", "/tools/code-interpreter", json=LONG_RUN)), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 120
    while not (running := [e for e in call(b, "GET", "/executions").json()["executions"] if e["state"] == "running"]):
        assert time.monotonic() < deadline, "alice's execution was not listed through the other replica"
        time.sleep(0.1)
    execution_id = running[0]["execution_id"]
    assert call(b, "GET", "/executions", key=BOB).json()["executions"] == []
    assert call(b, "DELETE", f"/executions/{execution_id}", key=BOB).status_code == 404
    assert call(b, "GET", f"/executions/{execution_id}").json()["state"] == "running"
    assert [e["execution_id"] for e in call(b, "GET", "/executions", key=OPERATOR).json()["executions"]] == [
        execution_id
    ]
    killed = call(b, "DELETE", f"/executions/{execution_id}")
    assert killed.json() == {"execution_id": execution_id, "killed": True}
    thread.join(120)
    assert answers[0].status_code == 200
    assert answers[0].json()["killed"] is True
    assert call(b, "GET", f"/executions/{execution_id}").status_code == 404


def test_the_per_key_limits_and_the_session_cap_hold_across_replicas(fleet: tuple[Service, Service]) -> None:
    """METAAGENT_SESSIONS_PER_KEY 2 and METAAGENT_SESSION_MAX 3, counted by the whole fleet: concurrent
    creates spread over both replicas never win more places than there are."""
    a, b = fleet

    def create(n: int, key: str) -> httpx2.Response:
        return call((a, b)[n % 2], "POST", "/sessions", key=key, json={})

    with ThreadPoolExecutor(8) as pool:
        alices = list(pool.map(create, range(6), [ALICE] * 6))
        bobs = list(pool.map(create, range(4), [BOB] * 4))
    opened = [(r, key) for r, key in [*((r, ALICE) for r in alices), *((r, BOB) for r in bobs)] if r.status_code == 201]
    try:
        assert sorted(r.status_code for r in alices) == [201, 201, 429, 429, 429, 429], [r.text for r in alices]
        assert sorted(r.status_code for r in bobs) == [201, 429, 429, 429], [r.text for r in bobs]
        assert any("its share" in r.json()["error"] for r in alices if r.status_code == 429)
        assert any("METAAGENT_SESSION_MAX" in r.json()["error"] for r in bobs if r.status_code == 429)
    finally:
        for response, key in opened:
            call(a, "DELETE", f"/sessions/{response.json()['session_id']}", key=key)
    # Every place came back: alice opens two again, on either replica.
    again = [create(n, ALICE) for n in range(2)]
    assert [r.status_code for r in again] == [201, 201]
    for response in again:
        call(b, "DELETE", f"/sessions/{response.json()['session_id']}")

    # METAAGENT_MAX_EXECUTIONS_PER_KEY 2, the same way.
    def run(n: int) -> httpx2.Response:
        return call((a, b)[n % 2], "POST", "/tools/code-interpreter", json={**LONG_RUN, "timeout_s": 60})

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, n) for n in range(4)]
        deadline = time.monotonic() + 120
        while len(call(a, "GET", "/executions").json()["executions"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        refused = [f.result() for f in futures if f.done()]
        for execution in call(a, "GET", "/executions").json()["executions"]:
            call(b, "DELETE", f"/executions/{execution['execution_id']}")
        answers = [f.result() for f in futures]
    assert sorted(r.status_code for r in answers) == [200, 200, 429, 429]
    assert len(refused) == 2
    assert all("METAAGENT_MAX_EXECUTIONS_PER_KEY" in r.json()["error"] for r in refused)


def test_a_replica_killed_leaves_410_node_lost_and_gives_its_places_back(
    tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient
) -> None:
    redis = RedisServer(tmp_path_factory.mktemp("redis", numbered=True))
    redis.start()
    try:
        limits = {"METAAGENT_SESSION_MAX": "1"}
        with (
            replica(tmp_path_factory.mktemp("a"), redis, **limits) as a,
            replica(tmp_path_factory.mktemp("b"), redis, **limits) as b,
        ):
            created = call(a, "POST", "/sessions", json={})
            assert created.status_code == 201, created.text
            session_id = created.json()["session_id"]
            assert call(b, "POST", "/sessions", key=BOB, json={}).status_code == 429  # the fleet's one place
            a.process.send_signal(signal.SIGKILL)
            a.process.wait(30)
            killed_at = time.monotonic()
            while (answer := call(b, "GET", f"/sessions/{session_id}")).status_code != 410:
                assert time.monotonic() - killed_at < 40, answer.text
                time.sleep(0.5)
            assert answer.json()["reason"] == "node_lost"
            assert call(b, "GET", f"/sessions/{session_id}", key=BOB).status_code == 404
            assert call(b, "GET", "/sessions").json()["sessions"] == []
            opened = call(b, "POST", "/sessions", key=BOB, json={})  # the lost replica's place came back
            assert opened.status_code == 201, opened.text
            call(b, "DELETE", f"/sessions/{opened.json()['session_id']}", key=BOB)
    finally:
        redis.stop()
        for container in docker_client.containers.list(
            all=True, filters={"label": f"{OWNER_PID_LABEL}={a.process.pid}"}
        ):
            container.remove(force=True)  # what the killed replica left (its next start would sweep it)


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next of `ports` in turn, as a load balancer without affinity would."""

    def __init__(self, ports: list[int]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.ports = itertools.cycle(ports)
        self.sent: list[tuple[int, str]] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = next(self.ports)
        request.url = request.url.copy_with(port=port)
        self.sent.append((port, request.method))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_an_mcp_client_whose_requests_alternate_between_replicas_reaches_a_session_on_either(
    fleet: tuple[Service, Service],
) -> None:
    a, b = fleet
    created = call(b, "POST", "/sessions", json={})  # the session lives on b
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    ports = [int(service.base_url.rsplit(":", 1)[1]) for service in (a, b)]
    balancer = Alternating(ports)
    notifications: list[str | None] = []

    async def on_progress(_progress: float, _total: float | None, message: str | None) -> None:
        notifications.append(message)

    try:
        with anyio.fail_after(120):
            async with (
                httpx2.AsyncClient(transport=balancer, headers=bearer(ALICE), timeout=60) as http,
                Client(streamable_http_client(f"{a.base_url}/mcp", http_client=http)) as client,
            ):
                first = await client.call_tool(
                    "code_interpreter",
                    {"code": "globalThis.y = 5; console.log('seen'); y * 2", "session_id": session_id},
                )
                streamed = await client.call_tool(
                    "code_interpreter", {"code": "console.log('again'); y", "session_id": session_id},
                    progress_callback=on_progress,
                )  # fmt: skip
                written = await client.call_tool(
                    "session_write_file", {"session_id": session_id, "path": "note.txt", "content": "from mcp"}
                )
                read = await client.call_tool("session_read_file", {"session_id": session_id, "path": "note.txt"})
                listed = {tool.name for tool in (await client.list_tools()).tools}
                closed = await client.call_tool("session_close", {"session_id": session_id})
                after = await client.call_tool("code_interpreter", {"code": "1", "session_id": session_id})
    finally:
        await balancer.aclose()
    assert {port for port, _ in balancer.sent} == set(ports)  # both replicas were asked, in turn
    assert first.is_error is False, first.content
    assert first.structured_content is not None
    assert (first.structured_content["result"], first.structured_content["stdout"]) == ("10", "seen\n")
    assert streamed.structured_content is not None
    assert streamed.structured_content["result"] == "5"
    assert "".join(m or "" for m in notifications) == "again\n"  # its output came back as it ran
    assert written.is_error is False, written.content
    assert read.structured_content is not None
    assert read.structured_content["content"] == "from mcp"
    assert "session_create" in listed
    assert closed.is_error is False, closed.content
    assert after.is_error is True
    assert "closed" in after.content[0].text  # type: ignore[union-attr]
    assert call(a, "GET", f"/sessions/{session_id}").json()["reason"] == "closed"
