"""What the search and embeddings tools share: one JSON API behind the egress guard, with bounded retries.

The API's key travels in a request header and nowhere else: it is never logged, and every message built
from an upstream answer is scrubbed of the service's keys (`metaagent.redaction`) before it can reach an
error, a log line or an audit record; the tools scrub their answers the same way.

An upstream is not trusted to be well-behaved either. Its answer is bounded before it is parsed: its
decoded size is counted while it streams in (each call says how much its answer may need), the JSON
values it can hold are counted before the parser runs (so no small answer can make the parser build
millions of objects, or hold the event loop for long; answers over 1 MiB are parsed in a worker thread),
numbers must be finite, and nesting is bounded.
Whatever the client library cannot take (a broken gzip body, too many content codings, a protocol
error) is a 502 that names it.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import anyio
import httpx2
from pydantic import SecretStr

from metaagent.egress.guard import EgressGuard
from metaagent.errors import HostBlocked, Unavailable, UpstreamError, UpstreamTimeout
from metaagent.redaction import Redactor
from metaagent.settings import Settings
from metaagent.text import well_formed
from metaagent.tools.http import CLIENT_ERRORS, describe_client_error, read_capped

log = logging.getLogger("metaagent.upstream")

_MAX_MESSAGE_CHARS = 500
_MAX_ERROR_VALUES = 10_000  # an error body is a message, not a data set
_MAX_INT_DIGITS = 20
_PARSE_IN_THREAD_BYTES = 1024 * 1024


@dataclass(frozen=True)
class AnswerBounds:
    """How large one answer may be: decoded bytes, JSON values (an upper bound counted before parsing),
    and how deeply it may nest (None: not walked; the parser's own recursion limit still holds)."""

    max_bytes: int
    max_values: int
    max_depth: int | None = None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"a number of {len(text)} digits is out of range")
    return int(text)


