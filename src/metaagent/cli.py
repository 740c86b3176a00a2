"""The `metaagent` command: serve the tools, run code, and the operators' checks."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
import uvicorn

from metaagent.errors import ConfigError, EgressRefused
from metaagent.settings import Settings
from metaagent.terminal import Terminal

if TYPE_CHECKING:
    from socket import socket

    from fastapi import FastAPI

app = typer.Typer(no_args_is_help=True, add_completion=False, help="MetaAgent tools service.")
allowlist_app = typer.Typer(no_args_is_help=True, help="Inspect and test the egress allow-list.")
audit_app = typer.Typer(no_args_is_help=True, help="Work with the audit log.")
sandbox_app = typer.Typer(no_args_is_help=True, help="The sandbox image.")
app.add_typer(allowlist_app, name="allowlist")
app.add_typer(audit_app, name="audit")
app.add_typer(sandbox_app, name="sandbox")

CONFIG_ERROR = 2


class GracefulServer(uvicorn.Server):
    """Stops the service's executions at SIGTERM/SIGINT and exits 0 once shut down cleanly.

    Uvicorn's graceful shutdown waits for open requests; an execution may run for minutes, so its
    container is killed at the signal (the caller gets its answer with `killed: true`) rather than after
    the wait.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        stop = getattr(self._app.state, "stop_executions", None)
        if stop is not None and self._loop is not None:
            # A signal handler may run between any two bytecodes of the event loop: hand over, don't act.
            self._loop.call_soon_threadsafe(stop)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal once shut down, which would end the process with -15.
            self._captured_signals.clear()


def _fail(message: str, code: int = CONFIG_ERROR) -> typer.Exit:
    print(message, file=sys.stderr)
    return typer.Exit(code)


def _settings() -> Settings:
    """The settings from `.env`, `.env.local` and the environment; exit 2 naming each bad one."""
    from pydantic import ValidationError

    from metaagent.settings import describe_settings_error

    try:
        return Settings()
    except ValidationError as exc:
        raise _fail(f"metaagent: bad configuration: {describe_settings_error(exc)}") from None


def _service_app() -> FastAPI:
    """The service app from the environment's settings, with logging set up; exit 2 on a bad configuration."""
    import anyio

    from metaagent import logs
    from metaagent.app import create_app
    from metaagent.services import settle_runtime

    settings = _settings()
    logs.configure(settings.log_format)
    try:
        service = create_app(settings)
        # An explicit METAAGENT_SANDBOX_RUNTIME=runsc is tested before the port opens: exit 2 if it cannot work.
        anyio.run(settle_runtime, service.state.configuration)
    except ConfigError as exc:
        raise _fail(f"metaagent: refusing to start: {exc}") from None
    return service


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 3102,
) -> None:
    """Start the HTTP service (and the MCP endpoint at /mcp)."""
    from metaagent.access import check_listen_address
    from metaagent.serving import connection_limits, uvicorn_config

    service = _service_app()
    try:
        check_listen_address(host, service.state.keys)
        limits = connection_limits(service.state.configuration.settings)
    except ConfigError as exc:
        raise _fail(f"metaagent: refusing to start: {exc}") from None
    logging.getLogger("metaagent").info("connections: %s", limits.describe())
    GracefulServer(uvicorn_config(service, limits, host, port), service).run()


# `metaagent run`'s language from the file's extension, when --language does not name it.
LANGUAGE_OF_EXTENSION = {".py": "python", ".js": "javascript", ".cjs": "javascript", ".mjs": "javascript"}


def language_of(file: Path, language: str | None) -> str:
    """The language to run `file` in: `language` if given, else its extension's; exit 2 for another extension
    or an unknown language."""
    known_languages = sorted(set(LANGUAGE_OF_EXTENSION.values()))
    if language is not None:
        if language not in known_languages:
            raise _fail(f"metaagent: unknown --language {language!r}; give {' or '.join(known_languages)}")
        return language
    found = LANGUAGE_OF_EXTENSION.get(file.suffix.lower())
    if found is None:
        known = ", ".join(LANGUAGE_OF_EXTENSION)
        raise _fail(
            f"metaagent: cannot tell the language of {file} from its extension ({known} are known); "
            "give --language javascript or --language python"
        )
    return found


