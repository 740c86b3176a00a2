"""Any replica answers for any execution, session or MCP session: it serves what it holds, and forwards
the rest, byte for byte, to the replica that holds it.

Two ASGI middlewares, and the client that forwards:

- `AcceptFleetRequests` (outermost but for the hang-up log) takes a request another replica forwarded: it
  carries the fleet's secret (`METAAGENT_FLEET_TOKEN`, compared in constant time; a wrong one is a 401)
  and the original caller's identity, which this replica then checks ownership against exactly as if the
  caller had come here. Its Host and Origin were checked where it came in (a web page cannot know the
  fleet's secret, so DNS rebinding cannot make one). A forwarded request is served here and never
  forwarded again.
- `RouteToOwner` (inside the key check, so the caller is known) looks up which replica holds the id that a
  request names (`/sessions/{id}...`, `/executions/{id}`, an `Mcp-Session-Id`) and forwards it there:
  method, path, query, headers (the caller's own Host and Origin, which passed the same checks here, but
  not its API key) and body, streamed in both directions in the chunks they arrive in, so an SSE stream
  or a file body of any size passes through without being held. A session whose replica is lost answers
  410 `node_lost`; one that ended on another replica answers its 410 from the shared tombstone. A path
  with `.` or `..` segments is refused before it is forwarded (a URL client would resolve them into
  another route there).
- `Peers`, the other live replicas: asked for their part of a listing (`GET /sessions`, `GET
  /executions`), sent a tool call that names a session one of them holds (`call_tool`), handed a call this
  replica has no room for (`hand_over`), and chosen for a new session past this one's share
  (`session_home`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes

import anyio
import httpx2
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from pydantic import BaseModel, ConfigDict
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metaagent.access import CALLER_SCOPE_KEY, FORWARDED_SCOPE_KEY, acting_as
from metaagent.asgi import send_json_error
from metaagent.errors import AtCapacity, Gone, MetaAgentError, ServiceError, Unavailable, UpstreamError
from metaagent.fleet.state import Kind, Replica, SharedState, SharedStateUnavailable
from metaagent.sandbox.output import OutputSink, Stream
from metaagent.tenancy import LOCAL, Caller, may_access

log = logging.getLogger("metaagent")

T = TypeVar("T")

TOKEN_HEADER = b"x-metaagent-fleet-token"
CALLER_HEADER = b"x-metaagent-fleet-caller"
MCP_SESSION_HEADER = b"mcp-session-id"

# Hop-by-hop headers (RFC 9110 7.6.1) are the connection's, not the message's. A body keeps its
# Content-Length, or is sent on chunked as it came.
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade"}
)  # fmt: skip
_NOT_FORWARDED = _HOP_BY_HOP | {b"authorization", TOKEN_HEADER, CALLER_HEADER}


class ReplicaUnreachable(Unavailable):
    """Another replica could not be reached: nothing was sent, so the call may go elsewhere."""


_UNREACHABLE = "The replica that holds this cannot be reached right now; retry in a few seconds"
# A forward or a relayed call that failed with one of these never reached the other replica: it may go elsewhere.
_NOTHING_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)


def _unreachable(node_url: str, exc: Exception) -> ReplicaUnreachable:
    log.warning("fleet: the replica at %s could not be reached: %s", node_url, type(exc).__name__)
    return ReplicaUnreachable(_UNREACHABLE)


class _CallerHungUp(Exception):
    """The caller went away in the middle of its request's body: the forward is abandoned, never sent short."""


_SESSION_PATH = re.compile(r"^/sessions/(ses_[0-9a-f]{24})(?:/.*)?$", re.DOTALL)
_EXECUTION_PATH = re.compile(r"^/executions/(exe_[0-9a-f]{24})$")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


# Whether the request being served came from another replica: it is answered here, never handed on again.
_serving_a_forward: ContextVar[bool] = ContextVar("metaagent_serving_a_forward", default=False)


