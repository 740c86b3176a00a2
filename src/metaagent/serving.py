"""How the service is served: uvicorn, with deadlines on every connection and a cap on how many are open.

uvicorn's own settings cover part of it (`timeout_keep_alive`), and `metaagent serve` sets them. What
uvicorn lacks is added here, in a subclass of its httptools protocol (llhttp, the parser node uses) that
uvicorn is configured with (`http=`):

- the request line and headers must be at most `MAX_HEAD_BYTES` (16 KiB) together: a 431 JSON answer past
  it, and a head still arriving is cut off there, so no connection makes the parser buffer more than that
  and one read;
- a request the parser cannot read gets a 400 JSON answer that names what was wrong, and the connection
  is closed; behind pipelined requests, that answer waits for theirs (a queued request whose body was bad
  never runs: the 400 is its answer); an upgrade request (`Connection: upgrade`, CONNECT) is served as
  an ordinary request when it has no body, and refused with a 400 when it has one (the service upgrades
  to nothing);
- the request line and headers must arrive within `METAAGENT_CLIENT_HEADER_TIMEOUT_S` of the connection
  (or, on a kept-alive connection, of the request's first byte, or of the answer before it if it began
  while that was being answered: its bytes still count against the 16 KiB); past it, a 408 if a byte
  came, else the connection is closed without a word;
- chunk sizes, extensions and trailers are bounded like a head (a 400 past 16 KiB at once), and trailers
  are dropped, never made headers; a request target must be a path (an absolute URL names its server in
  place of the Host header the host check reads); at most `MAX_PIPELINED` requests are read ahead (a
  429 after their answers, and the connection closes); a client that half-closes (`shutdown(SHUT_WR)`)
  has hung up, as nginx takes it: a half-close cannot be told from a hang-up, and a hang-up stops what its
  request runs;
- while a request body is being sent, each chunk must come within `METAAGENT_CLIENT_BODY_TIMEOUT_S` of
  the one before, or of the route asking for more (the clock does not run while the service itself
  holds reading back, or before it asked a client that waits for `100 Continue`); past it, the
  connection is closed, and the route sees a disconnect (`metaagent.disconnects` logs one line);
- once the transport's buffer for a client is full, the client must take some of it within the same
  `METAAGENT_CLIENT_BODY_TIMEOUT_S`, or the connection is aborted; a connection the service closes has
  `_CLOSE_GRACE_S` to take what was written, then it is aborted too, and it counts against the cap until
  its descriptor is closed, so no client that stops reading holds a descriptor;
- at most `METAAGENT_MAX_CONNECTIONS` connections are open at once (by default half the process's
  open-file limit, so that the engine, the egress proxy, sessions and the audit log always have
  descriptors). At the cap, a new connection first takes the place of the oldest one that has no request
  in flight (idle, or still sending its request line and headers, or done with its answer): a connection
  the service is not working for costs its holder, not other callers. Only when every open connection
  has a request in flight is the new one refused: a 503 JSON answer, then the connection is closed.

The event loop is uvloop's (`loop="uvloop"`, named rather than left to uvicorn's "auto", so a missing
package is an error at start, not a slower service): it takes 4-8% off the service's CPU per session
call (README, "Python": an interleaved A/B).

uvicorn's `limit_concurrency` is not used: it accepts the connection anyway (its descriptor is spent) and
answers only once a request line arrives, in plain text. The protocol is httptools' rather than h11's: h11
was 13% of the service's busy time in a session call, and the same calls cost 10-12% less of the service's
CPU on httptools (README, "Python": an interleaved A/B).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from metaagent.disconnects import CLOSED_REASON_SCOPE_KEY
from metaagent.errors import ConfigError

if TYPE_CHECKING:
    from fastapi import FastAPI
    from uvicorn._types import ASGI3Application
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from metaagent.settings import Settings

log = logging.getLogger("metaagent.connections")

# The largest request line and headers together: past it, a 431.
MAX_HEAD_BYTES = 16 * 1024
# At most this many requests pipelined behind the one being answered are read; then the connection is
# closed after their answers and a 429.
MAX_PIPELINED = 16
# An explicit METAAGENT_MAX_CONNECTIONS may use at most this share of the open-file limit.
MAX_SHARE_OF_NOFILE = 0.75
# A refused connection is read (and discarded) for this long after its 503 before it is closed, so that
# the answer is not lost to a reset; at most `_LINGERING_MAX` refused connections linger at once.
_REFUSAL_LINGER_S = 1.0
# The parser is fed this much at a time (see `data_received`).
_PARSE_SLICE = 4 * 1024
# A connection the service closes has this long to take what was written to it (a 408, the end of an
# answer) before it is aborted: a client that does not read would otherwise keep its descriptor open.
_CLOSE_GRACE_S = 1.0
_LINGERING_MAX = 64
# Warnings about the cap are written at most this often, with a count of what happened in between.
_PRESSURE_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_timeout_s: float
    max_connections: int
    nofile: int

    def describe(self) -> str:
        return (
            f"at most {self.max_connections} connections open (open-file limit {self.nofile}), "
            f"request line and headers within {self.header_timeout_s:g} s, each body chunk within "
            f"{self.body_timeout_s:g} s, idle keep-alive {self.keep_alive_timeout_s:g} s"
        )


def open_file_limit() -> int:
    """The process's soft RLIMIT_NOFILE (a large stand-in when it is unlimited)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def connection_limits(settings: Settings, nofile: int | None = None) -> ConnectionLimits:
    """The limits from the settings, the cap derived from the open-file limit unless set; a ConfigError
    if the cap set leaves the rest of the service too few descriptors."""
    nofile = open_file_limit() if nofile is None else nofile
    ceiling = math.floor(nofile * MAX_SHARE_OF_NOFILE)
    cap = settings.max_connections
    if cap is None:
        cap = max(1, nofile // 2)
    elif cap > ceiling:
        raise ConfigError(
            f"METAAGENT_MAX_CONNECTIONS={cap} is too close to the open-file limit of {nofile} (at most "
            f"{ceiling}, three quarters of it, so that the engine, sessions and the audit log keep "
            "descriptors): lower it, or raise the limit (ulimit -n, LimitNOFILE= under systemd)"
        )
    return ConnectionLimits(
        header_timeout_s=settings.client_header_timeout_s,
        body_timeout_s=settings.client_body_timeout_s,
        keep_alive_timeout_s=settings.keep_alive_timeout_s,
        max_connections=cap,
        nofile=nofile,
    )


def uvicorn_config(app: FastAPI, limits: ConnectionLimits, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        timeout_graceful_shutdown=15,
        http=guarded_protocol(limits),
        loop="uvloop",
        ws="none",  # the service has no WebSocket route
        # The peer is the client: uvicorn's default believed X-Forwarded-For and X-Forwarded-Proto from
        # 127.0.0.1, so any local process could write the client address of its choice into the log.
        proxy_headers=False,
        # uvicorn's own idle timer (whole seconds); the protocol closes idle connections on the exact deadline.
        timeout_keep_alive=math.ceil(limits.keep_alive_timeout_s),
    )


@dataclass
class _Pressure:
    """A warning at most every `_PRESSURE_LOG_INTERVAL_S`, with the count of the events it stands for."""

    message: str
    count: int = 0
    last_logged: float = -math.inf

    def note(self, now: float, limits: ConnectionLimits) -> None:
        self.count += 1
        if now - self.last_logged >= _PRESSURE_LOG_INTERVAL_S:
            log.warning(self.message, limits.max_connections, self.count)
            self.count = 0
            self.last_logged = now


@dataclass
class ConnectionGuard:
    """The state the connections of one server share: how many are open, and which have no request in
    flight, oldest first (a dict keeps insertion order)."""

    limits: ConnectionLimits
    open: int = 0
    lingering: int = 0
    waiting: dict[GuardedHttpProtocol, None] = field(default_factory=dict)
    evictions: _Pressure = field(
        default_factory=lambda: _Pressure(
            "at the connection cap (%d, METAAGENT_MAX_CONNECTIONS): closed %d connection(s) with no request in "
            "flight to make room for new ones"
        )
    )
    refusals: _Pressure = field(
        default_factory=lambda: _Pressure(
            "at the connection cap (%d, METAAGENT_MAX_CONNECTIONS) with a request in flight on every one: "
            "refused %d new connection(s) with 503"
        )
    )


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """A protocol class for one server, its connections sharing one guard."""

    class Protocol(GuardedHttpProtocol):
        guard = ConnectionGuard(limits)

    return Protocol


def _raw_json_response(status: int, reason: str, message: str, extra_headers: str = "") -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra_headers}\r\n"
    )
    return head.encode() + body


