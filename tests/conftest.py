"""Shared fixtures: real HTTP servers on 127.0.0.1, and the service app run in-process with its lifespan."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import httpx2
import pytest

from metaagent.app import create_app
from metaagent.settings import Settings
from tests.redis_server import RedisServer


class _UpstreamHandler(BaseHTTPRequestHandler):
    """A small origin server: each path is a behaviour the egress tests need."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if url.path == "/echo":
            echo = {
                "method": self.command,
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body.decode(),
            }
            self._reply(200, json.dumps(echo).encode(), {"Content-Type": "application/json"})
        elif url.path == "/redirect":
            self._reply(int(query.get("status", "302")), b"", {"Location": query["to"]})
        elif url.path == "/slow":
            time.sleep(float(query.get("s", "5")))
            self._reply(200, b"late")
        elif url.path == "/bytes":
            self._reply(200, b"x" * int(query["n"]), {"Content-Type": "application/octet-stream"})
        elif url.path == "/binary":
            self._reply(200, bytes(range(256)), {"Content-Type": "application/octet-stream"})
        else:
            self._reply(200, b"hello from upstream", {"Content-Type": "text/plain; charset=utf-8"})

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle


@contextmanager
def running_upstream() -> Iterator[str]:
    """Runs a real HTTP server on 127.0.0.1 and yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _UpstreamHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def upstream() -> Iterator[str]:
    with running_upstream() as url:
        yield url


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected sockets: the service's end (non-blocking) and a stand-in container's end."""
    service_end, container_end = socket.socketpair()
    service_end.setblocking(False)
    yield service_end, container_end
    service_end.close()
    container_end.close()


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings of an in-process service. JavaScript only unless a test names `languages`, as the test
    services in processes of their own are: a Python lane fills a warm pool of its own, and a Python
    container's start costs about 4 s of CPU under runsc (against 0.5 s for JavaScript's), in every test
    that starts a service."""
    values: dict[str, Any] = {
        "audit_log": tmp_path / "audit.jsonl",
        "sandbox_build_on_start": False,
        "languages": ("javascript",),
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]  # pydantic-settings' init-only option


ServiceFactory = Callable[..., Any]


@pytest.fixture
def service(tmp_path: Path) -> ServiceFactory:
    """`async with service(allow_http_hosts=...) as client:` runs the app in-process, lifespan included."""

    @asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[httpx2.AsyncClient]:
        app = create_app(make_settings(tmp_path, **overrides))
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1:3102") as client:
                with anyio.fail_after(60):  # until the start-up checks have run once (/health: 503 starting)
                    # Polled as any caller waits for a service: /health is the readiness it offers.
                    while (await client.get("/health")).json().get("status") == "starting":  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                yield client

    return start


# In CI (`scripts/test` sets METAAGENT_REQUIRE_DOCKER=1) a Docker or Redis test that skips is a failure: the
# guarantees they prove must be proven on every run, not silently passed over.
_skipped_docker_tests: list[str] = []


# And every test collected must have run: a scheduler that loses some (a run once counted 2,209 passed of
# 2,231 collected, with nothing else said) fails the run instead of passing it.
_collected: set[str] = set()
_finished: set[str] = set()


def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    _collected.update(ids)  # on the controller, each worker's list (they are the same)


def pytest_collection_finish(session: pytest.Session) -> None:
    _collected.update(item.nodeid for item in session.items)  # without xdist, or on a worker


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    needs = {"docker", "redis"} & set(report.keywords)
    if report.skipped and needs and os.environ.get("METAAGENT_REQUIRE_DOCKER") == "1":
        _skipped_docker_tests.append(report.nodeid)
    if report.when == "teardown":
        _finished.add(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a worker: the controller sees every worker's reports
    if _skipped_docker_tests:
        print(f"\n{len(_skipped_docker_tests)} Docker or Redis test(s) were skipped, which CI does not allow:")
        for nodeid in _skipped_docker_tests:
            print(f"  {nodeid}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    never_ran = sorted(_collected - _finished)
    if never_ran and not session.shouldstop and not session.shouldfail and exitstatus != pytest.ExitCode.INTERRUPTED:
        print(f"\n{len(never_ran)} collected test(s) never ran:")
        for nodeid in never_ran[:50]:
            print(f"  {nodeid}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own (a short path: a unix socket's path is at most 107 bytes)."""
    server = RedisServer(Path(tempfile.mkdtemp(prefix="ma-redis-")))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)
