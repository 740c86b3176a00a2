"""A real service process with a real container engine, shared by the sandbox tests of one worker."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx2
import pytest

from metaagent.sandbox.cgroups import mounted_hierarchy
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime
from tests.sandbox import private_engine
from tests.test_cli import METAAGENT, clean_env, free_port

HOST_SECRET = "sk-host-secret-that-must-never-reach-a-sandbox"
# The isolation runtime of the services these tests start: unset, the service's default (auto). CI runs
# the whole suite so, then the hostile and benign programs again with the other runtime (scripts/test).
RUNTIME_UNDER_TEST = os.environ.get("METAAGENT_TEST_SANDBOX_RUNTIME")


@dataclass(frozen=True)
class Service:
    base_url: str
    audit_log: Path
    stderr_path: Path
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx2.Response:
        return httpx2.post(f"{self.base_url}{path}", json=body, timeout=timeout)

    def get(self, path: str) -> httpx2.Response:
        return httpx2.get(f"{self.base_url}{path}", timeout=30)


@pytest.fixture(scope="session", autouse=True)
def image_exports_in_the_runs_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The private engines' image exports go to this run's temporary directory, which every worker of the
    run shares (each worker's own is one level down) and pytest prunes after a few runs."""
    base = tmp_path_factory.getbasetemp()
    private_engine.IMAGE_EXPORTS = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.skip(f"no Docker engine answers ({exc}): run scripts/ensure-docker")
    yield client
    client.close()


@contextmanager
def running_service(workdir: Path, port: int | None = None, **env: str) -> Iterator[Service]:
    """`metaagent serve` on `port` (a free one if None), once the sandbox image is ready (built by
    `scripts/test` before)."""
    port = port or free_port()
    stderr_path = workdir / "service.log"
    defaults = {
        "METAAGENT_SANDBOX_BUILD_ON_START": "true",
        # These services test the JavaScript sandbox: a Python lane would build its image (minutes) at each
        # start, and its containers cannot run before Python's runner exists. A test that wants it says so.
        "METAAGENT_LANGUAGES": "javascript",
        "ALLOW_HTTP_HOSTS": '["127.0.0.1"]',
        "OPENAI_API_KEY": HOST_SECRET,
        "SERPER_API_KEY": HOST_SECRET,
        "METAAGENT_TEST_SECRET": HOST_SECRET,
        **({"METAAGENT_SANDBOX_RUNTIME": RUNTIME_UNDER_TEST} if RUNTIME_UNDER_TEST else {}),
    }
    environment = clean_env(workdir, **{**defaults, **env})
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [*METAAGENT, "serve", "--port", str(port)], cwd=workdir, env=environment, stderr=stderr
        )
    service = Service(f"http://127.0.0.1:{port}", workdir / "audit.jsonl", stderr_path, process)
    # With API keys, /health shows its checks only to a caller with a key: the first one configured.
    first_key = environment.get("METAAGENT_API_KEYS", "").split(",")[0].split(":")
    key = first_key[1] if len(first_key) > 1 else first_key[0]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "the sandbox image was not ready within 300 s"
            try:
                # No checks while it is starting (503 {"status": "starting"}).
                checks = httpx2.get(f"{service.base_url}/health", headers=headers, timeout=30).json().get("checks")
                # Ready once the image is there and the runtime chosen (auto's self-test has run).
                if checks and checks["sandbox_image"]["ok"] and checks["container_engine"]["runtime"]:
                    break
            except httpx2.TransportError:
                pass
            time.sleep(0.2)
        yield service
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)


