"""Forwarding to the replica that holds what a request names, over real HTTP and a real Redis: what is
forwarded (and what is not: the caller's key), byte for byte; what is refused before anything is sent;
and how a forward is told from a caller's request."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import httpx2
import pytest
from starlette.types import Receive, Scope, Send

from metaagent.access import CALLER_SCOPE_KEY, FORWARDED_SCOPE_KEY
from metaagent.catalogue import open_session
from metaagent.errors import Gone, UpstreamError
from metaagent.fleet import state as state_module
from metaagent.fleet.routing import AcceptFleetRequests, Forwarder, Peers, ReplicaUnreachable, RouteToOwner
from metaagent.fleet.state import RedisState
from metaagent.sessions.models import SessionCreateRequest
from metaagent.tenancy import Caller
from metaagent.tools.code_interpreter import CodeInterpreterRequest
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

TOKEN = "f" * 40
SESSION = "ses_" + "ab" * 12


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        record = {"method": self.command, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
        self.seen.append({**record, "body": body.decode("latin-1")})
        answer = json.dumps(record).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_PUT = do_POST = do_DELETE = _handle


@pytest.fixture
def owner() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The replica that holds the session: a real HTTP server on 127.0.0.1 that echoes what reached it."""
    seen: list[dict[str, Any]] = []
    handler = type("Echo", (_Echo,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


async def _here(scope: Scope, receive: Receive, send: Send) -> None:
    """This replica's own routes: says what it was asked and as whom."""
    caller = scope.get(CALLER_SCOPE_KEY)
    body = json.dumps(
        {
            "served_here": scope["path"],
            "forwarded": bool(scope.get(FORWARDED_SCOPE_KEY)),
            "caller": None if caller is None else [caller.key_id, caller.operator],
            "user": "user" in scope,
        }
    ).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _as(caller: Caller):  # type: ignore[no-untyped-def]
    """Stands for the key check: the caller it found, in the scope."""

    def middleware(app: Any) -> Any:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and CALLER_SCOPE_KEY not in scope:
                scope = {**scope, CALLER_SCOPE_KEY: caller}
            await app(scope, receive, send)

        return wrapped

    return middleware


@pytest.fixture
async def replica(
    redis_server: RedisServer, owner: tuple[str, list[dict[str, Any]]]
) -> AsyncIterator[httpx2.AsyncClient]:
    """Replica a (this one): its middlewares around `_here`, over a Redis where replica b holds SESSION."""
    owner_url, _ = owner
    a = RedisState(redis_server.url, "a", "http://127.0.0.1:1")
    b = RedisState(redis_server.url, "b", owner_url)
    await a.start()
    await b.start()
    await b.publish("session", SESSION, "alice", {})
    forwarder = Forwarder(TOKEN)
    peers = Peers(a, forwarder)
    app = AcceptFleetRequests(_as(Caller("alice"))(RouteToOwner(_here, lambda: peers)), TOKEN)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1:3102") as client:
        yield client
    await forwarder.aclose()
    await a.close()
    await b.close()


async def test_a_request_for_what_another_replica_holds_is_forwarded_as_its_caller_without_its_key(
    replica: httpx2.AsyncClient, owner: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, seen = owner
    answer = await replica.put(
        f"/sessions/{SESSION}/files/data/%2541.txt?overwrite=1",
        content=b"\x00bytes \xff as sent",
        headers={"Authorization": "Bearer alices-own-key", "X-Custom": "kept", "Connection": "keep-alive"},
    )
    assert answer.status_code == 200, answer.text
    (request,) = seen
    assert request["method"] == "PUT"
    assert request["path"] == f"/sessions/{SESSION}/files/data/%2541.txt?overwrite=1"  # as written, not decoded
    assert request["body"] == b"\x00bytes \xff as sent".decode("latin-1")
    headers = request["headers"]
    assert "authorization" not in headers
    assert headers["x-custom"] == "kept"
    assert headers["x-metaagent-fleet-token"] == TOKEN
    assert json.loads(headers["x-metaagent-fleet-caller"]) == {"key_id": "alice", "operator": False}
    # Not a session of the fleet's: this replica answers (its own 404 in the service).
    local = await replica.get("/sessions/ses_" + "cd" * 12)
    assert local.json()["served_here"] == "/sessions/ses_" + "cd" * 12
    assert len(seen) == 1


async def test_a_path_with_dot_segments_is_refused_before_anything_is_forwarded(
    redis_server: RedisServer, owner: tuple[str, list[dict[str, Any]]]
) -> None:
    """As the server passes a request line it was sent (h11 does not resolve dot segments; an HTTP client
    library would, so the scope is made by hand)."""
    owner_url, seen = owner
    a, b = RedisState(redis_server.url, "a", "http://127.0.0.1:1"), RedisState(redis_server.url, "b", owner_url)
    await a.start()
    await b.start()
    await b.publish("session", SESSION, "alice", {})
    forwarder = Forwarder(TOKEN)
    peers = Peers(a, forwarder)
    app = _as(Caller("alice"))(RouteToOwner(_here, lambda: peers))
    try:
        for raw in (
            f"/sessions/{SESSION}/files/../../../executions/exe_{'0' * 24}",
            f"/sessions/{SESSION}/files/%2e%2E/x",
        ):
            status = await _status_of(app, raw)
            assert status == 400, raw
    finally:
        await forwarder.aclose()
        await a.close()
        await b.close()
    assert seen == []


async def _status_of(app: Any, raw_path: str) -> int:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": unquote(raw_path), "raw_path": raw_path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1:3102")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 3102),
    }  # fmt: skip
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


