"""Python clients of the service's HTTP API: `Client` (blocking) and `AsyncClient`.

    from metaagent import Client

    with Client() as client:  # METAAGENT_URL and METAAGENT_API_KEY, or Client(url, api_key="...")
        client.http("https://api.example.com/x").body
        client.call_tool("search", {"q": "mcp"})  # any tool by its name, as an agent asks for it: a dict
        client.code_interpreter("print(6 * 7)", language="python").stdout  # JavaScript without `language`

Every method returns the response's body as the service's own model (`HttpResponse`,
`CodeInterpreterResponse`, `SessionExecuteResponse`, `SessionRecord`, `FileWritten`, `FileList`, ...,
validated from the JSON that API.md documents; fields the client does not know are ignored). Three
answer the JSON as it came (a dict): `call_tool`, whose answer goes back to a model as JSON in a
function-calling loop, `tools` and `health`. An error status
raises a `ServiceError` (`metaagent.errors.ServiceError`), with the status and the service's own message
(`.message`) and extra fields (`.extra`, e.g. `host`), as the subclass that names what it means:
`NotFound`, `SessionEnded` (`.reason`), `RateLimited` (`.retry_after`), `PayloadTooLarge`, `WorkspaceFull`,
`Refused` or `Unavailable`. Network failures raise `TransportError` (httpx2's, re-exported here).

`stream_code(...)` runs code like `code_interpreter(...)` and yields its output as it comes:

    for event in client.stream_code("for (let i = 1; i <= 3; i++) console.log(i)"):
        if isinstance(event, Output):
            print(event.text, end="")      # event.stream is "stdout" or "stderr"
        elif isinstance(event, Finished):
            print(event.result.exit_code)  # the answer code_interpreter() would have returned

(`async for` with `AsyncClient`). The last event is `Finished`; a failure after the start raises
ServiceError. Leaving the loop early hangs up, which kills the execution. `session.stream(code)` (and
`stream_session_execute(session_id, code)`) streams a session's call the same way; leaving it early
interrupts the call, and the session keeps its state.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, overload
from urllib.parse import quote

import httpx2
from httpx2 import TransportError as TransportError  # re-exported: what a network failure raises
from pydantic import BaseModel, ValidationError

from metaagent.errors import ServiceError
from metaagent.executions import ExecutionInfo, ExecutionList, KillResult
from metaagent.languages import LanguageName
from metaagent.sessions.models import (
    CallError,
    FileDeleted,
    FileInfo,
    FileList,
    FileWritten,
    ImageOut,
    SessionClosed,
    SessionEnding,
    SessionExecuteResponse,
    SessionList,
    SessionRecord,
)
from metaagent.tools.code_interpreter import CodeInterpreterResponse
from metaagent.tools.embeddings import EmbeddingsResponse
from metaagent.tools.http import HttpResponse
from metaagent.tools.search import SearchResponse

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "CallError",
    "Client",
    "CodeInterpreterResponse",
    "EmbeddingsResponse",
    "ExecutionInfo",
    "ExecutionList",
    "FileDeleted",
    "FileInfo",
    "FileList",
    "FileWritten",
    "Finished",
    "HttpResponse",
    "ImageOut",
    "KillResult",
    "LanguageName",
    "NotFound",
    "Output",
    "OutputDropped",
    "PayloadTooLarge",
    "RateLimited",
    "Refused",
    "SearchResponse",
    "Session",
    "SessionClosed",
    "SessionEnded",
    "SessionEnding",
    "SessionExecuteResponse",
    "SessionList",
    "SessionRecord",
    "StreamEvent",
    "TransportError",
    "Unavailable",
    "WorkspaceFull",
]

DEFAULT_URL = "http://127.0.0.1:3102"
# The longest tool call (a 300 s execution, or an HTTP request's 120 s) plus headroom.
DEFAULT_TIMEOUT_S = 330.0

SearchType = Literal["search", "news", "images"]
Answer = TypeVar("Answer")
Args = ParamSpec("Args")
Model = TypeVar("Model", bound=BaseModel)
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


Ran = TypeVar("Ran", bound=CodeInterpreterResponse)


@dataclass(frozen=True)
class Finished(Generic[Ran]):
    """The last event: `result` is the answer the call gives without streaming (API.md), a
    `CodeInterpreterResponse` (or, from a session, a `SessionExecuteResponse`)."""

    result: Ran


StreamEvent = Output | OutputDropped | Finished[Ran]


def _json(body: dict[str, Any]) -> dict[str, Any]:
    return body


def _closed(body: dict[str, Any]) -> SessionClosed:
    """A close answers `SessionClosed`, or `SessionEnding` when the engine has not confirmed it yet (a 202)."""
    return SessionEnding.model_validate(body) if body.get("ending") else SessionClosed.model_validate(body)


@dataclass(frozen=True)
class _Call(Generic[Answer]):
    """One request and how its JSON answer becomes the method's result (a model's validator, or as it came)."""

    method: str
    path: str
    answer: Callable[[dict[str, Any]], Answer]
    body: dict[str, Any] | None = None

    def result(self, response: httpx2.Response) -> Answer:
        body = _result(response)
        try:
            return self.answer(body)
        except ValidationError as exc:
            raise ServiceError(502, f"Unexpected answer from the service: {exc}") from None


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


def _stream_event(call: _Call[Ran], sse: httpx2.ServerSentEvent) -> StreamEvent[Ran] | None:
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
        try:
            return Finished(call.answer(data))
        except ValidationError as exc:
            raise ServiceError(502, f"Unexpected result event from the service: {exc}") from None
    if sse.event == "dropped":
        return OutputDropped(str(data.get("message", "")))
    stream: Literal["stdout", "stderr"] = "stdout" if sse.event == "stdout" else "stderr"
    return Output(stream, str(data.get("text", "")))


def _not_a_stream(call: _Call[Ran], response: httpx2.Response) -> Finished[Ran]:
    """A refusal raises ServiceError; a service that answered JSON after all gives its body as the result."""
    return Finished(call.result(response))


def _uploaded(response: httpx2.Response) -> FileWritten:
    return _Call("PUT", "", _model(FileWritten)).result(response)


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
    language: LanguageName | None,
) -> _Call[CodeInterpreterResponse]:
    fields = _fields(
        code=code,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        packages=packages,
        stdin=stdin,
        network=network,
        language=language,
    )
    return _Call("POST", "/tools/code-interpreter", CodeInterpreterResponse.model_validate, fields)


def _session_call(session_id: str, code: str, timeout_s: int | None) -> _Call[SessionExecuteResponse]:
    fields = _fields(code=code, timeout_s=timeout_s)
    return _Call("POST", f"{_session(session_id)}/execute", SessionExecuteResponse.model_validate, fields)


def _model(model: type[Model]) -> Callable[[dict[str, Any]], Model]:
    return model.model_validate


class _Endpoint(Generic[Args, Answer]):
    """An endpoint written once for both clients: `build` makes its `_Call`; from a `Client` the method
    returns the answer, from an `AsyncClient` an awaitable of it (each client's `_send` runs the call)."""

    def __init__(self, build: Callable[Concatenate[Any, Args], _Call[Answer]]) -> None:
        self._build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any] | None = None) -> _Endpoint[Args, Answer]: ...
    @overload
    def __get__(self, client: Client, owner: type[Any] | None = None) -> Callable[Args, Answer]: ...
    @overload
    def __get__(self, client: AsyncClient, owner: type[Any] | None = None) -> Callable[Args, Awaitable[Answer]]: ...
    def __get__(self, client: Any, owner: type[Any] | None = None) -> Any:
        if client is None:
            return self
        build = self._build

        @functools.wraps(build)
        def send(*args: Args.args, **kwargs: Args.kwargs) -> Any:
            return client._send(build(client, *args, **kwargs))

        return send


