"""Replicas on nodes of their own act as one service over a real Redis: whatever one holds, the others
answer for.

Each node is a network namespace with its own dockerd, its own copy of the sandbox image and its own
replica, joined to the others by veth pairs (`tests/fleet_nodes.py`); one redis-server serves them all.
What crosses between nodes is real HTTP on the nodes' own addresses: forwarded calls, streams and file
bodies, listings; and the leases in Redis.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import docker
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.fleet_nodes import Node, fleet_nodes
from tests.sandbox.test_tenancy import KEYS, LONG_RUN, OPERATOR
from tests.test_access import ALICE, BOB

pytestmark = [pytest.mark.docker, pytest.mark.redis, pytest.mark.slow]

SMALL_POOL = {"METAAGENT_POOL_SIZE": "1"}  # several services on two cores beside the other tests


@pytest.fixture(scope="module")
def fleet(docker_client: docker.DockerClient) -> Iterator[tuple[Node, Node]]:
    limits = {"METAAGENT_SESSION_MAX": "3", "METAAGENT_SESSIONS_PER_KEY": "2", "METAAGENT_MAX_EXECUTIONS_PER_KEY": "2"}
    with fleet_nodes(docker_client, 2, KEYS, **SMALL_POOL, **limits) as nodes:
        a, b = nodes.nodes
        yield a, b


def call(node: Node, method: str, path: str, key: str = ALICE, **kwargs: object) -> httpx2.Response:
    with node.client(key) as client:
        return client.request(method, path, **kwargs)  # type: ignore[arg-type]


def test_a_session_opened_on_one_node_is_used_and_closed_through_the_other(fleet: tuple[Node, Node]) -> None:
    a, b = fleet
    created = call(a, "POST", "/sessions", json={})
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]

    first = call(b, "POST", f"/sessions/{session_id}/execute", json={"code": "globalThis.x = 41; x + 1"})
    assert (first.status_code, first.json()["result"]) == (200, "42"), first.text
    again = call(a, "POST", f"/sessions/{session_id}/execute", json={"code": "x"})
    assert again.json()["result"] == "41"  # one session, one state, whichever replica was asked

    with b.client(ALICE) as client, client.stream(
        "POST", f"/sessions/{session_id}/execute", json={"code": "console.log('a'); console.log('b'); 7"},
        headers={"Accept": "text/event-stream"},
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


def test_a_forward_without_the_fleet_token_is_refused_and_the_token_is_never_logged(fleet: tuple[Node, Node]) -> None:
    a, b = fleet
    caller = json.dumps({"key_id": "ops", "operator": True})
    for token in ("wrong" * 8, ""):
        with a.client() as client:
            refused = client.get(
                "/sessions", headers={"x-metaagent-fleet-token": token, "x-metaagent-fleet-caller": caller}
            )
        assert refused.status_code == 401, refused.text
        assert "fleet token" in refused.json()["error"]
    for node in (a, b):
        assert node.env["METAAGENT_FLEET_TOKEN"] not in node.log.read_text()


def test_a_running_execution_is_listed_and_killed_through_the_other_node(fleet: tuple[Node, Node]) -> None:
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


def test_the_per_key_limits_and_the_session_cap_hold_across_nodes(fleet: tuple[Node, Node]) -> None:
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
    refused = [r for r in answers if r.status_code == 429]
    assert all("METAAGENT_MAX_EXECUTIONS_PER_KEY" in r.json()["error"] for r in refused)


def test_a_node_killed_leaves_410_node_lost_and_gives_its_places_back(docker_client: docker.DockerClient) -> None:
    with fleet_nodes(docker_client, 2, KEYS, METAAGENT_SESSION_MAX="1", **SMALL_POOL) as nodes:
        a, b = nodes.nodes
        created = call(a, "POST", "/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        assert call(b, "POST", "/sessions", key=BOB, json={}).status_code == 429  # the fleet's one place
        a.kill()
        killed_at = time.monotonic()
        while (answer := call(b, "GET", f"/sessions/{session_id}")).status_code != 410:
            assert time.monotonic() - killed_at < 40, answer.text
            time.sleep(0.5)
        assert answer.json()["reason"] == "node_lost"
        answered = call(b, "POST", f"/sessions/{session_id}/execute", json={"code": "1"})
        assert (answered.status_code, answered.json()["reason"]) == (410, "node_lost")
        assert call(b, "GET", f"/sessions/{session_id}", key=BOB).status_code == 404
        assert call(b, "GET", "/sessions").json()["sessions"] == []
        opened = call(b, "POST", "/sessions", key=BOB, json={})  # the lost node's place came back
        assert opened.status_code == 201, opened.text
        call(b, "DELETE", f"/sessions/{opened.json()['session_id']}", key=BOB)


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next of `nodes` in turn, as a load balancer without affinity would."""

    def __init__(self, nodes: list[Node]) -> None:
        self.transports = [(node.name, node.async_transport()) for node in nodes]
        self.turn = itertools.cycle(self.transports)
        self.sent: list[tuple[str, str]] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        name, transport = next(self.turn)
        self.sent.append((name, request.method))
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for _, transport in self.transports:
            await transport.aclose()