class AcceptFleetRequests:
    """ASGI middleware: a request that carries the fleet's secret is another replica's forward."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        presented = _header(scope, TOKEN_HEADER) if scope["type"] == "http" else None
        if presented is None:
            await self.app(scope, receive, send)
            return
        if self.token is None or not hmac.compare_digest(presented, self.token):
            log.warning("refused %s %s: a wrong fleet token", scope["method"], scope["path"])
            await send_json_error(send, 401, "Invalid fleet token: replicas must share METAAGENT_FLEET_TOKEN")
            return
        try:
            claimed = json.loads(_header(scope, CALLER_HEADER) or b"{}")
            caller = Caller(claimed.get("key_id"), bool(claimed.get("operator")))
        except (ValueError, AttributeError):
            await send_json_error(send, 400, "A forwarded request's caller header is not the fleet's JSON")
            return
        scope = {**scope, FORWARDED_SCOPE_KEY: True, CALLER_SCOPE_KEY: caller}
        if caller.key_id is not None:  # as RequireApiKey sets it: the MCP SDK ties a session to its key
            scope["user"] = AuthenticatedUser(AccessToken(token="", client_id=caller.key_id, scopes=[]))
        handed = _serving_a_forward.set(True)
        try:
            with acting_as(caller):
                await self.app(scope, receive, send)
        finally:
            _serving_a_forward.reset(handed)


class Forwarder:
    """Sends a request to another replica as the fleet, and streams its answer back."""

    def __init__(self, token: str) -> None:
        self._token = token
        # No read deadline: an SSE stream or a long call answers when it answers. Connecting, writing and
        # waiting for a pooled connection are bounded. No connection cap of its own: every forward stands
        # for a caller's connection, which METAAGENT_MAX_CONNECTIONS caps. Never a proxy from the
        # environment: the fleet token and the caller's identity go to the other replica only.
        self.http = httpx2.AsyncClient(
            timeout=httpx2.Timeout(None, connect=5.0, write=30.0, pool=10.0),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
            follow_redirects=False,
            trust_env=False,
        )

    def headers(self, caller: Caller, original: Iterable[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
        identity = json.dumps({"key_id": caller.key_id, "operator": caller.operator}).encode()
        kept = [(k, v) for k, v in original if k.lower() not in _NOT_FORWARDED]
        return [*kept, (TOKEN_HEADER, self._token.encode()), (CALLER_HEADER, identity)]

    async def forward(self, node_url: str, scope: Scope, receive: Receive, send: Send) -> None:
        caller = caller_of_scope(scope)
        query = scope.get("query_string", b"")
        url = node_url + scope["raw_path"].decode("latin-1") if scope.get("raw_path") else node_url + scope["path"]
        if query:
            url += "?" + query.decode("latin-1")
        has_body = _header(scope, b"content-length") not in (None, b"0") or _header(scope, b"transfer-encoding")
        try:
            request = self.http.build_request(
                scope["method"], url, headers=self.headers(caller, scope["headers"]),
                content=_body(receive) if has_body else None,
            )  # fmt: skip
        except httpx2.InvalidURL:
            await send_json_error(
                send, 400, "This request's path cannot be forwarded as written: send it percent-encoded"
            )
            return
        try:
            response = await self.http.send(request, stream=True)
        except _CallerHungUp:
            return
        except _NOTHING_SENT as exc:
            raise _unreachable(node_url, exc) from None
        except httpx2.TransportError as exc:
            log.warning("fleet: the replica at %s could not be reached: %s", node_url, type(exc).__name__)
            await send_json_error(
                send, 503, "The replica that holds this cannot be reached right now; retry in a few seconds"
            )
            return
        try:
            headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _CallerHungUp
        body = message.get("body", b"")
        if body:
            yield body
        if not message.get("more_body", False):
            return


def forwarded(request: Any) -> bool:
    """Whether a Starlette request is another replica's forward (answered with this replica's part only)."""
    return bool(request.scope.get(FORWARDED_SCOPE_KEY))


def caller_of_scope(scope: Scope) -> Caller:
    """The caller the key check (or a forward's header) put in the scope; the local caller without keys."""
    caller = scope.get(CALLER_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else LOCAL


class RouteToOwner:
    """ASGI middleware: forwards a request for an id another replica holds to that replica. `peers()` is
    the running service's (None on one machine, where every request is served here)."""

    def __init__(self, app: ASGIApp, peers: Callable[[], Peers | None]) -> None:
        self.app = app
        self.peers = peers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peers = self.peers() if scope["type"] == "http" and not scope.get(FORWARDED_SCOPE_KEY) else None
        if peers is None:
            await self.app(scope, receive, send)
            return
        state = peers.state
        named = _named(scope)
        if named is None:
            if scope["path"].rstrip("/") == "/mcp":  # a new MCP session: say where it lives once it exists
                send = _publishing_mcp_session(state, caller_of_scope(scope), send)
            await self.app(scope, receive, send)
            return
        kind, record_id = named
        if state.holds(kind, record_id):
            await self.app(scope, receive, send)
            return
        if _has_dot_segments(scope):  # a URL client would resolve them: the forward would reach another route
            await send_json_error(send, 400, "A path with . or .. segments is refused: name the resource directly")
            return

        async def there(node_url: str) -> None:
            await peers.forwarder.forward(node_url, scope, receive, send)

        async def here() -> None:  # not the fleet's to answer: this replica's 404 (or its own 410)
            await self.app(scope, receive, send)

        try:
            await peers.at_owner(kind, record_id, caller_of_scope(scope), there=there, here=here)
        except (SharedStateUnavailable, ReplicaUnreachable) as exc:
            await send_json_error(send, 503, exc.message)
        except Gone as gone:
            await _send_gone(send, gone)


def _publishing_mcp_session(state: SharedState, caller: Caller, send: Send) -> Send:
    """`send`, which also publishes the MCP session that the answer names (an `initialize`'s)."""

    async def publishing(message: Message) -> None:
        if message["type"] == "http.response.start":
            for key, value in message.get("headers", []):
                if key.lower() == MCP_SESSION_HEADER:
                    await state.publish("mcp", bytes(value).decode("latin-1"), caller.key_id, {})
        await send(message)

    return publishing


def _has_dot_segments(scope: Scope) -> bool:
    raw = bytes(scope.get("raw_path") or scope["path"].encode())
    segments = {unquote_to_bytes(segment) for segment in raw.split(b"/")}
    return bool(segments & {b".", b".."})


def _named(scope: Scope) -> tuple[Kind, str] | None:
    path = scope["path"]
    if match := _SESSION_PATH.match(path):
        return "session", match.group(1)
    if match := _EXECUTION_PATH.match(path):
        return "execution", match.group(1)
    if path.rstrip("/") == "/mcp" and (mcp_session := _header(scope, MCP_SESSION_HEADER)):
        return "mcp", mcp_session.decode("latin-1")
    return None


async def _send_gone(send: Send, gone: Gone) -> None:
    body = json.dumps(gone.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": gone.status_code,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Peers:
    """The other live replicas, asked for their part of a listing."""

    def __init__(self, state: SharedState, forwarder: Forwarder) -> None:
        self.state = state
        self.forwarder = forwarder

    async def gather(self, path: str, caller: Caller, field: str) -> list[Any]:
        """`field`'s items from `GET path` on every other live replica (one that does not answer in 5 s is
        left out, and logged)."""
        try:
            nodes = await self.state.nodes()
        except SharedStateUnavailable:
            return []
        found: list[Any] = []

        async def ask(node_id: str, url: str) -> None:
            try:
                with anyio.fail_after(5):
                    response = await self.forwarder.http.get(url + path, headers=self.forwarder.headers(caller))
                response.raise_for_status()
                found.extend(response.json()[field])
            except (httpx2.HTTPError, TimeoutError, ValueError, KeyError) as exc:
                log.warning("fleet: node %s did not give its part of %s: %s", node_id, path, type(exc).__name__)

        async with anyio.create_task_group() as group:
            for node_id, url in nodes.items():
                if node_id != self.state.node_id:
                    group.start_soon(ask, node_id, url)
        return found

    async def hand_over(
        self, tool: str, request: BaseModel, caller: Caller, sink: OutputSink | None, full: AtCapacity
    ) -> BaseModel:
        """Runs a call that this replica has no room for on another: the least loaded first (by the load each
        reported at its last beat), each in turn while they answer 429 or cannot be reached. Raises `full`,
        this replica's own 429, when every replica is full, or when the call was handed here by another."""
        if _serving_a_forward.get():
            raise full
        try:
            replicas = await self.state.replicas()
        except SharedStateUnavailable:
            raise full from None
        others = sorted(
            (replica for node_id, replica in replicas.items() if node_id != self.state.node_id), key=_busyness
        )
        for replica in others:
            try:
                return await self.call_tool(replica.url, tool, request, caller, sink)
            except (AtCapacity, ReplicaUnreachable):
                continue  # it filled up since its last beat, or it was not reached (nothing ran): the next one
        raise full

    async def session_home(self, open_here: int, session_max: int) -> str | None:
        """Where a new session should open: None for here, while this replica holds less than its even share
        of the fleet's sessions (`METAAGENT_SESSION_MAX` over the live replicas), or no other holds fewer;
        else the replica that holds the fewest (as each reported at its last beat)."""
        if _serving_a_forward.get():
            return None
        try:
            replicas = await self.state.replicas()
        except SharedStateUnavailable:
            return None  # the admission answers the 503
        if open_here < math.ceil(session_max / max(1, len(replicas))):
            return None
        others = [
            (r.load.get("sessions", 0), r.url) for node_id, r in replicas.items() if node_id != self.state.node_id
        ]
        fewest = min(others, default=None)
        return fewest[1] if fewest is not None and fewest[0] < open_here else None

    async def owner_of(self, kind: Kind, record_id: str, caller: Caller) -> str | None:
        """The URL of the other replica that holds the record, for a request or a tool call that names it;
        None when this replica is the one to answer (it holds it, or nobody does: its own 404). A session
        of a lost replica, or one that ended elsewhere, is its 410 (`Gone`, to a caller who may know of it)."""
        if self.state.holds(kind, record_id):
            return None
        placed = await self.state.place(kind, record_id)
        if placed is not None and placed.node_url is not None and placed.node_id != self.state.node_id:
            return placed.node_url
        if kind != "session":
            return None
        if placed is not None and placed.lost and may_access(caller, placed.owner):
            raise Gone(f"Session {record_id} has ended: node_lost", reason="node_lost")
        tombstone = await self.state.tombstone(record_id) if placed is None else None
        if tombstone is not None and may_access(caller, tombstone.owner):
            raise Gone(f"Session {record_id} has ended: {tombstone.reason}", reason=tombstone.reason)
        return None

    async def at_owner(
        self,
        kind: Kind,
        record_id: str,
        caller: Caller,
        *,
        there: Callable[[str], Awaitable[T]],
        here: Callable[[], Awaitable[T]],
    ) -> T:
        """`there(url)` for the other replica that holds the record (`owner_of`), else `here()`.

        A replica that refuses the connection (nothing was sent) may just have stopped, and this replica may
        still list it live (the replicas read up to REPLICAS_FRESH_S ago): the replicas are read from Redis
        again and the record found again, once. So a session of a replica that stopped answers its 410
        `stopped`, not a 503; a replica still listed live that refuses is ReplicaUnreachable (a 503)."""
        refused: str | None = None
        while True:
            node_url = await self.owner_of(kind, record_id, caller)
            if node_url is None:
                return await here()
            if node_url == refused:
                raise ReplicaUnreachable(_UNREACHABLE)
            try:
                return await there(node_url)
            except ReplicaUnreachable:
                if refused is not None:
                    raise
                refused = node_url
                self.state.forget_replicas()

    async def call_tool(
        self, node_url: str, tool: str, request: BaseModel, caller: Caller, sink: OutputSink | None
    ) -> BaseModel:
        """Runs the tool call on the replica at `node_url` (`POST /tools/<tool>`, as its caller), and answers
        what it answered: its result, or its error as this replica's. With a sink, the call streams (SSE)
        and its output reaches the sink as it comes."""
        url = f"{node_url}/tools/{tool}"
        body = request.model_dump(mode="json", exclude_unset=True)  # what the caller said, not the defaults
        headers = self.forwarder.headers(caller)
        if sink is not None:
            headers.append((b"accept", b"text/event-stream"))
        try:
            async with self.forwarder.http.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _relayed_error(response)
                if sink is None:
                    return Relayed.model_validate_json(await response.aread())
                sink.started()
                async for event in httpx2.EventSource(response):
                    data = event.json()
                    if not isinstance(data, dict):
                        raise UpstreamError("The replica that holds this session sent an event that is not JSON")
                    if event.event in _OUTPUT_STREAMS:
                        sink.output(_OUTPUT_STREAMS[event.event], str(data["text"]))
                    elif event.event == "result":
                        return Relayed.model_validate(data)
                    elif event.event == "error":
                        raise service_error_of(data.pop("status", 502), data)
        except _NOTHING_SENT as exc:
            raise _unreachable(node_url, exc) from None
        except httpx2.TransportError as exc:  # it may have run: never run it again elsewhere
            log.warning("fleet: the replica at %s broke off its answer: %s", node_url, type(exc).__name__)
            raise UpstreamError(
                "The replica that ran this call broke off its answer; the call may have run (check before retrying)"
            ) from None
        raise UpstreamError("The replica that holds this session ended its answer without a result")


def _busyness(replica: Replica) -> tuple[bool, float]:
    """A replica's order among those a call may be handed to: with room first, then the least busy."""
    load = replica.load
    capacity, queue = max(1, load.get("capacity", 1)), load.get("queue", 0)
    running, waiting = load.get("running", 0), load.get("waiting", 0)
    return running >= capacity and waiting >= queue, (running + waiting) / capacity


_OUTPUT_STREAMS: dict[str, Stream] = {"stdout": "stdout", "stderr": "stderr"}


class Relayed(BaseModel):
    """Another replica's answer to a tool call, exactly as it gave it (every field it had)."""

    model_config = ConfigDict(extra="allow")


def _relayed_error(response: httpx2.Response) -> MetaAgentError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        return UpstreamError(f"The replica that holds this session answered {response.status_code} without an error")
    return service_error_of(response.status_code, body)


def service_error_of(status: object, body: dict[str, Any]) -> MetaAgentError:
    """The error another replica answered, raised here with its status and every field of its body."""
    extra = {k: v for k, v in body.items() if k not in ("error", "status")}
    message = str(body.get("error", "the call failed on the replica that holds it"))
    code = status if isinstance(status, int) else 502
    if code == 429:
        retry_after = extra.get("retry_after_s")
        return AtCapacity(message, retry_after_s=retry_after if isinstance(retry_after, int) else 5)
    return ServiceError(code, message, **extra)