_endpoint = _Endpoint


class _Endpoints:
    """Every endpoint of API.md, once (see `_Endpoint`)."""

    @_endpoint
    def http(
        self,
        url: str,
        method: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        body: str | None = None,
        timeout_s: float | None = None,
    ) -> _Call[HttpResponse]:
        """`POST /tools/http`: one request to an allow-listed host."""
        fields = _fields(url=url, method=method, headers=headers, body=body, timeout_s=timeout_s)
        return _Call("POST", "/tools/http", _model(HttpResponse), fields)

    @_endpoint
    def code_interpreter(
        self,
        code: str,
        *,
        timeout_s: int | None = None,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        stdin: str | None = None,
        network: dict[str, Any] | None = None,
        language: LanguageName | None = None,
    ) -> _Call[CodeInterpreterResponse]:
        """`POST /tools/code-interpreter`: run code in a fresh container (JavaScript, or `language="python"`)."""
        return _code_call(code, timeout_s, memory_mb, packages, stdin, network, language)

    @_endpoint
    def search(
        self,
        q: str,
        *,
        num: int | None = None,
        gl: str | None = None,
        hl: str | None = None,
        type: SearchType | None = None,
    ) -> _Call[SearchResponse]:
        """`POST /tools/search`: web search through Serper."""
        fields = _fields(q=q, num=num, gl=gl, hl=hl, type=type)
        return _Call("POST", "/tools/search", _model(SearchResponse), fields)

    @_endpoint
    def embeddings(
        self, input: str | list[str], *, model: str | None = None, dimensions: int | None = None
    ) -> _Call[EmbeddingsResponse]:
        """`POST /tools/embeddings`: embedding vectors, in input order."""
        fields = _fields(input=input, model=model, dimensions=dimensions)
        return _Call("POST", "/tools/embeddings", _model(EmbeddingsResponse), fields)

    @_endpoint
    def call_tool(self, name: str, arguments: dict[str, Any]) -> _Call[dict[str, Any]]:
        """Any tool of `GET /tools` by its name (`code_interpreter`, `session_create`, ...), as a model calls it;
        the answer is the JSON as it came (a dict), ready to go back to the model."""
        return _Call("POST", tool_path(name), _json, arguments)

    @_endpoint
    def tools(self) -> _Call[dict[str, Any]]:
        """`GET /tools`: `{"tools": [...]}`, each in the OpenAI function-calling shape."""
        return _Call("GET", "/tools", _json)

    @_endpoint
    def health(self) -> _Call[dict[str, Any]]:
        """`GET /health`: `{"status": "ok" | "degraded", "checks": {...}}` (ServiceError 503 while it is starting)."""
        return _Call("GET", "/health", _json)

    @_endpoint
    def executions(self) -> _Call[ExecutionList]:
        """`GET /executions`: `{"executions": [...]}`, every execution still running."""
        return _Call("GET", "/executions", _model(ExecutionList))

    @_endpoint
    def execution(self, execution_id: str) -> _Call[ExecutionInfo]:
        """`GET /executions/{id}`: one running execution (ServiceError 404 when it is not running)."""
        return _Call("GET", f"/executions/{quote(execution_id, safe='')}", _model(ExecutionInfo))

    @_endpoint
    def kill_execution(self, execution_id: str) -> _Call[KillResult]:
        """`DELETE /executions/{id}`: kill it now; `{"execution_id": ..., "killed": true}`."""
        return _Call("DELETE", f"/executions/{quote(execution_id, safe='')}", _model(KillResult))

    @_endpoint
    def create_session(
        self,
        *,
        language: LanguageName | None = None,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        network: dict[str, Any] | None = None,
        idle_timeout_s: int | None = None,
    ) -> _Call[SessionRecord]:
        """`POST /sessions`: open a session (JavaScript, or `language="python"`); its record (`session_id`,
        `language`, `expires_at`...)."""
        fields = _fields(
            language=language, memory_mb=memory_mb, packages=packages, network=network, idle_timeout_s=idle_timeout_s
        )
        return _Call("POST", "/sessions", _model(SessionRecord), fields)

    @_endpoint
    def sessions(self) -> _Call[SessionList]:
        """`GET /sessions`: `{"sessions": [...]}`, the caller's open sessions."""
        return _Call("GET", "/sessions", _model(SessionList))

    @_endpoint
    def session_record(self, session_id: str) -> _Call[SessionRecord]:
        """`GET /sessions/{id}`: the session's record (ServiceError 410, with the reason, once it has ended)."""
        return _Call("GET", _session(session_id), _model(SessionRecord))

    @_endpoint
    def session_execute(
        self, session_id: str, code: str, *, timeout_s: int | None = None
    ) -> _Call[SessionExecuteResponse]:
        """`POST /sessions/{id}/execute`: run code in the session; its state persists."""
        return _session_call(session_id, code, timeout_s)

    @_endpoint
    def close_session(self, session_id: str) -> _Call[SessionClosed]:
        """`DELETE /sessions/{id}`: `{"session_id": ..., "closed": true}`; the container is gone. (When the
        engine cannot confirm that in time: `{"closed": false, "ending": true}`, and the service finishes it.)"""
        return _Call("DELETE", _session(session_id), _closed)

    @_endpoint
    def session_files(self, session_id: str) -> _Call[FileList]:
        """`GET /sessions/{id}/files`: `{"files": [{"path", "size", "modified_at"}]}`."""
        return _Call("GET", f"{_session(session_id)}/files", _model(FileList))

    @_endpoint
    def delete_session_file(self, session_id: str, path: str) -> _Call[FileDeleted]:
        """`DELETE /sessions/{id}/files/{path}`."""
        return _Call("DELETE", _file(session_id, path), _model(FileDeleted))