async def test_an_mcp_client_whose_requests_alternate_between_nodes_reaches_a_session_on_either(
    fleet: tuple[Node, Node],
) -> None:
    a, b = fleet
    created = call(b, "POST", "/sessions", json={})  # the session lives on b
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    balancer = Alternating([a, b])
    notifications: list[str | None] = []

    async def on_progress(_progress: float, _total: float | None, message: str | None) -> None:
        notifications.append(message)

    try:
        with anyio.fail_after(120):
            async with (
                httpx2.AsyncClient(
                    transport=balancer, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60
                ) as http,
                Client(streamable_http_client("http://127.0.0.1/mcp", http_client=http)) as client,
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
    assert {name for name, _ in balancer.sent} == {"a", "b"}  # both nodes were asked, in turn
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


def test_redis_stopped_and_started_under_load_loses_nothing_accepted_and_a_node_stopped_drains_only_its_own(
    docker_client: docker.DockerClient,
) -> None:
    """While Redis is down, new work is refused (503) and what runs goes on; once it is back (empty, as a
    server without persistence comes back), each node writes back what it holds and the fleet is whole."""
    with fleet_nodes(docker_client, 2, KEYS, **SMALL_POOL) as nodes:
        a, b = nodes.nodes
        created = call(a, "POST", "/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        assert (
            call(b, "POST", f"/sessions/{session_id}/execute", json={"code": "globalThis.kept = 'yes'"}).status_code
            == 200
        )
        answers: list[tuple[int, httpx2.Response]] = []
        stop = threading.Event()

        def load(worker: int) -> None:
            for n in itertools.count():
                if stop.is_set():
                    return
                code = f"console.log({worker * 1000 + n})"
                answers.append(
                    (worker * 1000 + n, call((a, b)[n % 2], "POST", "/tools/code-interpreter", json={"code": code}))
                )

        # One execution accepted before Redis goes, still running while it is down. Its timeout_s (30)
        # tells it apart from the load's (the default) in a's listing.
        slow = {"code": "setTimeout(() => console.log('finished'), 3000)", "timeout_s": 30}

        def slow_one_is_running() -> bool:
            listed = call(a, "GET", "/executions").json()["executions"]
            return any(e["timeout_s"] == slow["timeout_s"] and e["state"] == "running" for e in listed)

        with ThreadPoolExecutor(4) as pool:
            running = pool.submit(call, a, "POST", "/tools/code-interpreter", json=slow)
            workers = [pool.submit(load, worker) for worker in range(2)]
            # Redis goes only once a has accepted the slow execution (published it in Redis and handed
            # its code over: "running"); stopped during its admission, it would be refused with a 503.
            # (Should it have ended before a listing caught it, it was accepted all the same; one refused
            # fails on its status below.)
            deadline = time.monotonic() + 120
            while not slow_one_is_running() and not running.done():
                assert time.monotonic() < deadline, "the slow execution was never listed running on a"
                time.sleep(0.1)
            nodes.redis.stop()
            time.sleep(3.0)
            during = call(b, "POST", "/sessions", key=BOB, json={})
            health = call(b, "GET", "/health", key=OPERATOR).json()
            nodes.redis.start()
            time.sleep(2.0)
            stop.set()
            for worker in workers:
                worker.result()
            slow_answer = running.result()

        assert slow_answer.status_code == 200, slow_answer.text
        assert slow_answer.json()["stdout"] == "finished\n"
        assert during.status_code == 503, during.text
        assert "Redis" in during.json()["error"]
        assert (health["status"], health["checks"]["fleet"]["ok"]) == ("degraded", False), health
        statuses = {status for _, r in answers if (status := r.status_code) != 200}
        assert statuses <= {503}, [r.text for _, r in answers if r.status_code not in (200, 503)]
        for n, answer in answers:  # every call that was accepted ran, and answered its own output
            if answer.status_code == 200:
                assert answer.json()["stdout"] == f"{n}\n"
        assert any(r.status_code == 200 for _, r in answers)

        # The session lives on, and within a heartbeat (5 s) the other node reaches it again (the deadline
        # is generous for a busy machine).
        deadline = time.monotonic() + 120
        while (again := call(b, "POST", f"/sessions/{session_id}/execute", json={"code": "kept"})).status_code != 200:
            assert time.monotonic() < deadline, again.text
            time.sleep(0.5)
        assert again.json()["result"] == "'yes'"
        assert [s["session_id"] for s in call(b, "GET", "/sessions").json()["sessions"]] == [session_id]

        # SIGTERM of a drains a's work only: its session ends `stopped`, b's goes on. And no container
        # leaked: each replica stopped cleanly leaves its engine empty.
        on_b = call(b, "POST", "/sessions", json={}).json()["session_id"]
        a.stop()
        assert a.replica is not None
        assert a.replica.returncode == 0
        assert a.engine.containers() == []
        ended = call(b, "GET", f"/sessions/{session_id}")
        assert (ended.status_code, ended.json()["reason"]) == (410, "stopped"), ended.text
        assert call(b, "POST", f"/sessions/{on_b}/execute", json={"code": "6 * 7"}).json()["result"] == "42"
        b.stop()
        assert b.replica is not None
        assert b.replica.returncode == 0
        assert b.engine.containers() == []


def audited(node: Node, event: str) -> list[dict[str, object]]:
    lines = (node.root / "audit.jsonl").read_text().splitlines()
    return [record for line in lines if (record := json.loads(line)).get("event") == event]


def test_a_full_node_hands_new_work_to_another_and_429_means_the_whole_fleet_is_full(
    docker_client: docker.DockerClient,
) -> None:
    one_slot = {"METAAGENT_MAX_CONCURRENT_EXECUTIONS": "1", "METAAGENT_EXECUTION_QUEUE_SIZE": "0"}
    with fleet_nodes(docker_client, 2, KEYS, METAAGENT_SESSION_MAX="4", **one_slot, **SMALL_POOL) as nodes:
        a, b = nodes.nodes
        # Sessions: past its share of the fleet's four, a opens the next ones on b, which holds fewer.
        opened = [call(a, "POST", "/sessions", key=OPERATOR, json={}) for _ in range(4)]
        assert [r.status_code for r in opened] == [201] * 4, [r.text for r in opened]
        ids = {r.json()["session_id"] for r in opened}
        on_a = {r["session_id"] for r in audited(a, "session.created")}
        on_b = {r["session_id"] for r in audited(b, "session.created")}
        assert (len(on_a), len(on_b), on_a | on_b) == (2, 2, ids)
        refused = call(b, "POST", "/sessions", key=OPERATOR, json={})
        assert refused.status_code == 429  # the fleet's four are open
        for session_id in ids:
            assert call(b, "DELETE", f"/sessions/{session_id}", key=OPERATOR).status_code == 200

        # Executions: a's one slot is busy, so the next call made to a runs on b; a third finds both full.
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(call, a, "POST", "/tools/code-interpreter", key=OPERATOR, json=LONG_RUN)
            deadline = time.monotonic() + 120
            while not call(a, "GET", "/executions", key=OPERATOR).json()["executions"]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            second = pool.submit(call, a, "POST", "/tools/code-interpreter", key=OPERATOR, json=LONG_RUN)
            while len(running := call(b, "GET", "/executions", key=OPERATOR).json()["executions"]) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            full = call(a, "POST", "/tools/code-interpreter", key=OPERATOR, json={"code": "console.log(1)"})
            for execution in running:
                call(b, "DELETE", f"/executions/{execution['execution_id']}", key=OPERATOR)
            answers = [first.result(), second.result()]
        assert [r.status_code for r in answers] == [200, 200]
        assert all(r.json()["killed"] for r in answers)
        assert full.status_code == 429, full.text
        assert full.headers["retry-after"]
        assert "At capacity" in full.json()["error"]
        ran_on_b = {r["execution_id"] for r in audited(b, "execution.finished")}
        assert answers[1].json()["execution_id"] in ran_on_b
        assert answers[0].json()["execution_id"] not in ran_on_b