@app.command()
def run(
    file: Annotated[
        Path,
        typer.Argument(
            help="The file to run: JavaScript (.js, .cjs, .mjs; CommonJS) or Python (.py).", exists=True, dir_okay=False
        ),
    ],
    timeout: Annotated[int, typer.Option(min=1, max=300, help="Timeout in seconds.")] = 8,
    memory: Annotated[int, typer.Option(min=64, max=1024, help="Memory limit in MiB.")] = 256,
    language: Annotated[
        str | None, typer.Option(help="javascript or python (default: from the file's extension).")
    ] = None,
) -> None:
    """Run a file in a fresh sandbox container, exactly as the code interpreter does; exit with its status."""
    import anyio
    from pydantic import ValidationError

    from metaagent.audit import AuditLog
    from metaagent.errors import MetaAgentError, describe_validation_errors
    from metaagent.executions import ExecutionRegistry
    from metaagent.languages import JAVASCRIPT, LANGUAGES
    from metaagent.sandbox.engine import Engine
    from metaagent.sandbox.runtime import RuntimeChoice
    from metaagent.services import sandbox_image
    from metaagent.tools.code_interpreter import CodeInterpreter, CodeInterpreterRequest

    settings = _settings()
    chosen = LANGUAGES[language_of(file, language)]
    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    try:
        runtime = RuntimeChoice.parse(settings.sandbox_runtime)
    except ConfigError as exc:
        raise _fail(f"metaagent: {exc}") from None
    try:
        code = file.read_text(encoding="utf-8")
        request = CodeInterpreterRequest(
            code=code, timeout_s=timeout, memory_mb=memory, stdin=stdin, language=chosen.name
        )
    except UnicodeDecodeError as exc:
        raise _fail(f"metaagent: {file} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None
    except ValidationError as exc:
        message, _details = describe_validation_errors(exc.errors(), root=())
        raise _fail(f"metaagent: {file} cannot run: {message}") from None

    terminal = Terminal()
    caught: list[int] = []

    async def execute() -> int:
        engine = Engine()
        # JavaScript's image is always there (the runtime self-test's); the file's language's beside it if
        # METAAGENT_LANGUAGES serves it (otherwise the interpreter refuses it, naming the setting).
        served = [LANGUAGES[n] for n in settings.languages if n in (JAVASCRIPT.name, chosen.name)]
        images = {lang.name: sandbox_image(engine, settings, lang) for lang in served}
        interpreter = CodeInterpreter(
            engine,
            list(images.values()),
            ExecutionRegistry(),
            AuditLog(settings.audit_log),
            capacity=1,
            queue_size=0,
            cpus=settings.sandbox_cpus,
            grace_s=settings.kill_grace_s,
            runtime=runtime,
        )
        try:
            if chosen.name in images:
                await images[chosen.name].refresh(build=settings.sandbox_build_on_start)
            result = await interpreter(request, caller="cli", sink=terminal)
        finally:
            engine.close()
        terminal.finish({"stdout": result.stdout, "stderr": result.stderr})  # the truncation markers
        if result.timed_out:
            terminal.say(f"timed out after {timeout} s")
        if result.oom_killed:
            terminal.say(f"killed at the memory limit ({memory} MiB)")
        return result.exit_code if result.exit_code is not None else 1

    async def until_stopped() -> int | None:
        """`execute()`'s status; None if a signal or a closed output came first (`caught` says which).

        Either way the execution is then cancelled: killed, its container removed.
        """
        status: list[int] = []
        failure: list[MetaAgentError] = []
        async with anyio.create_task_group() as group:

            def stop(signum: int) -> None:
                caught.append(signum)
                group.cancel_scope.cancel()

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        stop(signum)

            terminal.on_reader_gone = lambda: stop(signal.SIGPIPE)
            group.start_soon(watch_signals)
            try:
                status.append(await execute())
            except MetaAgentError as exc:  # carried out of the task group unwrapped, to be said plainly
                failure.append(exc)
            group.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return status[0] if status else None

    try:
        status = anyio.run(until_stopped)
    except ConfigError as exc:  # an explicit runsc that cannot work
        raise _fail(f"metaagent: {exc}") from None
    except MetaAgentError as exc:
        terminal.say(exc.message)
        raise typer.Exit(1) from None
    if status is None:
        signum = caught[0]
        if signum != signal.SIGPIPE:  # a reader that went away is told nothing, as `yes | head -1` tells nothing
            terminal.say(f"{signal.Signals(signum).name}: the execution was stopped and its container removed")
        raise typer.Exit(128 + signum)  # as a shell reports a program ended by that signal
    raise typer.Exit(status)


@app.command(
    epilog="On a terminal a JavaScript block ends with its line once its brackets, template literals and comments "
    "are closed; a Python block as in Python's REPL (after a line ending in ':', a blank line ends it; an open "
    "bracket continues). Until then the prompt is `... ` (.break drops it). From a pipe or a file, a block is "
    "everything up to a blank line. A Python call's figures are saved in a temporary folder, each named on "
    "stdout. Ctrl-C interrupts a running call (on a terminal); .exit, Ctrl-D or the end of the input closes "
    "the session."
)
def repl(
    url: Annotated[str, typer.Option(envvar="METAAGENT_URL", help="The running service.")] = "http://127.0.0.1:3102",
    key: Annotated[
        str | None,
        typer.Option(envvar="METAAGENT_API_KEY", show_envvar=True, help="API key (sent as Authorization: Bearer)."),
    ] = None,
    timeout: Annotated[int, typer.Option(min=1, max=300, help="Timeout of each call in seconds.")] = 8,
    memory: Annotated[int | None, typer.Option(min=64, max=1024, help="The session's memory limit in MiB.")] = None,
    idle_timeout: Annotated[
        int | None, typer.Option(min=10, max=3600, help="Close the session after this long idle (seconds).")
    ] = None,
    package: Annotated[list[str] | None, typer.Option(help="An npm package for the session (repeatable).")] = None,
    language: Annotated[str, typer.Option(help="The session's language: javascript or python.")] = "javascript",
) -> None:
    """A JavaScript or Python REPL in a session of a running service: state persists from one input to the next."""
    from metaagent.client import Client
    from metaagent.repl import DIALECTS, Repl

    if language not in DIALECTS:
        raise _fail(f"metaagent: unknown --language {language!r}; give {' or '.join(DIALECTS)}")
    config = {"language": language, "memory_mb": memory, "idle_timeout_s": idle_timeout, "packages": package or None}
    with Client(url, api_key=key) as client:
        session = Repl(client, config, timeout, interactive=sys.stdin is not None and sys.stdin.isatty())
        status = session.run()
    raise typer.Exit(status)


@sandbox_app.command("build")
def sandbox_build() -> None:
    """Build the sandbox images offline from Debian packages: JavaScript's, and Python's when python is in
    METAAGENT_LANGUAGES (cached; the first build takes about a minute for JavaScript, minutes for Python)."""
    import docker

    from metaagent.languages.javascript.image import ImageBuildError, build_image
    from metaagent.languages.python.image import build_python_image

    settings = _settings()
    try:
        client = docker.from_env()
        print(build_image(client, cache_dir=settings.sandbox_cache_dir, progress=lambda line: print(line)))
        if "python" in settings.languages:
            print(build_python_image(client, cache_dir=settings.sandbox_cache_dir, progress=lambda line: print(line)))
    except ImageBuildError as exc:
        raise _fail(f"error: {exc}", 1) from None
    except docker.errors.DockerException as exc:
        raise _fail(f"error: the container engine is unavailable ({exc}); run scripts/ensure-docker", 1) from None


@sandbox_app.command("prune")
def sandbox_prune() -> None:
    """Remove sandbox image tags of other versions (left by runner changes); keep this version's."""
    import docker

    from metaagent.languages.javascript.image import prune_images
    from metaagent.languages.python.image import prune_python_images

    try:
        client = docker.from_env()
        removed, in_use = prune_images(client)
        removed_python, in_use_python = prune_python_images(client)
        removed, in_use = removed + removed_python, in_use + in_use_python
    except docker.errors.DockerException as exc:
        raise _fail(f"error: the container engine is unavailable ({exc}); run scripts/ensure-docker", 1) from None
    for tag in removed:
        print(f"removed {tag}")
    for tag in in_use:
        print(f"kept {tag} (a container uses it)")
    print(f"{len(removed)} removed, {len(in_use)} kept in use")


@app.command("mcp")
def mcp_stdio() -> None:
    """Serve the tools over MCP on stdin/stdout (for MCP clients that start the server; logs go to stderr)."""
    import anyio

    from metaagent.mcp_server import serve_stdio

    anyio.run(serve_stdio, _service_app())


@allowlist_app.command("check")
def allowlist_check() -> None:
    """Print the parsed allow-list and every warning or error (exit 2 when malformed)."""
    from metaagent.egress.allowlist import AllowList, empty_items_warning

    settings = _settings()
    try:
        allowlist = AllowList.parse(settings.allow_http_hosts)
    except ConfigError as exc:
        raise _fail(f"error: {exc}") from None
    if allowlist.empty_items:
        print(f"warning: {empty_items_warning('ALLOW_HTTP_HOSTS', allowlist.empty_items)}", file=sys.stderr)
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

    settings = _settings()
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

    target = path or _settings().audit_log
    if not target.exists():
        raise _fail(f"error: no audit log at {target}", 1)
    result = verify(target)
    if not result.ok:
        raise _fail(f"BROKEN: {result.message}", 1)
    print(f"ok: {result.message}")


def main() -> None:
    app()