class Client(_Endpoints):
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

    @property
    def base_url(self) -> str:
        """The service's URL this client talks to."""
        return str(self._http.base_url).rstrip("/")

    def _send(self, call: _Call[Answer]) -> Answer:
        return call.result(self._http.request(call.method, call.path, json=call.body))

    def stream_code(
        self,
        code: str,
        *,
        timeout_s: int | None = None,
        memory_mb: int | None = None,
        packages: list[str] | None = None,
        stdin: str | None = None,
        network: dict[str, Any] | None = None,
        language: LanguageName | None = None,
    ) -> Iterator[StreamEvent[CodeInterpreterResponse]]:
        """`POST /tools/code-interpreter` with `Accept: text/event-stream`: the output as it comes, then `Finished`."""
        return self._stream(_code_call(code, timeout_s, memory_mb, packages, stdin, network, language))

    def stream_session_execute(
        self, session_id: str, code: str, *, timeout_s: int | None = None
    ) -> Iterator[StreamEvent[SessionExecuteResponse]]:
        """`POST /sessions/{id}/execute` streamed: the output as it comes, then `Finished` (leaving early interrupts
        the call; the session lives on)."""
        return self._stream(_session_call(session_id, code, timeout_s))

    def _stream(self, call: _Call[Ran]) -> Iterator[StreamEvent[Ran]]:
        with self._http.stream(call.method, call.path, json=call.body, headers={"Accept": EVENT_STREAM}) as response:
            if not _is_event_stream(response):
                response.read()
                yield _not_a_stream(call, response)
                return
            for sse in httpx2.EventSource(response):
                event = _stream_event(call, sse)
                if event is not None:
                    yield event
                    if isinstance(event, Finished):
                        return
        raise ServiceError(502, _UNFINISHED)

    def upload(self, session_id: str, path: str, data: bytes) -> FileWritten:
        """`PUT /sessions/{id}/files/{path}`: the file's `path`, `size` and `sha256`."""
        return _uploaded(self._http.put(_file(session_id, path), content=data))

    def download(self, session_id: str, path: str) -> bytes:
        """`GET /sessions/{id}/files/{path}`: the file's bytes (ServiceError 404 when there is none)."""
        response = self._http.get(_file(session_id, path))
        if not response.is_success:
            _result(response)
        return response.content

    @contextmanager
    def session(self, **config: Any) -> Iterator[Session]:
        """A session for the block (`language`, `memory_mb`, `packages`, `network`, `idle_timeout_s`), closed after
        it."""
        record = self.create_session(**config)
        session = Session(self, record.session_id)
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


