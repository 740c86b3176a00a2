"""A real service process with a real container engine, shared by the sandbox tests of one worker."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx2
import pytest

from tests.test_cli import METAAGENT, clean_env, free_port

HOST_SECRET = "sk-host-secret-that-must-never-reach-a-sandbox"


@dataclass(frozen=True)
class Service:
    base_url: str
    audit_log: Path
    stderr_path: Path
    pid: int

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx2.Response:
        return httpx2.post(f"{self.base_url}{path}", json=body, timeout=timeout)

    def get(self, path: str) -> httpx2.Response:
        return httpx2.get(f"{self.base_url}{path}", timeout=30)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.skip(f"no Docker engine answers ({exc}): run scripts/ensure-docker")
    yield client
    client.close()


@pytest.fixture(scope="session")
def sandbox_service(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    """`metaagent serve` on a free port, with the sandbox image built (or built by `scripts/test` before)."""
    with running_service(tmp_path_factory.mktemp("service"), ALLOW_HTTP_HOSTS='["127.0.0.1"]') as service:
        yield service


@contextmanager
def running_service(workdir: Path, **env_overrides: str) -> Iterator[Service]:
    """A service process in `workdir` with host secrets in its environment, once its sandbox image is ready."""
    port = free_port()
    stderr_path = workdir / "service.log"
    env = clean_env(
        workdir,
        METAAGENT_SANDBOX_BUILD_ON_START="true",
        OPENAI_API_KEY=HOST_SECRET,
        SERPER_API_KEY=HOST_SECRET,
        METAAGENT_TEST_SECRET=HOST_SECRET,
        **env_overrides,
    )
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen([*METAAGENT, "serve", "--port", str(port)], cwd=workdir, env=env, stderr=stderr)
    service = Service(f"http://127.0.0.1:{port}", workdir / "audit.jsonl", stderr_path, process.pid)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "the sandbox image was not ready within 300 s"
            try:
                health = service.get("/health").json()
                if health["checks"]["sandbox_image"]["ok"]:
                    break
            except httpx2.TransportError:
                pass
            time.sleep(0.2)
        yield service
    finally:
        process.terminate()
        process.wait(timeout=60)


@dataclass(frozen=True)
class Result:
    status: int
    body: dict[str, Any]

    @property
    def exit_code(self) -> int | None:
        return self.body.get("exit_code")

    @property
    def stdout(self) -> str:
        return str(self.body.get("stdout", ""))

    @property
    def stderr(self) -> str:
        return str(self.body.get("stderr", ""))

    @property
    def timed_out(self) -> bool:
        return bool(self.body.get("timed_out"))


RunJs = Callable[..., Result]


@pytest.fixture
def run_js(sandbox_service: Service) -> RunJs:
    """Runs code through `POST /tools/code-interpreter` of the real service."""

    def run(code: str, *, stdin: str | None = None, timeout_s: int = 5, **fields: Any) -> Result:
        body: dict[str, Any] = {"code": code, "timeout_s": timeout_s, **fields}
        if stdin is not None:
            body["stdin"] = stdin
        response = sandbox_service.post("/tools/code-interpreter", body)
        return Result(response.status_code, response.json())

    return run


@pytest.fixture
def containers_of(docker_client: docker.DockerClient) -> Callable[[str], list[str]]:
    """The ids of the containers, running or not, that belong to one execution."""

    def listing(execution_id: str) -> list[str]:
        found = docker_client.containers.list(all=True, filters={"label": f"org.metaagent.execution={execution_id}"})
        return [c.id for c in found]

    return listing
