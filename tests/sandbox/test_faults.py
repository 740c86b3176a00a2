"""Faults staged for real: the engine stops and comes back, the disk is full while the image is built,
the service is SIGKILLed mid-execution. (A client that hangs up mid-execution: test_code_interpreter.py.)

Engine faults run against a private dockerd (tests/sandbox/private_engine.py), never the shared one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import httpx2
import pytest

from metaagent.languages.javascript.image import image_tag
from tests.sandbox.conftest import owned_containers
from tests.sandbox.private_engine import PrivateEngine, private_engine
from tests.test_cli import serving

pytestmark = [pytest.mark.docker, pytest.mark.slow]

RUN = "/tools/code-interpreter"
HELLO = {"code": "console.log('hello ' + (6 * 7))", "timeout_s": 10}
CLIENT_TIMEOUT_S = 60  # a request that takes longer than this hangs, and fails the test


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.2)


def health(base: str) -> dict[str, object]:
    body: dict[str, object] = httpx2.get(f"{base}/health", timeout=CLIENT_TIMEOUT_S).json()
    return body


def checks(base: str) -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = health(base)["checks"]  # type: ignore[assignment]  # JSON
    return found


def engine_errors(base: str) -> float:
    for line in httpx2.get(f"{base}/metrics", timeout=CLIENT_TIMEOUT_S).text.splitlines():
        if line.startswith("metaagent_engine_errors_total "):
            return float(line.split()[1])
    raise AssertionError("no metaagent_engine_errors_total in /metrics")


@pytest.fixture
def engine() -> Iterator[PrivateEngine]:
    with private_engine() as started:
        yield started


def test_engine_stop_gives_503s_and_degraded_health_while_http_works_and_its_return_needs_no_restart(
    engine: PrivateEngine, docker_client: docker.DockerClient, tmp_path: Path, upstream: str
) -> None:
    engine.load_image(docker_client, image_tag())
    env = {
        "DOCKER_HOST": engine.url,
        "ALLOW_HTTP_HOSTS": '["127.0.0.1"]',
        "METAAGENT_ALLOW_PRIVATE_NETWORKS": "true",
        "METAAGENT_LANGUAGES": "javascript",  # the private engine holds JavaScript's image only
    }
    with serving(tmp_path, **env) as (base, _process):
        wait_for(lambda: bool(checks(base)["sandbox_image"]["ok"]), "the image check")
        before = httpx2.post(f"{base}{RUN}", json=HELLO, timeout=CLIENT_TIMEOUT_S)
        assert before.status_code == 200, before.text
        assert before.json()["stdout"] == "hello 42\n"
        errors_before = engine_errors(base)

        engine.stop()
        down = httpx2.post(f"{base}{RUN}", json=HELLO, timeout=CLIENT_TIMEOUT_S)
        assert down.status_code == 503
        assert down.json()["error"].startswith("The container engine is unavailable")
        report = health(base)
        assert report["status"] == "degraded"
        assert checks(base)["container_engine"]["ok"] is False
        assert "container engine" in str(checks(base)["container_engine"]["error"])
        tool = httpx2.post(f"{base}/tools/http", json={"url": f"{upstream}/"}, timeout=CLIENT_TIMEOUT_S)
        assert tool.status_code == 200
        assert tool.json()["body"] == "hello from upstream"
        assert engine_errors(base) > errors_before

        engine.start()
        after = httpx2.post(f"{base}{RUN}", json=HELLO, timeout=CLIENT_TIMEOUT_S)
        assert after.status_code == 200, after.text
        assert after.json()["stdout"] == "hello 42\n"
        assert health(base)["status"] == "ok"
    # The service's last step removes what it made and waits for the engine to confirm it, so nothing is left.
    assert engine.containers() == []


@contextlib.contextmanager
def full_tmpfs(path: Path) -> Iterator[None]:
    """A file system with no room left: its one spare inode is taken by a filler file."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=2", "tmpfs", str(path)], check=True)
    try:
        (path / "filler").write_bytes(b"")
        with pytest.raises(OSError, match="No space left on device") as caught:
            (path / "probe").write_bytes(b"")
        assert caught.value.errno == errno.ENOSPC  # so the build cannot get as far as debootstrap
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_while_building_the_image_is_reported_by_health_and_executions(
    engine: PrivateEngine, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    env = {
        "DOCKER_HOST": engine.url,  # an engine without the image: the service builds it at start
        "METAAGENT_SANDBOX_BUILD_ON_START": "true",
        "METAAGENT_SANDBOX_CACHE_DIR": str(cache),
    }
    with full_tmpfs(cache), serving(tmp_path, **env) as (base, _process):
        wait_for(lambda: "error" in checks(base)["sandbox_image"], "the build failure")
        image = checks(base)["sandbox_image"]
        assert image["ok"] is False
        assert image["building"] is False
        assert "The sandbox image could not be built" in str(image["error"])
        assert "No space left on device" in str(image["error"])
        assert health(base)["status"] == "degraded"
        response = httpx2.post(f"{base}{RUN}", json=HELLO, timeout=CLIENT_TIMEOUT_S)
        assert response.status_code == 503
        assert response.json()["error"] == image["error"]


def test_a_service_killed_mid_execution_leaves_a_container_that_the_next_start_removes(
    docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    body = {"code": "console.log('running'); setInterval(() => {}, 1000)", "timeout_s": 120}
    with serving(tmp_path) as (base, process):

        def execute() -> None:
            with contextlib.suppress(httpx2.TransportError):  # the service dies under this request
                httpx2.post(f"{base}{RUN}", json=body, timeout=CLIENT_TIMEOUT_S)

        request = threading.Thread(target=execute, daemon=True)
        try:
            request.start()

            executing: list[str] = []

            def running() -> bool:
                listed = httpx2.get(f"{base}/executions", timeout=CLIENT_TIMEOUT_S).json()["executions"]
                executing.extend(e["container_id"] for e in listed if e["state"] == "running")
                return bool(executing)

            wait_for(running, "the execution's start")
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            left = owned_containers(docker_client, process.pid)  # the execution's, and the warm pool's
            assert executing[0] in left  # the dead service could not remove it
            assert docker_client.containers.get(executing[0]).status == "running"
        finally:
            request.join(timeout=CLIENT_TIMEOUT_S)
    try:
        with serving(tmp_path) as (_base, _next):
            wait_for(lambda: not owned_containers(docker_client, process.pid), "the orphan's removal", timeout_s=60)
    finally:
        for leftover in owned_containers(docker_client, process.pid):
            with contextlib.suppress(docker.errors.NotFound):
                docker_client.api.remove_container(leftover, force=True)
