"""What the search and embeddings tools share: one JSON API behind the egress guard, with bounded retries.

The API's key travels in a request header and nowhere else: it is never logged, and every message built
from an upstream answer is scrubbed of it before it can reach an error, a log line or an audit record.
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
from metaagent.settings import MIB, Settings
from metaagent.tools.http import read_capped

log = logging.getLogger("metaagent.upstream")

# Far above any real answer (2048 embeddings of 3072 dimensions in base64 are about 33 MiB).
MAX_RESPONSE_BYTES = 64 * MIB
_MAX_MESSAGE_CHARS = 500


def require_key(key: SecretStr | None, variable: str, tool: str) -> str:
    """The key's value, or a 503 that tells the operator which variable to set."""
    value = key.get_secret_value().strip() if key is not None else ""
    if not value:
        raise Unavailable(
            f"The {tool} tool is not configured: set {variable} (in the environment, .env or .env.local) "
            "and restart the service"
        )
    return value


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
    try:
        data = json.loads(body)
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


def redact(text: str, secret: str) -> str:
    """Removes the secret, and any word that starts like it (an upstream may echo a key partly masked)."""
    text = text.replace(secret, "[redacted]")
    if len(secret) >= 12:
        prefix = secret[:8]
        text = " ".join("[redacted]" if prefix in word else word for word in text.split(" "))
    return text


class JsonApi:
    """POSTs JSON to one upstream API through the egress guard and returns the decoded answer.

    Raises the service's own errors: HostBlocked (400, with a hint) when the base URL's host is not
    allow-listed, UpstreamTimeout (504), and UpstreamError (502) carrying the upstream's message.
    Redirects are not followed: the key must not travel to wherever an upstream points.
    """

    def __init__(
        self, guard: EgressGuard, *, tool: str, upstream: str, base_url: str, policy: RetryPolicy, timeout_s: float
    ) -> None:
        self._guard = guard
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
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def url(self, path: str) -> str:
        return f"{self._base_url}/{path.lstrip('/')}"

    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str], *, secret: str) -> Any:
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
            status, response_headers, body = await self._attempt(url, payload, headers, secret)
            if 200 <= status < 300:
                return self._decode(body)
            message = redact(upstream_message(body), secret)[:_MAX_MESSAGE_CHARS]
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
        self, url: str, payload: dict[str, Any], headers: dict[str, str], secret: str
    ) -> tuple[int, httpx2.Headers, bytes]:
        try:
            with anyio.fail_after(self._timeout_s):
                async with self._client.stream("POST", url, json=payload, headers=headers) as response:
                    body, truncated = await read_capped(response, MAX_RESPONSE_BYTES)
                    if truncated:
                        raise UpstreamError(
                            f"{self._upstream} sent more than {MAX_RESPONSE_BYTES // MIB} MiB; giving up"
                        )
                    return response.status_code, response.headers, body
        except (TimeoutError, httpx2.TimeoutException):
            raise UpstreamTimeout(f"{self._upstream} did not answer within {self._timeout_s:g} s") from None
        except httpx2.TransportError as exc:
            detail = redact(str(exc) or type(exc).__name__, secret)
            raise UpstreamError(f"Could not reach {self._upstream}: {detail}") from None

    def _decode(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise self.malformed("not JSON") from None

    def malformed(self, why: str) -> UpstreamError:
        return UpstreamError(f"{self._upstream} sent a malformed response: {why}", upstream=self._upstream)
