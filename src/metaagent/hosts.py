"""Hosts and origins: which `Host` every route answers to, and which `Origin` may run or change anything.

A web page the operator opens can make its own name resolve to 127.0.0.1 (DNS rebinding, the attack of
CVE-2024-28224 against Ollama) and then drive a service on loopback with the browser's requests. Those
requests carry the page's name in `Host`, and in `Origin` for anything but a simple GET. So, in front of
every route (`CheckHostAndOrigin`, the outermost middleware):

- `Host` must be a loopback name (`127.0.0.1`, `localhost`, `[::1]`, any port) or one listed in
  `METAAGENT_ALLOWED_HOSTS` (`host` for any port, `host:port` for one; `*` turns the check off), else 421.
  The decision is the MCP SDK's own (`TransportSecurityMiddleware`, built from the same settings that
  `/mcp` gets), applied to the whole app: one setting, one mechanism.
- A request that could run or change something (any method but GET, HEAD and OPTIONS) and carries an
  `Origin` must come from the service's own origin, the scheme and the very `Host` it was sent to
  (default ports aside), else 403. Agents send no `Origin`; browsers send it on cross-origin requests and
  on every same-origin POST, so a page on another origin, another port of localhost included, cannot
  POST here.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from metaagent.access import FORWARDED_SCOPE_KEY
from metaagent.asgi import send_json_error

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": "80", "https": "443"}
_SHOWN = 200  # characters of a caller's header quoted back in an error


def parse_allowed_hosts(text: str) -> list[str]:
    """`METAAGENT_ALLOWED_HOSTS` as a list: a JSON array or comma-separated, lower case."""
    text = text.strip()
    if not text:
        return []
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text.split(",")
    items = parsed if isinstance(parsed, list) else [parsed]
    return [str(item).strip().lower() for item in items if str(item).strip()]


def transport_security(allowed_hosts: str) -> TransportSecuritySettings:
    """The MCP SDK's DNS-rebinding settings: the loopback names plus `METAAGENT_ALLOWED_HOSTS` (`*`: no check)."""
    extra = parse_allowed_hosts(allowed_hosts)
    if "*" in extra:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    hosts: list[str] = []
    origins: list[str] = []
    for host in [*LOCAL_HOSTS, *extra]:
        forms = [host] if ":" in host.removeprefix("[").split("]")[-1] else [host, f"{host}:*"]
        hosts.extend(forms)
        origins.extend(f"{scheme}://{form}" for form in forms for scheme in ("http", "https"))
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


def is_own_origin(origin: str, host: str) -> bool:
    """Whether `Origin` names the origin the request was sent to: http(s), and the `Host` it carries."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or parts.path or parts.query or parts.fragment or not parts.hostname:
        return False
    if parts.username is not None or parts.password is not None:
        return False
    default = _DEFAULT_PORTS[scheme]
    netloc = parts.netloc.lower()
    if port is not None and str(port) == default:
        netloc = netloc.rsplit(":", 1)[0]
    own = host.strip().lower()
    if own.endswith(f":{default}") and not own.endswith("]"):
        own = own.rsplit(":", 1)[0]
    return netloc == own


class CheckHostAndOrigin:
    """ASGI middleware: 421 for a `Host` the service does not answer to, 403 for a foreign `Origin` on
    anything that runs or changes something. Every other request passes untouched."""

    def __init__(self, app: ASGIApp, security: TransportSecuritySettings) -> None:
        self.app = app
        self.enabled = security.enable_dns_rebinding_protection
        self._sdk_check = TransportSecurityMiddleware(security)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled or scope.get(FORWARDED_SCOPE_KEY):  # checked where it came in
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        host = request.headers.get("host", "")
        # The SDK's check judges the Host here; the Origin is judged below, by the stricter own-origin rule
        # (and only on what changes something), so the SDK is not shown it.
        without_origin = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"origin"]}
        refusal = await self._sdk_check.validate_request(Request(without_origin), is_post=False)
        if refusal is not None:
            await send_json_error(
                send,
                421,
                f"Misdirected request: this service does not answer to Host {host[:_SHOWN]!r}. It answers to "
                "127.0.0.1, localhost and [::1] on any port, and to the names in METAAGENT_ALLOWED_HOSTS: "
                "list the name clients use there (this check stops DNS-rebinding attacks from web pages)",
            )
            return
        origin = request.headers.get("origin")
        if origin is not None and scope["method"] not in SAFE_METHODS and not is_own_origin(origin, host):
            await send_json_error(
                send,
                403,
                f"Cross-origin request refused: Origin {origin[:_SHOWN]!r} is not this service's own "
                f"(http://{host[:_SHOWN]}); a web page on another origin may not run or change anything here. "
                "Agents and scripts send no Origin header",
            )
            return
        await self.app(scope, receive, send)
