"""Python clients of the service's HTTP API: `Client` (blocking) and `AsyncClient`.

    from metaagent import Client

    with Client() as client:  # METAAGENT_URL and METAAGENT_API_KEY, or Client(url, api_key="...")
        client.http("https://api.example.com/x")["body"]
        client.call_tool("search", {"q": "mcp"})  # any tool by its name, as an agent asks for it

Every method returns the response's JSON body as it is documented in API.md (a dict). An error status
raises a `ServiceError` (`metaagent.errors.ServiceError`), with the status and the service's own message
(`.message`) and extra fields (`.extra`, e.g. `host`), as the subclass that names what it means:
`NotFound`, `SessionEnded` (`.reason`), `RateLimited` (`.retry_after`), `PayloadTooLarge`, `WorkspaceFull`,
`Refused` or `Unavailable`. Network failures raise `TransportError` (httpx2's, re-exported here).

`stream_code(...)` runs code like `code_interpreter(...)` and yields its output as it comes:

    for event in client.stream_code("for (let i = 1; i <= 3; i++) console.log(i)"):
        if isinstance(event, Output):
            print(event.text, end="")      # event.stream is "stdout" or "stderr"
        elif isinstance(event, Finished):
            print(event.result["exit_code"])  # the body code_interpreter() would have returned

(`async for` with `AsyncClient`). The last event is `Finished`; a failure after the start raises
ServiceError. Leaving the loop early hangs up, which kills the execution. `session.stream(code)` (and
`stream_session_execute(session_id, code)`) streams a session's call the same way; leaving it early
interrupts the call, and the session keeps its state.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload
from urllib.parse import quote

import httpx2
from httpx2 import TransportError as TransportError  # re-exported: what a network failure raises

from metaagent.errors import ServiceError

DEFAULT_URL = "http://127.0.0.1:3102"
# The longest tool call (a 300 s execution, or an HTTP request's 120 s) plus headroom.
DEFAULT_TIMEOUT_S = 330.0

SearchType = Literal["search", "news", "images"]
Result = TypeVar("Result")
EVENT_STREAM = "text/event-stream"


@dataclass(frozen=True)
class Output:
    """Text the program wrote, as it came (whole characters; nothing past the caps)."""

    stream: Literal["stdout", "stderr"]
    text: str


@dataclass(frozen=True)
class OutputDropped:
    """This client read too slowly, so the service stopped sending output; `Finished` still has all of it."""

    message: str


@dataclass(frozen=True)
class Finished:
    """The last event: `result` is the body the call answers without streaming (API.md)."""

    result: dict[str, Any]


StreamEvent = Output | OutputDropped | Finished


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    body: dict[str, Any] | None = None


def _fields(**values: Any) -> dict[str, Any]:
    """The request body: the fields the caller gave, so that the service's defaults apply to the rest."""
    return {k: v for k, v in values.items() if v is not None}


def tool_path(name: str) -> str:
    """The HTTP route of a tool: every tool of `GET /tools` is served at `POST /tools/{name}`."""
    return f"/tools/{quote(name, safe='')}"


class NotFound(ServiceError):
    """404: no such execution, session, file or tool (for this key)."""


class SessionEnded(ServiceError):
    """410: the session has ended; `reason` says why (`closed`, `idle`, `lifetime`, `oom`, `exited`, ...)."""

    @property
    def reason(self) -> str | None:
        reason = self.extra.get("reason")
        return reason if isinstance(reason, str) else None


class RateLimited(ServiceError):
    """429: at capacity or past a per-key limit; retry after `retry_after` seconds."""

    @property
    def retry_after(self) -> float | None:
        seconds = self.extra.get("retry_after_s")
        return float(seconds) if isinstance(seconds, int | float) else None


class PayloadTooLarge(ServiceError):
    """413: a body (code, a file) over its limit."""


class WorkspaceFull(ServiceError):
    """507: the session's workspace has no room for the file."""


class Refused(ServiceError):
    """400, 403 or 422: the request was refused as sent (a blocked host, a package off the list, bad input)."""


class Unavailable(ServiceError):
    """502, 503 or 504: the service or what it depends on (the container engine, an upstream) cannot serve now."""