@pytest.fixture(scope="session")
def sandbox_service(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    """The service as it ships: warm pool on."""
    with running_service(tmp_path_factory.mktemp("service")) as service:
        yield service


@pytest.fixture(scope="session")
def cold_service(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    """The service with the warm pool off: every execution creates its container on the request path."""
    with running_service(tmp_path_factory.mktemp("cold-service"), METAAGENT_POOL_ENABLED="false") as service:
        yield service


@pytest.fixture(scope="session")
def python_service(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    """The service as it ships with both languages (the other test services serve JavaScript only),
    once Python's image is ready too."""
    with running_service(tmp_path_factory.mktemp("python-service"), METAAGENT_LANGUAGES="javascript,python") as service:
        deadline = time.monotonic() + 300
        while not service.get("/health").json()["checks"]["sandbox_image"]["languages"]["python"]["ok"]:
            assert time.monotonic() < deadline, "the Python sandbox image was not ready within 300 s"
            time.sleep(0.2)
        yield service


def runtime_of(service: Service) -> Runtime:
    """The isolation runtime in force in a running service, as its /health names it."""
    name = service.get("/health").json()["checks"]["container_engine"]["runtime"]
    return {RUNC.name: RUNC, RUNSC.name: RUNSC}[name]


@pytest.fixture(scope="session")
def sandbox_runtime(sandbox_service: Service) -> Runtime:
    """The runtime the sandbox tests run under: the one the shipped service chose."""
    return runtime_of(sandbox_service)


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

    @property
    def execution_id(self) -> str:
        return str(self.body.get("execution_id"))


RunJs = Callable[..., Result]


def audit_records(service: Service) -> list[dict[str, Any]]:
    """Every record of the service's audit log, oldest first."""
    return [json.loads(line) for line in service.audit_log.read_text().splitlines()]


def audit_record(service: Service, execution_id: str) -> dict[str, Any]:
    """The audit record of one execution (written last of its records, before its response is sent)."""
    record = audited(service, execution_id)
    if record is None:
        raise AssertionError(f"no audit record for {execution_id}")
    return record


def audited(service: Service, execution_id: str) -> dict[str, Any] | None:
    """The audit record of one execution, None while it has none."""
    return next((r for r in reversed(audit_records(service)) if r.get("execution_id") == execution_id), None)


def wait_for_warm_containers(service: Service, count: int = 1) -> dict[str, Any]:
    """Waits until the service's pool holds `count` ready containers; returns the pool's health check."""
    deadline = time.monotonic() + 60
    while True:
        pool: dict[str, Any] = service.get("/health").json()["checks"]["warm_pool"]
        if pool["ready"] >= count:
            return pool
        assert time.monotonic() < deadline, f"the warm pool did not fill: {pool}"
        time.sleep(0.02)


def metric_value(service: Service, name: str) -> float:
    """A metric's value in the service's /metrics (0 when it is not there yet): `name` is the series as
    exposed, its labels included (`name{language="python"}`)."""
    for line in service.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def pool_start_retries(service: Service, language: str = "javascript") -> float:
    """The service's count of `language`'s warm runners that died before any code was handed over."""
    return metric_value(service, f'metaagent_pool_start_retries_total{{language="{language}"}}')


def code_runner(service: Service, path: str | None = None) -> RunJs:
    """Runs code through `POST /tools/code-interpreter`; with `path`, on a warm or cold container for sure."""

    def run(code: str, *, stdin: str | None = None, timeout_s: int = 5, **fields: Any) -> Result:
        body: dict[str, Any] = {"code": code, "timeout_s": timeout_s, **fields}
        if stdin is not None:
            body["stdin"] = stdin
        language = fields.get("language", "javascript")
        for _attempt in range(3):
            if path == "warm":
                wait_for_warm_containers(service)
            retries = pool_start_retries(service, language)
            response = service.post("/tools/code-interpreter", body)
            result = Result(response.status_code, response.json())
            if path is None or response.status_code != 200:
                return result
            taken = audit_record(service, result.execution_id)["container_path"]
            # A warm runner that died while it waited is replaced by a cold start, and counted: only
            # then is a cold execution no failure of the warm path (the test runs again).
            if taken == path or not (path == "warm" and pool_start_retries(service, language) > retries):
                break
        assert taken == path
        return result

    return run


@pytest.fixture
def run_js(sandbox_service: Service) -> RunJs:
    """Runs code through the real service as it ships (a warm container when one is ready)."""
    return code_runner(sandbox_service)


@pytest.fixture(params=["warm", "cold"])
def run_js_both(request: pytest.FixtureRequest) -> RunJs:
    """Runs code on a warm container of the pool, then (second parameter) on a cold one: both must hold."""
    if request.param == "warm":
        return code_runner(request.getfixturevalue("sandbox_service"), "warm")
    return code_runner(request.getfixturevalue("cold_service"), "cold")


@pytest.fixture
def containers_of(docker_client: docker.DockerClient) -> Callable[[str], list[str]]:
    """The ids of the containers, running or not, that belong to one execution."""
    return lambda execution_id: labelled_containers(docker_client, f"org.metaagent.execution={execution_id}")


def labelled_containers(client: docker.DockerClient, label: str) -> list[str]:
    """The ids of the containers, running or not, with `label` (`key=value`). Sparse: a container that
    goes between the listing and an inspect (a warm one, say) does not fail the listing."""
    return [c.id for c in client.containers.list(all=True, sparse=True, filters={"label": label})]


def owned_containers(client: docker.DockerClient, pid: int) -> list[str]:
    """The containers of the service process `pid`: its executions' and its warm pool's."""
    return labelled_containers(client, f"org.metaagent.owner-pid={pid}")


# --- sessions ---


class Sessions:
    """A caller of one service's session routes."""

    def __init__(self, service: Service, key: str | None = None) -> None:
        self.service = service
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def request(self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx2.Response:
        headers = {**self.headers, **(headers or {})}
        return httpx2.request(method, f"{self.service.base_url}{path}", headers=headers, timeout=120, **kwargs)

    def create(self, **body: Any) -> str:
        response = self.request("POST", "/sessions", json=body or None)
        assert response.status_code == 201, response.text
        session_id: str = response.json()["session_id"]
        return session_id

    def run(self, session_id: str, code: str, timeout_s: int = 5) -> dict[str, Any]:
        response = self.request("POST", f"/sessions/{session_id}/execute", json={"code": code, "timeout_s": timeout_s})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def close(self, session_id: str) -> httpx2.Response:
        return self.request("DELETE", f"/sessions/{session_id}")

    def running_call(self, session_id: str) -> str:
        """The execution id of the session's running call, once `GET /executions` lists it."""
        for _ in range(200):
            running = self.request("GET", "/executions").json()["executions"]
            execution = next((e for e in running if e.get("session_id") == session_id), None)
            if execution:
                return str(execution["execution_id"])
            time.sleep(0.05)
        raise AssertionError(f"no running call of session {session_id} was listed")


@pytest.fixture
def sessions(sandbox_service: Service) -> Iterator[Sessions]:
    client = Sessions(sandbox_service)
    yield client
    for record in client.request("GET", "/sessions").json()["sessions"]:
        client.close(record["session_id"])


@pytest.fixture
def python_sessions(python_service: Service) -> Iterator[Sessions]:
    client = Sessions(python_service)
    yield client
    for record in client.request("GET", "/sessions").json()["sessions"]:
        client.close(record["session_id"])


def health_latencies(base_url: str, count: int) -> list[float]:
    """The latencies of `count` GET /health requests in a row, over one connection."""
    latencies = []
    with httpx2.Client(base_url=base_url, timeout=60) as client:
        for _ in range(count):
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
    return latencies


class HealthProber:
    """Times /health from another thread until stopped."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.latencies.extend(health_latencies(self.base_url, 5))

    def stop(self) -> list[float]:
        self._done.set()
        self._thread.join()
        return self.latencies


@contextmanager
def private_cgroup_branch(controller: str) -> Iterator[Path]:
    """A private branch of the host's cgroup v1 hierarchy of `controller`, laid out as Docker's
    (<branch>/docker/<id>), removed afterwards with whatever the test made in it."""
    mounted = mounted_hierarchy(controller)
    if mounted is None:
        pytest.skip(f"this host has no cgroup v1 {controller} hierarchy (see sandbox/cgroups.py)")
    branch = mounted / f"metaagent-test-{secrets.token_hex(6)}"
    (branch / "docker").mkdir(parents=True)
    try:
        yield branch
    finally:
        for cgroup in sorted(branch.rglob("*"), key=lambda path: len(path.parts), reverse=True):
            if cgroup.is_dir():
                cgroup.rmdir()
        branch.rmdir()