class AsyncClient(_Endpoints):
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

    @property
    def base_url(self) -> str:
        """The service's URL this client talks to."""
        return str(self._http.base_url).rstrip("/")

    async def _request(self, call: _Call[Answer]) -> Answer:
        return call.result(await self._http.request(call.method, call.path, json=call.body))

    def _send(self, call: _Call[Answer]) -> Awaitable[Answer]:
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
        language: LanguageName | None = None,
    ) -> AsyncIterator[StreamEvent[CodeInterpreterResponse]]:
        """`POST /tools/code-interpreter` with `Accept: text/event-stream`: the output as it comes, then `Finished`."""
        return self._stream(_code_call(code, timeout_s, memory_mb, packages, stdin, network, language))

    def stream_session_execute(
        self, session_id: str, code: str, *, timeout_s: int | None = None
    ) -> AsyncIterator[StreamEvent[SessionExecuteResponse]]:
        """`POST /sessions/{id}/execute` streamed (as `Client.stream_session_execute`)."""
        return self._stream(_session_call(session_id, code, timeout_s))

    async def _stream(self, call: _Call[Ran]) -> AsyncIterator[StreamEvent[Ran]]:
        headers = {"Accept": EVENT_STREAM}
        async with self._http.stream(call.method, call.path, json=call.body, headers=headers) as response:
            if not _is_event_stream(response):
                await response.aread()
                yield _not_a_stream(call, response)
                return
            async for sse in httpx2.EventSource(response):
                event = _stream_event(call, sse)
                if event is not None:
                    yield event
                    if isinstance(event, Finished):
                        return
        raise ServiceError(502, _UNFINISHED)

    async def upload(self, session_id: str, path: str, data: bytes) -> FileWritten:
        """`PUT /sessions/{id}/files/{path}`: the file's `path`, `size` and `sha256`."""
        return _uploaded(await self._http.put(_file(session_id, path), content=data))

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
        session = AsyncSession(self, record.session_id)
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

    def execute(self, code: str, *, timeout_s: int | None = None) -> SessionExecuteResponse:
        """Runs code in the session; the answer has `result` (the last expression, as the language's REPL
        shows it), `error` (a `CallError`) and `images` (a Python session's figures, each an `ImageOut`:
        `.decoded()` is its bytes)."""
        return self.client.session_execute(self.id, code, timeout_s=timeout_s)

    def stream(self, code: str, *, timeout_s: int | None = None) -> Iterator[StreamEvent[SessionExecuteResponse]]:
        """`execute` with the output as it comes, then `Finished` (see `Client.stream_code`)."""
        return self.client.stream_session_execute(self.id, code, timeout_s=timeout_s)

    def upload(self, path: str, data: bytes) -> FileWritten:
        return self.client.upload(self.id, path, data)

    @overload
    def download(self, path: str, *, text: Literal[False] = False) -> bytes: ...
    @overload
    def download(self, path: str, *, text: Literal[True]) -> str: ...
    def download(self, path: str, *, text: bool = False) -> bytes | str:
        """The file's bytes, or with `text=True` its UTF-8 text (UnicodeDecodeError when it is not)."""
        data = self.client.download(self.id, path)
        return data.decode() if text else data

    def files(self) -> list[FileInfo]:
        return self.client.session_files(self.id).files

    def delete(self, path: str) -> FileDeleted:
        return self.client.delete_session_file(self.id, path)

    def record(self) -> SessionRecord:
        """The session's record (`state`, `executions`, `expires_at`, ...); SessionEnded once it has ended."""
        return self.client.session_record(self.id)

    def close(self) -> SessionClosed:
        """Closes the session now (the block of `Client.session` also does when it ends)."""
        return self.client.close_session(self.id)