def _no_constants(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def parse_json(body: bytes, max_values: int, max_depth: int | None = None) -> Any:
    """Parses an upstream's JSON within bounds; ValueError says why not.

    Every value is the top one, the first in its array or object, or follows a comma, so commas plus
    brackets plus one bounds their number (from above: those inside strings count too), at C speed.
    """
    values = body.count(b",") + body.count(b"[") + body.count(b"{") + 1
    if values > max_values:
        raise ValueError(f"it holds more than {max_values} JSON values, far more than a real answer")
    try:
        data = json.loads(body, parse_float=_finite, parse_int=_bounded_int, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("it nests too deeply") from None
    if max_depth is not None and _depth_exceeds(data, max_depth):
        raise ValueError(f"it nests deeper than {max_depth} levels")
    return data


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth >= max_depth:
                return True
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def require_key(key: SecretStr | None, variable: str, tool: str) -> str:
    """The key's value, or a 503 that tells the operator which variable to set."""
    value = key.get_secret_value().strip() if key is not None else ""
    if not value:
        raise Unavailable(
            f"The {tool} tool is not configured: set {variable} (in the environment, .env or .env.local) "
            "and restart the service"
        )
    return value


def service_redactor(settings: Settings) -> Redactor:
    """The redactor of the service's upstream keys: each tool's answers are scrubbed of both."""
    keys = (settings.serper_api_key, settings.openai_api_key)
    return Redactor(key.get_secret_value() for key in keys if key is not None)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of 429 and 5xx answers: at most `max_retries`, never waiting longer than `max_wait_s` at once.

    The upstream's `Retry-After` (or OpenAI's `retry-after-ms`) is honoured; when it asks for more than
    `max_wait_s` the call gives up at once rather than hold the caller. Without it, the wait doubles from
    `base_s` (with jitter) up to `max_wait_s`.
    """

    max_retries: int = 2
    max_wait_s: float = 10.0
    base_s: float = 0.5

    def delay(self, attempt: int, headers: httpx2.Headers) -> float | None:
        """Seconds to wait before retrying after failed attempt number `attempt` (from 0), or None to stop."""
        if attempt >= self.max_retries:
            return None
        asked = retry_after(headers)
        if asked is not None:
            return asked if asked <= self.max_wait_s else None
        backoff: float = min(self.base_s * 2**attempt, self.max_wait_s)
        return backoff * random.uniform(0.5, 1.0)  # noqa: S311 -- jitter spreads retries; no secrecy involved


def retry_after(headers: httpx2.Headers) -> float | None:
    """The wait an upstream asked for, in seconds: `retry-after-ms`, or `Retry-After` (seconds or HTTP date)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            try:
                when = parsedate_to_datetime(value)
            except (TypeError, ValueError):
                continue
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
            seconds = (when - datetime.now(UTC)).total_seconds()
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


def upstream_message(body: bytes) -> str:
    """The error message an upstream sent: OpenAI's `error.message`, Serper's `message`, or the text itself."""
    return well_formed(_message_of(body))


def _message_of(body: bytes) -> str:
    try:
        data = parse_json(body, _MAX_ERROR_VALUES)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("error", "message", "detail"):
            if isinstance(data.get(key), str):
                return str(data[key])
    text = body.decode("utf-8", "replace").strip()
    return " ".join(text.split()) or "(empty body)"


class JsonApi:
    """POSTs JSON to one upstream API through the egress guard and returns the decoded answer.

    Raises the service's own errors: HostBlocked (400, with a hint) when the base URL's host is not
    allow-listed, UpstreamTimeout (504), and UpstreamError (502) carrying the upstream's message.
    Redirects are not followed: the key must not travel to wherever an upstream points.
    """

    def __init__(
        self,
        guard: EgressGuard,
        *,
        tool: str,
        upstream: str,
        base_url: str,
        policy: RetryPolicy,
        timeout_s: float,
        redactor: Redactor,
    ) -> None:
        self._guard = guard
        self.redactor = redactor
        self._tool = tool
        self._upstream = upstream
        self._base_url = base_url.rstrip("/")
        self._policy = policy
        self._timeout_s = timeout_s
        self._client = httpx2.AsyncClient(
            transport=guard.transport(tool=tool), follow_redirects=False, timeout=timeout_s
        )

    @classmethod
    def from_settings(
        cls, guard: EgressGuard, settings: Settings, *, tool: str, upstream: str, base_url: str
    ) -> JsonApi:
        return cls(
            guard,
            tool=tool,
            upstream=upstream,
            base_url=base_url,
            policy=RetryPolicy(settings.upstream_max_retries, settings.upstream_max_retry_wait_s),
            timeout_s=settings.upstream_timeout_s,
            redactor=service_redactor(settings),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def url(self, path: str) -> str:
        return f"{self._base_url}/{path.lstrip('/')}"

    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str], *, bounds: AnswerBounds) -> Any:
        url = self.url(path)
        try:
            self._guard.check_url(url, "POST", tool=self._tool)
        except HostBlocked as exc:
            exc.extra["hint"] = (
                f"the {self._tool} tool calls {self._upstream} at {exc.host}: add it to ALLOW_HTTP_HOSTS, "
                f"e.g. ALLOW_HTTP_HOSTS='[\"{exc.host}\"]'"
            )
            raise
        attempt = 0
        while True:
            status, response_headers, body = await self._attempt(url, payload, headers, bounds.max_bytes)
            if 200 <= status < 300:
                return await self._decode(body, bounds)
            message = self.redactor.scrub(upstream_message(body))[0][:_MAX_MESSAGE_CHARS]
            if status == 429 or status >= 500:
                wait = self._policy.delay(attempt, response_headers)
                if wait is not None:
                    attempt += 1
                    log.info(
                        "%s answered %d; retry %d of %d in %.2f s",
                        self._upstream,
                        status,
                        attempt,
                        self._policy.max_retries,
                        wait,
                    )
                    await anyio.sleep(wait)
                    continue
            if 300 <= status < 400:
                message = "a redirect, which is not followed: point the base URL at the final address"
            tries = f" after {attempt + 1} attempts" if attempt else ""
            raise UpstreamError(
                f"{self._upstream} answered {status}{tries}: {message}", upstream=self._upstream, upstream_status=status
            )

    async def _attempt(
        self, url: str, payload: dict[str, Any], headers: dict[str, str], max_bytes: int
    ) -> tuple[int, httpx2.Headers, bytes]:
        try:
            with anyio.fail_after(self._timeout_s):
                async with self._client.stream("POST", url, json=payload, headers=headers) as response:
                    body, truncated = await read_capped(response, max_bytes)
                    if truncated:
                        raise UpstreamError(
                            f"{self._upstream} sent more than {max_bytes} bytes (decoded), more than this answer "
                            "can need; giving up",
                            upstream=self._upstream,
                        )
                    return response.status_code, response.headers, body
        except httpx2.PoolTimeout as exc:
            raise UpstreamTimeout(f"{self._upstream} is too busy: {exc}") from None
        except (TimeoutError, httpx2.TimeoutException):
            raise UpstreamTimeout(f"{self._upstream} did not answer within {self._timeout_s:g} s") from None
        except httpx2.TransportError as exc:
            detail = self.redactor.scrub(describe_client_error(exc))[0]
            raise UpstreamError(f"Could not reach {self._upstream}: {detail}") from None
        except CLIENT_ERRORS as exc:
            raise self.malformed(self.redactor.scrub(describe_client_error(exc))[0]) from None

    async def _decode(self, body: bytes, bounds: AnswerBounds) -> Any:
        try:
            if len(body) < _PARSE_IN_THREAD_BYTES:
                return parse_json(body, bounds.max_values, bounds.max_depth)
            # A large answer (a big embeddings batch) is parsed in a worker thread: the parser calls back
            # into Python for every number, so the event loop keeps serving other requests meanwhile.
            return await anyio.to_thread.run_sync(parse_json, body, bounds.max_values, bounds.max_depth)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self.malformed("not JSON") from None
        except ValueError as exc:  # within the bounds of parse_json, it says which
            raise self.malformed(str(exc)) from None

    def malformed(self, why: str) -> UpstreamError:
        return UpstreamError(f"{self._upstream} sent a malformed response: {why}", upstream=self._upstream)