class _Flow(FlowControl):
    """uvicorn's flow control, telling the protocol each time the route asks for more of the body (uvicorn
    resumes reading then, and sends a `100 Continue` first if the client waits for one): the body clock
    starts again from there."""

    def __init__(self, transport: asyncio.Transport, on_resume: Callable[[], None]) -> None:
        super().__init__(transport)
        self._on_resume = on_resume

    def resume_reading(self) -> None:
        super().resume_reading()
        self._on_resume()


class _ClosingTransport(asyncio.Transport):
    """A connection's transport that tells its protocol when it is closed, by whichever code closes it."""

    def __init__(self, transport: asyncio.Transport, on_close: Callable[[], None]) -> None:
        super().__init__()
        self._transport = transport
        self._on_close = on_close

    def close(self) -> None:
        self._transport.close()
        self._on_close()

    def abort(self) -> None:
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self._transport.writelines(list_of_data)

    def write_eof(self) -> None:
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class _Refused(asyncio.Protocol):
    """A connection refused at the cap, after its 503: what it sends is discarded until it closes or the
    linger ends."""

    def __init__(self, guard: ConnectionGuard, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.guard = guard
        self.transport = transport
        guard.lingering += 1
        self.timer = loop.call_later(_REFUSAL_LINGER_S, transport.abort)  # what was not taken by then never will be

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()
        self.guard.lingering -= 1


class _HeadRefused(Exception):
    """Raised from the parser's callback for a request head the service will not serve: the parser stops
    there (httptools wraps it in an HttpParserCallbackError), and `data_received` answers it."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class _Phase(enum.Enum):
    HEAD = "waiting for a request line and headers, or receiving them"
    BODY = "receiving a request body"


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the cap described in the module docstring."""

    guard: ClassVar[ConnectionGuard]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._counted = False
        self._phase = _Phase.HEAD
        self._unparsable = False
        self._owed_refusal: _HeadRefused | None = None  # sent once the answers owed before it are
        self._running: RequestResponseCycle | None = None  # whose route runs (`cycle` may be pipelined after it)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = math.inf
        self._abort_timer: asyncio.TimerHandle | None = None
        self._head_started: float | None = None  # when the request line being waited for began (or the connection)
        self._head_bytes = 0  # bytes received while waiting for it (counted a slice at a time, see `_parse`)
        self._head_begun = False  # the parser has begun the request waited for (its head came in part)
        self._idle_since: float | None = None  # when the last answer was sent
        self._last_read = 0.0  # the last body progress: bytes received, or reading resumed
        self._body_bytes = 0  # body bytes the parser has handed over, all requests together
        self._framing_bytes = 0  # bytes received in a body since the last body bytes: chunk framing, trailers
        self._write_paused_since: float | None = None  # when the client last stopped taking answer bytes

    # --- the cap ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's signature
        guard = self.guard
        if guard.open >= guard.limits.max_connections and not self._evict_one():
            self._refuse(transport)
            return
        guard.open += 1
        self._counted = True
        super().connection_made(transport)
        # uvicorn closes connections in several places (an answer to `Connection: close`, its keep-alive
        # timer, its error paths): each close, wherever made, arms the abort.
        self.transport = _ClosingTransport(transport, self._closing)
        self.flow = _Flow(self.transport, self._reading_resumed)
        self._head_started = self.loop.time()
        self._update()

    def _evict_one(self) -> bool:
        guard = self.guard
        if not guard.waiting:
            return False
        victim = next(iter(guard.waiting))
        victim._uncount()  # its descriptor goes now: aborted, not closed after what it has not read
        victim._cancel_timer()
        victim.transport.abort()
        guard.evictions.note(self.loop.time(), guard.limits)
        return True

    def _refuse(self, transport: asyncio.Transport) -> None:
        guard = self.guard
        guard.refusals.note(self.loop.time(), guard.limits)
        transport.write(
            _raw_json_response(
                503,
                "Service Unavailable",
                f"Too many connections: this service holds at most {guard.limits.max_connections} at once "
                "(METAAGENT_MAX_CONNECTIONS) and each has a request in flight; retry shortly",
                "retry-after: 1\r\n",
            )
        )
        if guard.lingering >= _LINGERING_MAX or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        transport.set_protocol(_Refused(guard, transport, self.loop))

    def _uncount(self) -> None:
        """No longer counted against the cap: its descriptor is closed, or about to be."""
        if self._counted:
            self._counted = False
            self.guard.open -= 1
        self.guard.waiting.pop(self, None)

    def _closing(self) -> None:
        """The connection is being closed: what was written goes out if the client reads it within the
        grace, else the connection is aborted. It counts against the cap until its descriptor is closed."""
        self.guard.waiting.pop(self, None)
        self._cancel_timer()
        if self._abort_timer is None:
            self._abort_timer = self.loop.call_later(_CLOSE_GRACE_S, self.transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.flow is None:  # refused: the _Refused protocol took over before uvicorn saw it
            return
        self._uncount()
        # uvicorn tells only the newest request; the route running may be an older one, with others queued.
        for cycle in (self._running, *(queued for queued, _app in self.pipeline)):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)  # closes the transport, which arms the abort: disarmed below
        self._cancel_timer()
        if self._abort_timer is not None:
            self._abort_timer.cancel()

    # --- parsing ---------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._last_read = self.loop.time()
        # Fed a slice at a time, so that what a slice held (head, body, framing) is known to within a
        # slice: one read can hold the end of a head and a trailer that never ends, or many requests.
        view = memoryview(data)
        for start in range(0, len(view), _PARSE_SLICE):
            if self._unparsable or not self._parse(view[start : start + _PARSE_SLICE]):
                return  # the parser stopped at refused bytes; the connection closes after the answers owed
        self._update()

    def _parse(self, data: memoryview) -> bool:
        """Feeds `data` to the parser and checks the limits: False if the request was refused."""
        phase, body_bytes = self._phase, self._body_bytes
        if phase is _Phase.HEAD:
            if self._head_started is None:
                self._head_started = self._last_read  # a kept-alive connection's next request begins
            self._head_bytes += len(data)
        try:
            self._feed(data)
        except httptools.HttpParserError as error:
            self._answer_unparsable(error)
            return False
        if self._phase is _Phase.HEAD and self._head_bytes > MAX_HEAD_BYTES:
            self._answer_unparsable(_head_too_large())
            return False
        if phase is _Phase.BODY and self._phase is _Phase.BODY:
            # Chunk sizes, extensions and trailers are bounded like a head: the parser holds a trailer
            # until its line ends, and would take them without end. Counted since the last slice with
            # body bytes, that slice's own included.
            delivered = self._body_bytes - body_bytes
            self._framing_bytes = (0 if delivered else self._framing_bytes) + len(data) - delivered
            if self._framing_bytes > MAX_HEAD_BYTES:
                self._answer_unparsable(_framing_too_large())
                return False
        return True

    def _feed(self, data: memoryview) -> None:
        while data:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                # The service upgrades to nothing (no WebSocket, no h2c), and `on_headers_complete` refused an
                # upgrade with a body: the request was an ordinary one, and what follows it is the next request.
                (offset,) = upgrade.args
                data = data[offset:] if offset > 0 else data[:0]  # it always moves on; never loop on the same bytes

    def _answer_unparsable(self, error: Exception) -> None:
        refused = error if isinstance(error, _HeadRefused) else error.__context__
        if not isinstance(refused, _HeadRefused):
            refused = _HeadRefused(
                400,
                "Bad Request",
                f"Invalid HTTP request ({error}): send a well-formed HTTP/1.1 request",
            )
        log.info("refused a request from %s: %s", _peer(self.client), refused.message)
        self._unparsable = True
        if self._phase is _Phase.BODY and self.pipeline and self.pipeline[0][0] is self.cycle:
            # A queued request's body was bad: it never runs. (The newest cycle is the one before it.)
            self.pipeline.popleft()
            newest = self.pipeline[0][0] if self.pipeline else self._running
            if newest is not None:
                self.cycle = newest
            self._phase = _Phase.HEAD
        if self._phase is _Phase.HEAD and self._in_flight():
            # The bad bytes follow requests still being answered: their answers go out whole, then the
            # refusal, and the connection closes (an error answer now would land in the middle of them).
            self._owed_refusal = refused
            self.flow.pause_reading()
            return
        in_flight = self._in_flight()
        if in_flight:  # the request's own body was bad: its route sees a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if not (in_flight and self.cycle.response_started):
            self.transport.write(_raw_json_response(refused.status, refused.reason, refused.message))
        self.transport.close()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            # One read can hold thousands of small requests, and the parser reads them all at once: each
            # queued one is a scope and a cycle, tens of times its bytes in memory. (The connection closes
            # after the answers owed; this one is never sent, but logged.)
            raise _HeadRefused(
                429,
                "Too Many Requests",
                f"Too many pipelined requests: at most {MAX_PIPELINED} wait behind the one being answered; "
                "send the rest after their answers, or on more connections",
            )
        super().on_message_begin()
        self._phase = _Phase.HEAD
        self._head_begun = True
        if self._head_started is None:
            self._head_started = self.loop.time()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase is _Phase.HEAD:  # not a trailer: those are bounded (above) and dropped, never headers
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # A head that came whole in one read was not measured as it arrived: measured here, as sent.
        if len(self.url) + sum(len(name) + len(value) + 3 for name, value in self.headers) > MAX_HEAD_BYTES:
            raise _head_too_large()
        if self.parser.should_upgrade():
            _refuse_an_upgrade_with_a_body(self.parser.get_method(), self.headers)
        if not self.url.startswith(b"/") and self.url != b"*":
            # An absolute URL's authority, not the Host header, names the server it is for (RFC 9112,
            # 3.2.2): the Host check would not see it.
            raise _HeadRefused(
                400,
                "Bad Request",
                "The request target must be a path, such as /tools: this service is not a proxy",
            )
        super().on_headers_complete()
        self._phase = _Phase.BODY
        self._head_started = None
        self._head_bytes = 0
        self._head_begun = False
        self._framing_bytes = 0

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _Phase.HEAD  # what comes next is the next request's
        if not self._in_flight():  # answered before its body ended (a 413, say): idle from now
            self._idle_since = self.loop.time()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()
        if self._head_started is not None:  # the next request's head has begun: its clock starts now
            self._head_started = self._idle_since
            self._unset_keepalive_if_required()  # uvicorn's idle timer (armed above) would close it silently
        if self._owed_refusal is not None and not self._in_flight() and not self.transport.is_closing():
            refused, self._owed_refusal = self._owed_refusal, None
            self.transport.write(_raw_json_response(refused.status, refused.reason, refused.message))
            self.transport.close()
            return
        self._update()

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio's signature; uvicorn's is narrower
        """The client sent its end. A half-close (`shutdown(SHUT_WR)`, which a client that still reads
        makes) cannot be told from a hang-up until an answer is written, and a hang-up must stop what its
        request runs: so it is one, as nginx takes it. Closed through the wrapper, so that what the client
        does not take is aborted after the grace; the transport closing itself would keep the descriptor
        for as long as the client keeps its unread bytes."""
        self.transport.close()
        return True

    # --- the deadlines ---------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_paused_since = self.loop.time()
        self._update()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_paused_since = None

    def _reading_resumed(self) -> None:
        if self._phase is _Phase.BODY:
            self._last_read = self.loop.time()
            self._update()

    def _in_flight(self) -> bool:
        """A request whose answer is not complete: the service is working for this connection."""
        return any(cycle is not None and not cycle.response_complete for cycle in (self._running, self.cycle))

    def _update(self) -> None:
        """Keeps the guard's list of waiting connections and this connection's deadline up to date."""
        if self.transport.is_closing():
            return
        if self._in_flight():
            self.guard.waiting.pop(self, None)
        elif self not in self.guard.waiting:
            self.guard.waiting[self] = None
        due = self._deadline()
        if due is None:
            return
        if self._timer is None or due < self._timer_due:
            # A later deadline leaves the armed timer alone: when it fires, it re-arms for the new one.
            self._cancel_timer()
            self._timer_due = due
            self._timer = self.loop.call_at(due, self._check)

    def _deadline(self) -> float | None:
        limits = self.guard.limits
        if self._write_paused_since is not None:
            return self._write_paused_since + limits.body_timeout_s  # the client must take what it is sent
        if self._phase is _Phase.BODY:
            if self.flow.read_paused or (self.cycle is not None and self.cycle.waiting_for_100_continue):
                return None  # the service holds the body back, or has not asked for it yet: not the client's wait
            return self._last_read + limits.body_timeout_s
        if self._in_flight():
            return None  # the whole request is in (a pipelined one waits its turn): the route's own deadlines hold
        if self._head_started is not None:
            return self._head_started + limits.header_timeout_s
        if self._idle_since is not None:
            return self._idle_since + limits.keep_alive_timeout_s
        return None

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_due = math.inf

    def _check(self) -> None:
        self._timer = None
        self._timer_due = math.inf
        if self.transport.is_closing():
            return
        due = self._deadline()
        if due is None:
            return
        if self.loop.time() < due:
            self._update()
            return
        self._expire()

    def _expire(self) -> None:
        limits = self.guard.limits
        if self._write_paused_since is not None:
            reason = (
                f"the client took no answer bytes for {limits.body_timeout_s:g} s (METAAGENT_CLIENT_BODY_TIMEOUT_S); "
                "the service closed the connection"
            )
            log.info("closed the connection from %s: %s", _peer(self.client), reason)
            if self._running is not None:
                self._running.scope[CLOSED_REASON_SCOPE_KEY] = reason  # type: ignore[literal-required]  # our own key
            self.transport.abort()  # what it has not taken would never go out
            return
        if self._phase is _Phase.BODY:
            reason = (
                f"no request body bytes came for {limits.body_timeout_s:g} s (METAAGENT_CLIENT_BODY_TIMEOUT_S); "
                "the service closed the connection"
            )
            if self.scope is not None:
                self.scope[CLOSED_REASON_SCOPE_KEY] = reason  # type: ignore[literal-required]  # our own key
        elif self._head_started is not None and (self._head_bytes or self._head_begun):
            self.transport.write(
                _raw_json_response(
                    408,
                    "Request Timeout",
                    f"Request timeout: the request line and headers did not arrive within "
                    f"{limits.header_timeout_s:g} s (METAAGENT_CLIENT_HEADER_TIMEOUT_S)",
                )
            )
        self.transport.close()


def _head_too_large() -> _HeadRefused:
    return _HeadRefused(
        431,
        "Request Header Fields Too Large",
        f"Request line and headers too large: at most {MAX_HEAD_BYTES} bytes together; send shorter headers "
        "(a large value belongs in the body)",
    )


def _framing_too_large() -> _HeadRefused:
    return _HeadRefused(
        400,
        "Bad Request",
        f"Request body framing too large: at most {MAX_HEAD_BYTES} bytes of chunk sizes, chunk extensions and "
        "trailers at once; send the body in larger chunks, without extensions or large trailers",
    )


def _refuse_an_upgrade_with_a_body(method: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """An upgrade request (`Connection: upgrade` with `Upgrade:`, or CONNECT) is served as an ordinary
    request, as HTTP allows a server that upgrades to nothing, when it has no body. With a body, httptools
    has already taken the body for the other protocol's bytes, so the request is refused instead."""
    has_body = method == b"CONNECT" or any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0"))
        for name, value in headers
    )
    if has_body:
        raise _HeadRefused(
            400,
            "Bad Request",
            "Connection upgrades are not served (no WebSocket, no h2c, no CONNECT): send the request "
            "without `Connection: upgrade` and `Upgrade`",
        )


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"