async def test_a_forward_goes_straight_to_the_replica_whatever_proxy_the_environment_names(
    redis_server: RedisServer, owner: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    owner_url, seen = owner
    forwarder = Forwarder(TOKEN)
    try:
        answer = await forwarder.http.get(f"{owner_url}/x", headers=forwarder.headers(Caller("alice")))
    finally:
        await forwarder.aclose()
    assert answer.status_code == 200
    assert seen[0]["path"] == "/x"


async def test_only_the_fleet_token_makes_a_request_a_forward_and_its_caller_is_then_the_claimed_one() -> None:
    app = AcceptFleetRequests(_as(Caller("mallory"))(_here), TOKEN)
    no_fleet = AcceptFleetRequests(_as(Caller("mallory"))(_here), None)
    claimed = json.dumps({"key_id": "ops", "operator": True})
    async with (
        httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1") as client,
        httpx2.AsyncClient(transport=httpx2.ASGITransport(app=no_fleet), base_url="http://127.0.0.1") as alone,
    ):
        for token in ("", "f" * 39, "F" * 40, TOKEN + "f"):
            refused = await client.get(
                "/", headers={"x-metaagent-fleet-token": token, "x-metaagent-fleet-caller": claimed}
            )
            assert refused.status_code == 401, token
        refused = await alone.get("/", headers={"x-metaagent-fleet-token": TOKEN, "x-metaagent-fleet-caller": claimed})
        assert refused.status_code == 401
        plain = (await client.get("/", headers={"x-metaagent-fleet-caller": claimed})).json()
        assert (plain["caller"], plain["forwarded"]) == (["mallory", False], False)  # the header alone: ignored
        forwarded = (
            await client.get("/", headers={"x-metaagent-fleet-token": TOKEN, "x-metaagent-fleet-caller": claimed})
        ).json()
        assert (forwarded["caller"], forwarded["forwarded"], forwarded["user"]) == (["ops", True], True, True)
        keyless = json.dumps({"key_id": None, "operator": False})
        local = (
            await client.get("/", headers={"x-metaagent-fleet-token": TOKEN, "x-metaagent-fleet-caller": keyless})
        ).json()
        assert (local["caller"], local["user"]) == ([None, False], False)  # no key: no MCP owner, as RequireApiKey


class _Sink:
    def __init__(self) -> None:
        self.pieces: list[tuple[str, str]] = []

    def started(self) -> None:
        pass

    def output(self, stream: str, text: str) -> None:
        self.pieces.append((stream, text))


async def test_a_relayed_call_is_tried_elsewhere_only_if_nothing_reached_the_replica(redis_server: RedisServer) -> None:
    """Refused at connect: nothing ran, another replica may take it. Broken off after its answer began: it may
    have run, so it is an error, never a second run elsewhere."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    broken_url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def answer_then_break() -> None:
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'1a\r\nevent: stdout\r\ndata: {"te'
        )
        connection.close()

    thread = threading.Thread(target=answer_then_break, daemon=True)
    thread.start()
    refused_url = _refusing_url()
    state = RedisState(redis_server.url, "a", "http://127.0.0.1:1")
    forwarder = Forwarder(TOKEN)
    peers = Peers(state, forwarder)
    request = CodeInterpreterRequest(code="console.log(1)")
    sink = _Sink()
    try:
        with pytest.raises(ReplicaUnreachable):
            await peers.call_tool(refused_url, "code_interpreter", request, Caller("alice"), None)
        with pytest.raises(UpstreamError, match="may have run"):
            await peers.call_tool(broken_url, "code_interpreter", request, Caller("alice"), sink)  # type: ignore[arg-type]
    finally:
        await forwarder.aclose()
        await state.close()
        listener.close()
        thread.join(5)


def _refusing_url() -> str:
    """A loopback port bound but not listening: a connection to it is refused, as to a replica that stopped."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{unused.getsockname()[1]}"


async def test_a_session_of_a_replica_that_stopped_answers_its_410_while_this_one_still_lists_that_replica_live(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica a read the live replicas just before b stopped (they stay fresh for a moment): the forward to b
    is refused, so a reads them again, and finds b's session ended. A replica still listed live that
    refuses is a 503, over HTTP and for a tool call alike."""
    monkeypatch.setattr(state_module, "REPLICAS_FRESH_S", 3600.0)  # what a read just before the stop gives
    a = RedisState(redis_server.url, "a", "http://127.0.0.1:1")
    b = RedisState(redis_server.url, "b", _refusing_url())
    await a.start()
    await b.start()
    await b.publish("session", SESSION, "alice", {})
    forwarder = Forwarder(TOKEN)
    peers = Peers(a, forwarder)
    app = _as(Caller("alice"))(RouteToOwner(_here, lambda: peers))
    request = CodeInterpreterRequest(code="1", session_id=SESSION)

    async def tool_call() -> object:
        async def there(node_url: str) -> object:
            return await peers.call_tool(node_url, "code_interpreter", request, Caller("alice"), None)

        async def here() -> object:
            return "served here"

        return await peers.at_owner("session", SESSION, Caller("alice"), there=there, here=here)

    try:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            refused = await client.get(f"/sessions/{SESSION}")
            assert refused.status_code == 503, refused.text
            assert "cannot be reached" in refused.json()["error"]
            with pytest.raises(ReplicaUnreachable):
                await tool_call()
            # b stops as a replica does: its sessions end `stopped`, its records go, then its heartbeat.
            await b.bury(SESSION, "alice", "stopped", keep_s=60)
            await b.withdraw("session", SESSION)
            await b.close()
            ended = await client.get(f"/sessions/{SESSION}")
            assert (ended.status_code, ended.json()["reason"]) == (410, "stopped"), ended.text
        with pytest.raises(Gone, match="stopped"):
            await tool_call()
    finally:
        await forwarder.aclose()
        await a.close()


class _SessionsHere:
    """This replica's sessions, as `open_session` sees them: full past its share, so the fleet is asked."""

    open_count = 5
    limits = SimpleNamespace(max_sessions=4)

    def __init__(self) -> None:
        self.created: list[SessionCreateRequest] = []

    async def create(self, request: SessionCreateRequest, caller: Caller) -> str:
        self.created.append(request)
        return "opened here"


async def test_a_new_session_whose_chosen_replica_refuses_the_connection_opens_here(redis_server: RedisServer) -> None:
    """The replica that holds the fewest sessions was chosen, but refused the connection (nothing reached
    it): the session opens on this replica, whose own admission decides, instead of a 503."""
    a = RedisState(redis_server.url, "a", "http://127.0.0.1:1")
    b = RedisState(redis_server.url, "b", _refusing_url())
    b.load = lambda: {"sessions": 0}
    await a.start()
    await b.start()
    forwarder = Forwarder(TOKEN)
    sessions = _SessionsHere()
    svc = SimpleNamespace(peers=Peers(a, forwarder), sessions=sessions)
    try:
        assert await svc.peers.session_home(sessions.open_count, sessions.limits.max_sessions) == b.node_url
        opened: object = await open_session(svc, SessionCreateRequest())  # type: ignore[arg-type]
    finally:
        await forwarder.aclose()
        await a.close()
        await b.close()
    assert opened == "opened here"
    assert len(sessions.created) == 1