class AsyncSession:
    """One session of an `AsyncClient` (see `AsyncClient.session`)."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self.client = client
        self.id = session_id

    async def execute(self, code: str, *, timeout_s: int | None = None) -> SessionExecuteResponse:
        return await self.client.session_execute(self.id, code, timeout_s=timeout_s)

    def stream(self, code: str, *, timeout_s: int | None = None) -> AsyncIterator[StreamEvent[SessionExecuteResponse]]:
        return self.client.stream_session_execute(self.id, code, timeout_s=timeout_s)

    async def upload(self, path: str, data: bytes) -> FileWritten:
        return await self.client.upload(self.id, path, data)

    @overload
    async def download(self, path: str, *, text: Literal[False] = False) -> bytes: ...
    @overload
    async def download(self, path: str, *, text: Literal[True]) -> str: ...
    async def download(self, path: str, *, text: bool = False) -> bytes | str:
        data = await self.client.download(self.id, path)
        return data.decode() if text else data

    async def files(self) -> list[FileInfo]:
        return (await self.client.session_files(self.id)).files

    async def delete(self, path: str) -> FileDeleted:
        return await self.client.delete_session_file(self.id, path)

    async def record(self) -> SessionRecord:
        return await self.client.session_record(self.id)

    async def close(self) -> SessionClosed:
        return await self.client.close_session(self.id)
