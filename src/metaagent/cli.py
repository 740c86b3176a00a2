"""The `metaagent` command: serve the tools, run code, and the operators' checks."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from metaagent.errors import ConfigError, EgressRefused
from metaagent.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help="MetaAgent tools service.")
allowlist_app = typer.Typer(no_args_is_help=True, help="Inspect and test the egress allow-list.")
audit_app = typer.Typer(no_args_is_help=True, help="Work with the audit log.")
app.add_typer(allowlist_app, name="allowlist")
app.add_typer(audit_app, name="audit")

CONFIG_ERROR = 2


class GracefulServer(uvicorn.Server):
    """Exits 0 after a SIGTERM/SIGINT shutdown: the stop was asked for and completed cleanly."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal once shut down, which would end the process with -15.
            self._captured_signals.clear()


def _fail(message: str, code: int = CONFIG_ERROR) -> typer.Exit:
    print(message, file=sys.stderr)
    return typer.Exit(code)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 3102,
) -> None:
    """Start the HTTP service (and the MCP endpoint at /mcp)."""
    from metaagent import logs
    from metaagent.app import create_app

    settings = Settings()
    logs.configure(settings.log_format)
    try:
        application = create_app(settings)
    except ConfigError as exc:
        raise _fail(f"metaagent: refusing to start: {exc}") from None
    config = uvicorn.Config(application, host=host, port=port, log_config=None, timeout_graceful_shutdown=15)
    GracefulServer(config).run()


@allowlist_app.command("check")
def allowlist_check() -> None:
    """Print the parsed allow-list and every warning or error (exit 2 when malformed)."""
    from metaagent.egress.allowlist import AllowList

    settings = Settings()
    try:
        allowlist = AllowList.parse(settings.allow_http_hosts)
    except ConfigError as exc:
        raise _fail(f"error: {exc}") from None
    if not allowlist:
        print("warning: ALLOW_HTTP_HOSTS is empty: every outbound request is blocked", file=sys.stderr)
    for duplicate in allowlist.duplicates:
        print(f"warning: {duplicate} is listed more than once", file=sys.stderr)
    print(f"{len(allowlist)} pattern(s):")
    for pattern in allowlist.patterns:
        kind = "wildcard (subdomains only)" if pattern.startswith("*.") else "exact"
        print(f"  {pattern}  [{kind}]")


@allowlist_app.command("test")
def allowlist_test(url: str) -> None:
    """Say whether a URL is allowed or blocked, and why (exit 1 when blocked)."""
    from metaagent.egress.allowlist import AllowList
    from metaagent.egress.url import parse_url

    settings = Settings()
    try:
        allowlist = AllowList.parse(settings.allow_http_hosts)
    except ConfigError as exc:
        raise _fail(f"error: {exc}") from None
    try:
        target = parse_url(url)
    except EgressRefused as exc:
        raise _fail(f"blocked: {exc.message}", 1) from None
    match = allowlist.match(target.host)
    if not match.allowed:
        raise _fail(f"blocked: host {target.host}: {match.reason}", 1)
    print(f"allowed: host {target.host} matches {match.reason}")
    if not settings.allow_private_networks:
        print("note: at request time its addresses must also be public (METAAGENT_ALLOW_PRIVATE_NETWORKS=false)")


@audit_app.command("verify")
def audit_verify(
    path: Annotated[Path | None, typer.Argument(help="Audit log (default: METAAGENT_AUDIT_LOG).")] = None,
) -> None:
    """Check the audit log's hash chain; name the first broken record (exit 1)."""
    from metaagent.audit import verify

    target = path or Settings().audit_log
    if not target.exists():
        raise _fail(f"error: no audit log at {target}", 1)
    result = verify(target)
    if not result.ok:
        raise _fail(f"BROKEN: {result.message}", 1)
    print(f"ok: {result.message}")


def main() -> None:
    app()