_BY_STATUS: dict[int, type[ServiceError]] = {
    400: Refused,
    403: Refused,
    404: NotFound,
    410: SessionEnded,
    413: PayloadTooLarge,
    422: Refused,
    429: RateLimited,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
    507: WorkspaceFull,
}


def service_error(status_code: int, message: str, **extra: Any) -> ServiceError:
    """The exception of an error answer: the `ServiceError` subclass that names what the status means."""
    return _BY_STATUS.get(status_code, ServiceError)(status_code, message, **extra)


def _result(response: httpx2.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.is_success and isinstance(body, dict):
        return body
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        extra = {k: v for k, v in body.items() if k != "error"}
        raise service_error(response.status_code, body["error"], **extra)
    text = response.text.strip()[:500] or response.reason_phrase
    raise service_error(response.status_code, f"Unexpected answer from the service: {text}")


def _stream_event(sse: httpx2.ServerSentEvent) -> StreamEvent | None:
    """The typed form of one event (None for an event this client does not know); raises at `error`."""
    if sse.event not in ("stdout", "stderr", "dropped", "result", "error"):
        return None
    data = sse.json()
    if not isinstance(data, dict):
        raise ServiceError(502, f"Unexpected event from the service: {sse.data[:500]}")
    if sse.event == "error":
        status = data.pop("status", 500)
        message = data.pop("error", "the call failed")
        raise service_error(status if isinstance(status, int) else 500, str(message), **data)
    if sse.event == "result":
        return Finished(data)
    if sse.event == "dropped":
        return OutputDropped(str(data.get("message", "")))
    stream: Literal["stdout", "stderr"] = "stdout" if sse.event == "stdout" else "stderr"
    return Output(stream, str(data.get("text", "")))


def _not_a_stream(response: httpx2.Response) -> Finished:
    """A refusal raises ServiceError; a service that answered JSON after all gives its body as the result."""
    return Finished(_result(response))


def _is_event_stream(response: httpx2.Response) -> bool:
    return response.is_success and response.headers.get("content-type", "").startswith(EVENT_STREAM)


_UNFINISHED = "The event stream ended before its result: the connection was cut, or the service stopped"


def _session(session_id: str) -> str:
    return f"/sessions/{quote(session_id, safe='')}"


def _file(session_id: str, path: str) -> str:
    """A workspace file's route: its path percent-encoded, `/` kept as the separator."""
    return f"{_session(session_id)}/files/{quote(path, safe='/')}"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _service(base_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    """The service's URL and the request headers: what was given, else METAAGENT_URL and METAAGENT_API_KEY
    from the environment, else the local default with no key."""
    url = base_url or os.environ.get("METAAGENT_URL") or DEFAULT_URL
    key = api_key if api_key is not None else os.environ.get("METAAGENT_API_KEY")
    return url, _headers(key)


def _code_call(
    code: str,
    timeout_s: int | None,
    memory_mb: int | None,
    packages: list[str] | None,
    stdin: str | None,
    network: dict[str, Any] | None,
) -> _Call:
    fields = _fields(
        code=code, timeout_s=timeout_s, memory_mb=memory_mb, packages=packages, stdin=stdin, network=network
    )
    return _Call("POST", "/tools/code-interpreter", fields)


def _session_call(session_id: str, code: str, timeout_s: int | None) -> _Call:
    return _Call("POST", f"{_session(session_id)}/execute", _fields(code=code, timeout_s=timeout_s))


class _Endpoints(Generic[Result]):
    """Every endpoint of API.md, once; `_send` runs a call (blocking, or as an awaitable)."""

    def _send(self, call: _Call) -> Result:
        raise NotImplementedError

    def http(
        self,
        url: str,
        method: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        body: str | None = None,
        timeout_s: float | None = None,
    ) -> Result:
        """`POST /tools/http`: one request to an allow-listed host."""
        fields = _fields(url=url, method=method, headers=headers, body=body, timeout_s=timeout_s)
        return self._send(_Call("POST", "/tools/http", fields))

    def code_interpreter(
        self,
        code: str,
        *,
        timeout_s: int | None = None,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        stdin: str | None = None,
        network: dict[str, Any] | None = None,
    ) -> Result:
        """`POST /tools/code-interpreter`: run JavaScript in a fresh container."""
        return self._send(_code_call(code, timeout_s, memory_mb, packages, stdin, network))

    def search(
        self,
        q: str,
        *,
        num: int | None = None,
        gl: str | None = None,
        hl: str | None = None,
        type: SearchType | None = None,
    ) -> Result:
        """`POST /tools/search`: web search through Serper."""
        return self._send(_Call("POST", "/tools/search", _fields(q=q, num=num, gl=gl, hl=hl, type=type)))

    def embeddings(self, input: str | list[str], *, model: str | None = None, dimensions: int | None = None) -> Result:
        """`POST /tools/embeddings`: embedding vectors, in input order."""
        fields = _fields(input=input, model=model, dimensions=dimensions)
        return self._send(_Call("POST", "/tools/embeddings", fields))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Result:
        """Any tool of `GET /tools` by its name (`code_interpreter`, `session_create`, ...), as a model calls it."""
        return self._send(_Call("POST", tool_path(name), arguments))

    def tools(self) -> Result:
        """`GET /tools`: `{"tools": [...]}`, each in the OpenAI function-calling shape."""
        return self._send(_Call("GET", "/tools"))

    def health(self) -> Result:
        """`GET /health`: `{"status": "ok" | "degraded", "checks": {...}}` (ServiceError 503 while it is starting)."""
        return self._send(_Call("GET", "/health"))

    def executions(self) -> Result:
        """`GET /executions`: `{"executions": [...]}`, every execution still running."""
        return self._send(_Call("GET", "/executions"))

    def execution(self, execution_id: str) -> Result:
        """`GET /executions/{id}`: one running execution (ServiceError 404 when it is not running)."""
        return self._send(_Call("GET", f"/executions/{quote(execution_id, safe='')}"))

    def kill_execution(self, execution_id: str) -> Result:
        """`DELETE /executions/{id}`: kill it now; `{"execution_id": ..., "killed": true}`."""
        return self._send(_Call("DELETE", f"/executions/{quote(execution_id, safe='')}"))

    def create_session(
        self,
        *,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        network: dict[str, Any] | None = None,
        idle_timeout_s: int | None = None,
    ) -> Result:
        """`POST /sessions`: open a session; its record (`session_id`, `expires_at`...)."""
        fields = _fields(memory_mb=memory_mb, packages=packages, network=network, idle_timeout_s=idle_timeout_s)
        return self._send(_Call("POST", "/sessions", fields))

    def sessions(self) -> Result:
        """`GET /sessions`: `{"sessions": [...]}`, the caller's open sessions."""
        return self._send(_Call("GET", "/sessions"))

    def session_record(self, session_id: str) -> Result:
        """`GET /sessions/{id}`: the session's record (ServiceError 410, with the reason, once it has ended)."""
        return self._send(_Call("GET", _session(session_id)))

    def session_execute(self, session_id: str, code: str, *, timeout_s: int | None = None) -> Result:
        """`POST /sessions/{id}/execute`: run code in the session; its state persists."""
        return self._send(_session_call(session_id, code, timeout_s))

    def close_session(self, session_id: str) -> Result:
        """`DELETE /sessions/{id}`: `{"session_id": ..., "closed": true}`; the container is gone. (When the
        engine cannot confirm that in time: `{"closed": false, "ending": true}`, and the service finishes it.)"""
        return self._send(_Call("DELETE", _session(session_id)))

    def session_files(self, session_id: str) -> Result:
        """`GET /sessions/{id}/files`: `{"files": [{"path", "size", "modified_at"}]}`."""
        return self._send(_Call("GET", f"{_session(session_id)}/files"))

    def delete_session_file(self, session_id: str, path: str) -> Result:
        """`DELETE /sessions/{id}/files/{path}`."""
        return self._send(_Call("DELETE", _file(session_id, path)))


class Client(_Endpoints[dict[str, Any]]):
    """The blocking client. Use it as a context manager, or call `close()`."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx2.BaseTransport | None = None,
    ) -> None:
        base_url, headers = _service(base_url, api_key)
        self._http = httpx2.Client(base_url=base_url, headers=headers, timeout=timeout_s, transport=transport)

    def _send(self, call: _Call) -> dict[str, Any]:
        return _result(self._http.request(call.method, call.path, json=call.body))

    def stream_code(
        self,
        code: str,
        *,
        timeout_s: int | None = None,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        stdin: str | None = None,
        network: dict[str, Any] | None = None,
    ) -> Iterator[StreamEvent]:
        """`POST /tools/code-interpreter` with `Accept: text/event-stream`: the output as it comes, then `Finished`."""
        return self._stream(_code_call(code, timeout_s, memory_mb, packages, stdin, network))

    def stream_session_execute(
        self, session_id: str, code: str, *, timeout_s: int | None = None
    ) -> Iterator[StreamEvent]:
        """`POST /sessions/{id}/execute` streamed: the output as it comes, then `Finished` (leaving early interrupts
        the call; the session lives on)."""
        return self._stream(_session_call(session_id, code, timeout_s))

    def _stream(self, call: _Call) -> Iterator[StreamEvent]:
        with self._http.stream(call.method, call.path, json=call.body, headers={"Accept": EVENT_STREAM}) as response:
            if not _is_event_stream(response):
                response.read()
                yield _not_a_stream(response)
                return
            for sse in httpx2.EventSource(response):
                event = _stream_event(sse)
                if event is not None:
                    yield event
                    if isinstance(event, Finished):
                        return
        raise ServiceError(502, _UNFINISHED)

    def upload(self, session_id: str, path: str, data: bytes) -> dict[str, Any]:
        """`PUT /sessions/{id}/files/{path}`: `{"path", "size", "sha256"}`."""
        return _result(self._http.put(_file(session_id, path), content=data))

    def download(self, session_id: str, path: str) -> bytes:
        """`GET /sessions/{id}/files/{path}`: the file's bytes (ServiceError 404 when there is none)."""
        response = self._http.get(_file(session_id, path))
        if not response.is_success:
            _result(response)
        return response.content

    @contextmanager
    def session(self, **config: Any) -> Iterator[Session]:
        """A session for the block (`memory_mb`, `packages`, `network`, `idle_timeout_s`), closed after it."""
        record = self.create_session(**config)
        session = Session(self, record["session_id"])
        try:
            yield session
        finally:
            with suppress(ServiceError):  # ended already (410): nothing left to close
                self.close_session(session.id)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class AsyncClient(_Endpoints[Awaitable[dict[str, Any]]]):
    """The asyncio/trio client. Use it as an async context manager, or await `aclose()`."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        base_url, headers = _service(base_url, api_key)
        self._http = httpx2.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, transport=transport)

    async def _request(self, call: _Call) -> dict[str, Any]:
        return _result(await self._http.request(call.method, call.path, json=call.body))

    def _send(self, call: _Call) -> Awaitable[dict[str, Any]]:
        return self._request(call)

    def stream_code(
        self,
        code: str,
        *,
        timeout_s: int | None = None,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        stdin: str | None = None,
        network: dict[str, Any] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """`POST /tools/code-interpreter` with `Accept: text/event-stream`: the output as it comes, then `Finished`."""
        return self._stream(_code_call(code, timeout_s, memory_mb, packages, stdin, network))

    def stream_session_execute(
        self, session_id: str, code: str, *, timeout_s: int | None = None
    ) -> AsyncIterator[StreamEvent]:
        """`POST /sessions/{id}/execute` streamed (as `Client.stream_session_execute`)."""
        return self._stream(_session_call(session_id, code, timeout_s))

    async def _stream(self, call: _Call) -> AsyncIterator[StreamEvent]:
        headers = {"Accept": EVENT_STREAM}
        async with self._http.stream(call.method, call.path, json=call.body, headers=headers) as response:
            if not _is_event_stream(response):
                await response.aread()
                yield _not_a_stream(response)
                return
            async for sse in httpx2.EventSource(response):
                event = _stream_event(sse)
                if event is not None:
                    yield event
                    if isinstance(event, Finished):
                        return
        raise ServiceError(502, _UNFINISHED)

    async def upload(self, session_id: str, path: str, data: bytes) -> dict[str, Any]:
        """`PUT /sessions/{id}/files/{path}`: `{"path", "size", "sha256"}`."""
        return _result(await self._http.put(_file(session_id, path), content=data))

    async def download(self, session_id: str, path: str) -> bytes:
        """`GET /sessions/{id}/files/{path}`: the file's bytes (ServiceError 404 when there is none)."""
        response = await self._http.get(_file(session_id, path))
        if not response.is_success:
            _result(response)
        return response.content

    @asynccontextmanager
    async def session(self, **config: Any) -> AsyncIterator[AsyncSession]:
        """A session for the block, closed after it (as `Client.session`)."""
        record = await self.create_session(**config)
        session = AsyncSession(self, record["session_id"])
        try:
            yield session
        finally:
            with suppress(ServiceError):
                await self.close_session(session.id)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()


class Session:
    """One session of a `Client` (see `Client.session`): calls share its state and its /workspace."""

    def __init__(self, client: Client, session_id: str) -> None:
        self.client = client
        self.id = session_id

    def execute(self, code: str, *, timeout_s: int | None = None) -> dict[str, Any]:
        """Runs code in the session; the answer has `result` (the last expression, as the REPL shows it)."""
        return self.client.session_execute(self.id, code, timeout_s=timeout_s)

    def stream(self, code: str, *, timeout_s: int | None = None) -> Iterator[StreamEvent]:
        """`execute` with the output as it comes, then `Finished` (see `Client.stream_code`)."""
        return self.client.stream_session_execute(self.id, code, timeout_s=timeout_s)

    def upload(self, path: str, data: bytes) -> dict[str, Any]:
        return self.client.upload(self.id, path, data)

    @overload
    def download(self, path: str, *, text: Literal[False] = False) -> bytes: ...
    @overload
    def download(self, path: str, *, text: Literal[True]) -> str: ...
    def download(self, path: str, *, text: bool = False) -> bytes | str:
        """The file's bytes, or with `text=True` its UTF-8 text (UnicodeDecodeError when it is not)."""
        data = self.client.download(self.id, path)
        return data.decode() if text else data

    def files(self) -> list[dict[str, Any]]:
        files: list[dict[str, Any]] = self.client.session_files(self.id)["files"]
        return files

    def delete(self, path: str) -> dict[str, Any]:
        return self.client.delete_session_file(self.id, path)

    def record(self) -> dict[str, Any]:
        """The session's record (`state`, `executions`, `expires_at`, ...); SessionEnded once it has ended."""
        return self.client.session_record(self.id)

    def close(self) -> dict[str, Any]:
        """Closes the session now (the block of `Client.session` also does when it ends)."""
        return self.client.close_session(self.id)


class AsyncSession:
    """One session of an `AsyncClient` (see `AsyncClient.session`)."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self.client = client
        self.id = session_id

    async def execute(self, code: str, *, timeout_s: int | None = None) -> dict[str, Any]:
        return await self.client.session_execute(self.id, code, timeout_s=timeout_s)

    def stream(self, code: str, *, timeout_s: int | None = None) -> AsyncIterator[StreamEvent]:
        return self.client.stream_session_execute(self.id, code, timeout_s=timeout_s)

    async def upload(self, path: str, data: bytes) -> dict[str, Any]:
        return await self.client.upload(self.id, path, data)

    @overload
    async def download(self, path: str, *, text: Literal[False] = False) -> bytes: ...
    @overload
    async def download(self, path: str, *, text: Literal[True]) -> str: ...
    async def download(self, path: str, *, text: bool = False) -> bytes | str:
        data = await self.client.download(self.id, path)
        return data.decode() if text else data

    async def files(self) -> list[dict[str, Any]]:
        files: list[dict[str, Any]] = (await self.client.session_files(self.id))["files"]
        return files

    async def delete(self, path: str) -> dict[str, Any]:
        return await self.client.delete_session_file(self.id, path)

    async def record(self) -> dict[str, Any]:
        return await self.client.session_record(self.id)

    async def close(self) -> dict[str, Any]:
        return await self.client.close_session(self.id)
