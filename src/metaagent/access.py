"""Who may call the service: API keys, the Bearer check in front of every route, and per-key limits.

Keys come from `METAAGENT_API_KEYS` (a JSON array or comma-separated; `@/path` reads a file) and from
`METAAGENT_API_KEYS_FILE` (one entry per line, `#` comments). An entry is `key`, `name:key`, or
`name:key:admin` for an operator's key, which sees and stops every caller's executions (see
`metaagent.tenancy`; every other key sees only its own). Only the
sha256 of each key is kept once they are read; a presented key is hashed and compared with every stored
hash in constant time. A key's id (`name`, or `key_` and the first 8 hex digits of its sha256) is what
audit records, logs and errors show: never the key.

With keys, every path but `/health` needs `Authorization: Bearer <key>` (401 otherwise); `/health`
stays open because load balancers and orchestrators probe it without credentials, and without a key it
says only the status (`metaagent.api.health`); a key sent to it is checked as anywhere else, and its
caller sees the checks. Without keys there is no check, and `metaagent serve` listens only on loopback.

The caller found is put in the request's scope twice: under `CALLER_SCOPE_KEY` for the service, and as
`scope["user"]` (the MCP SDK's `AuthenticatedUser`, named by the key id, never the key) so that the SDK
binds each MCP session to the key that opened it and answers 404 to any other key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from starlette.types import ASGIApp, Receive, Scope, Send

from metaagent.asgi import send_json_error
from metaagent.errors import AtCapacity, ConfigError
from metaagent.fleet.state import SharedState
from metaagent.settings import Settings
from metaagent.tenancy import LOCAL, Caller

log = logging.getLogger("metaagent.access")

KEY_MIN_LENGTH = 16
PUBLIC_PATHS = frozenset({"/health"})
CALLER_SCOPE_KEY = "metaagent.caller"
# Set on a request that another replica of the fleet forwarded, once its fleet token was checked
# (`metaagent.fleet.routing`): it carries its caller, and its Host and Origin were checked where it came in.
FORWARDED_SCOPE_KEY = "metaagent.fleet.forwarded"
OPERATOR_SUFFIX = ":admin"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: what an HTTP header carries unchanged
_GENERATE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"

# The caller of the request being served; read by the tools that record a caller.
_current_caller: ContextVar[Caller] = ContextVar("metaagent_caller", default=LOCAL)


def current_caller() -> str | None:
    """The key id of the request being served (None without keys): what audit records name."""
    return _current_caller.get().key_id


def current_tenant() -> Caller:
    """The caller of the request being served, for the ownership rule of `metaagent.tenancy`."""
    return _current_caller.get()


@contextmanager
def acting_as(caller: Caller) -> Iterator[None]:
    """Runs the block as `caller` (for work that arrives outside the HTTP request's own context, e.g. MCP)."""
    token = _current_caller.set(caller)
    try:
        yield
    finally:
        _current_caller.reset(token)


def caller_of(request: Any) -> Caller:
    """The caller the access check found for a Starlette request (the local caller without keys)."""
    scope = getattr(request, "scope", None)
    caller = scope.get(CALLER_SCOPE_KEY) if isinstance(scope, dict) else None
    return caller if isinstance(caller, Caller) else LOCAL


def key_id(key: str) -> str:
    return f"key_{hashlib.sha256(key.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    digest: bytes
    operator: bool = False


class KeyRing:
    """The accepted keys, as hashes."""

    def __init__(self, keys: Sequence[ApiKey] = ()) -> None:
        self._keys = tuple(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def key_ids(self) -> list[str]:
        return [k.key_id for k in self._keys]

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """Reads `METAAGENT_API_KEYS` and `METAAGENT_API_KEYS_FILE`; ConfigError names each bad entry."""
        entries: list[tuple[str, str]] = []  # (where, text)
        problems: list[str] = []
        if settings.api_keys is not None:
            text = settings.api_keys.get_secret_value().strip()
            if text.startswith("@"):
                entries += _read_file(Path(text[1:]), problems)
            else:
                entries += _split(text, "METAAGENT_API_KEYS", problems)
        if settings.api_keys_file is not None:
            entries += _read_file(settings.api_keys_file, problems)
        keys = _parse_entries(entries, problems)
        if problems:
            raise ConfigError("METAAGENT_API_KEYS is malformed:", problems)
        return cls(keys)

    def identify(self, presented: str) -> Caller | None:
        """The caller whose key `presented` is, or None. Compares with every key, so timing says nothing."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found: Caller | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest):
                found = Caller(key.key_id, operator=key.operator)
        return found


def _split(text: str, where: str, problems: list[str]) -> list[tuple[str, str]]:
    if not text:
        return []
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except ValueError:
            problems.append(f"{where} starts with '[' but is not a valid JSON array of strings")
            return []
        if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
            problems.append(f"{where} must be a JSON array of strings")
            return []
        items = parsed
    else:
        items = text.split(",")
    return [(f"{where} entry {n}", item.strip()) for n, item in enumerate(items, 1)]


def _read_file(path: Path, problems: list[str]) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"cannot read the API key file {path}: {exc}")
        return []
    return [
        (f"{path} line {n}", line.strip())
        for n, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]


def _parse_entries(entries: list[tuple[str, str]], problems: list[str]) -> list[ApiKey]:
    keys: list[ApiKey] = []
    seen_ids: set[str] = set()
    seen_digests: set[bytes] = set()
    for where, text in entries:
        if not text:
            problems.append(f"{where} is empty (a stray comma?)")
            continue
        name, sep, secret = text.partition(":")
        operator = bool(sep) and secret.endswith(OPERATOR_SUFFIX)
        if operator:
            secret = secret.removesuffix(OPERATOR_SUFFIX)
        if not sep:
            name, secret = "", text
        elif not _NAME.match(name):
            # Messages never quote an entry: it may be a key.
            problems.append(f"{where}: a name before ':' may hold only letters, digits, '_', '.', '-' (1-64)")
            continue
        if len(secret) < KEY_MIN_LENGTH or not _KEY_CHARS.match(secret):
            problems.append(
                f"{where}: a key must be at least {KEY_MIN_LENGTH} visible ASCII characters without spaces; "
                f"make one with {_GENERATE}"
            )
            continue
        digest = hashlib.sha256(secret.encode()).digest()
        ident = name or key_id(secret)
        if ident in seen_ids or digest in seen_digests:
            problems.append(f"{where}: the key or its name {ident} is listed twice")
            continue
        seen_ids.add(ident)
        seen_digests.add(digest)
        keys.append(ApiKey(ident, digest, operator))
    return keys


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen_address(host: str, keys: KeyRing) -> None:
    """Refuses (ConfigError) to listen beyond loopback without keys: anyone who can connect could run code."""
    if not keys and not is_loopback(host):
        raise ConfigError(
            f"--host {host} is reachable from other machines, and no API keys are set, so anyone who can "
            "connect could run code here. Set METAAGENT_API_KEYS (or METAAGENT_API_KEYS_FILE), "
            f'e.g. METAAGENT_API_KEYS="$({_GENERATE})", or listen on 127.0.0.1.'
        )


class RequireApiKey:
    """ASGI middleware: with keys set, every request but `PUBLIC_PATHS` needs a valid Bearer key (401)."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or CALLER_SCOPE_KEY in scope:  # or another replica's forward
            await self.app(scope, receive, send)
            return
        presented = _bearer(scope)
        if presented is None and scope["path"] in PUBLIC_PATHS:  # a probe: no caller, the public answer
            await self.app(scope, receive, send)
            return
        caller = self.keys.identify(presented) if presented else None
        if caller is None:
            await _unauthorized(scope, send, missing=presented is None)
            return
        scope[CALLER_SCOPE_KEY] = caller
        # The MCP SDK ties each session to this identity (the key id; the token itself is not kept).
        scope["user"] = AuthenticatedUser(AccessToken(token="", client_id=str(caller.key_id), scopes=[]))
        with acting_as(caller):
            await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = bytes(value).decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return str(token.strip())
            return ""
    return None


async def _unauthorized(scope: Scope, send: Send, *, missing: bool) -> None:
    if missing:
        message = "Missing API key: send it as 'Authorization: Bearer <key>'"
        challenge = 'Bearer realm="metaagent"'
    else:
        message = "Invalid API key: send one of this service's keys as 'Authorization: Bearer <key>'"
        challenge = 'Bearer realm="metaagent", error="invalid_token"'
    client = scope.get("client")
    log.warning(
        "refused %s %s from %s: %s API key",
        scope["method"],
        scope["path"],
        client[0] if client else "?",
        "no" if missing else "invalid",
    )
    await send_json_error(send, 401, message, [(b"www-authenticate", challenge.encode())])


class ExecutionQuota:
    """At most `limit` executions running or queued per key (without keys, for the one local caller); past
    that, 429 for that key only. Counted in the fleet's shared state, so the limit holds across replicas."""

    def __init__(self, state: SharedState, limit: int) -> None:
        self.state = state
        self.limit = limit

    @asynccontextmanager
    async def hold(self, caller: str | None) -> AsyncIterator[None]:
        lease = secrets.token_hex(12)
        admission = await self.state.acquire("executions", lease, caller, per_key=self.limit, total=None)
        if not admission.admitted:
            who = f"Key {caller}" if caller is not None else "This caller"
            raise AtCapacity(
                f"{who} already has {self.limit} executions running or queued (the limit per key, "
                "METAAGENT_MAX_EXECUTIONS_PER_KEY); retry when one finishes",
                retry_after_s=2,
            )
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.state.release("executions", lease)
