"""The HTTP tool: one request to an allow-listed host, redirects re-checked hop by hop, body capped."""

from __future__ import annotations

import base64
import re
from typing import Literal

import anyio
import httpx2
from pydantic import BaseModel, Field

from metaagent.egress.guard import EgressGuard
from metaagent.egress.url import InvalidURL, join_location
from metaagent.errors import RequestRefused, UpstreamError, UpstreamTimeout
from metaagent.validation import ToolRequest

Method = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

# Set by the client from the URL and the body; a caller's value could only confuse the upstream about
# which site or how many bytes it is talking to.
_RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade"})
# Credentials that must not follow a redirect to another origin.
_CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
# RFC 9110: a field name is a token; a value is visible Latin-1 text with inner spaces and tabs.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_FIELD_VALUE = re.compile(r"^[\t\x20-\x7e\xa0-\xff]*$")
# Every error of the client library: transport, protocol, decoding, URL and stream errors. Whatever the
# upstream sends that the library cannot take is a 502 that names it, never a 500.
CLIENT_ERRORS = (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError, httpx2.CookieConflict)


def request_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The caller's headers as bytes for the wire; RequestRefused (400) for one HTTP cannot carry or
    that the tool sets itself. Values lose the spaces around them, as HTTP reads them."""
    raw: list[tuple[bytes, bytes]] = []
    for name, value in headers.items():
        if not _TOKEN.match(name):
            raise RequestRefused(
                f"The header name {name[:100]!r} is not valid in HTTP: a name is ASCII letters, digits and "
                "!#$%&'*+-.^_`|~ only (RFC 9110)",
                header=name[:100],
            )
        if name.lower() in _RESERVED_HEADERS:
            raise RequestRefused(f"The {name} header is set by the HTTP tool; remove it from headers", header=name)
        value = value.strip(" \t")
        if not _FIELD_VALUE.match(value):
            raise RequestRefused(
                f"The value of the {name} header cannot be sent in HTTP: a value is Latin-1 text without "
                "control characters (no line breaks); percent-encode or base64-encode other text",
                header=name,
            )
        raw.append((name.encode("ascii"), value.encode("latin-1")))
    return raw


class HttpRequest(ToolRequest):
    """Make one HTTP request to an allow-listed host and return the status, headers and body."""

    url: str = Field(min_length=1, max_length=8192, description="Absolute http or https URL.")
    method: Method = Field(default="GET", description="HTTP method.")
    headers: dict[str, str] = Field(default_factory=dict, description="Request headers.")
    body: str | None = Field(default=None, description="Request body, sent as UTF-8.")
    timeout_s: float = Field(default=30, gt=0, le=120, description="Deadline for the whole exchange, in seconds.")


class HttpResponse(BaseModel):
    status: int
    headers: dict[str, str]
    body: str
    encoding: Literal["utf-8", "base64"]
    truncated: bool
    url: str


class HttpTool:
    def __init__(self, guard: EgressGuard, *, max_response_bytes: int, max_redirects: int) -> None:
        self._guard = guard
        self._max_bytes = max_response_bytes
        self._max_redirects = max_redirects
        self._client = httpx2.AsyncClient(transport=guard.transport(tool="http"), follow_redirects=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        headers = request_headers(request.headers)
        try:
            with anyio.fail_after(request.timeout_s):
                return await self._exchange(request, headers)
        except httpx2.PoolTimeout as exc:
            raise UpstreamTimeout(f"The upstream is too busy: {exc}") from None
        except (TimeoutError, httpx2.TimeoutException):
            raise UpstreamTimeout(f"The upstream did not answer within {request.timeout_s:g} s") from None
        except httpx2.NetworkError as exc:  # connect, read or write failed: DNS, refused, TLS, reset
            raise UpstreamError(f"Could not reach the upstream: {describe_client_error(exc)}") from None
        except CLIENT_ERRORS as exc:
            raise UpstreamError(f"The upstream's answer could not be read: {describe_client_error(exc)}") from None

    async def _exchange(self, request: HttpRequest, headers: list[tuple[bytes, bytes]]) -> HttpResponse:
        method: str = request.method
        url = request.url
        content = request.body.encode() if request.body is not None else None
        origin = None
        for hop in range(self._max_redirects + 1):
            try:
                target = self._guard.check_url(url, method, tool="http")
            except InvalidURL as exc:
                if not hop:
                    raise  # the caller's own URL: a 400 that says what is wrong with it
                raise UpstreamError(f"The upstream redirected to a URL that cannot be read: {exc.message}") from None
            if origin is not None and (target.scheme, target.host, target.port) != origin:
                headers = [(k, v) for k, v in headers if k.lower().decode() not in _CREDENTIAL_HEADERS]
            origin = (target.scheme, target.host, target.port)
            outgoing = self._client.build_request(
                method, target.url, headers=headers, content=content, timeout=request.timeout_s
            )
            response = await self._client.send(outgoing, stream=True)
            try:
                location = response.headers.get("location")
                if response.is_redirect and location:
                    try:
                        url = join_location(target.url, location)
                    except InvalidURL as exc:
                        raise UpstreamError(
                            f"The upstream redirected to a URL that cannot be read: {exc.message}"
                        ) from None
                    if response.status_code == 303 or (response.status_code in (301, 302) and method == "POST"):
                        method, content = ("HEAD" if method == "HEAD" else "GET"), None
                        headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
                    continue
                body, truncated = await read_capped(response, self._max_bytes)
            finally:
                await response.aclose()
            return _response(response, target.url, body, truncated)
        raise UpstreamError(f"Too many redirects (more than {self._max_redirects}); last location: {url}")


async def read_capped(response: httpx2.Response, cap: int) -> tuple[bytes, bool]:
    """At most `cap` bytes of the body, and whether there were more; stops reading past the cap."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], True
    return b"".join(chunks), False


def _response(response: httpx2.Response, url: str, body: bytes, truncated: bool) -> HttpResponse:
    headers: dict[str, str] = {}
    for name, value in response.headers.multi_items():
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    text, encoding = _decode(body, truncated)
    return HttpResponse(
        status=response.status_code,
        headers=headers,
        body=text,
        encoding=encoding,
        truncated=truncated,
        url=url,
    )


def _decode(body: bytes, truncated: bool) -> tuple[str, Literal["utf-8", "base64"]]:
    try:
        return body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as exc:
        # A cap can split a character: text that is valid up to its last few bytes is still text.
        if truncated and exc.start >= len(body) - 3:
            return body[: exc.start].decode("utf-8"), "utf-8"
        return base64.b64encode(body).decode("ascii"), "base64"


def describe_client_error(exc: Exception) -> str:
    """The client library's error, named: its kind and its message."""
    detail = str(exc).strip()
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
