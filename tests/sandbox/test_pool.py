"""The warm pool's correctness (not its speed, which bench/ measures): single use, limits, queue, refill."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import docker
import docker.errors
import pytest
from prometheus_client import REGISTRY

from metaagent.sandbox.engine import ContainerSpec, Engine
from metaagent.sandbox.pool import WarmPool
from metaagent.sandbox.provision import SandboxImage
from metaagent.sandbox.runtime import Runtime
from metaagent.tools.code_interpreter import container_spec
from tests.sandbox.conftest import (
    Service,
    audit_record,
    code_runner,
    owned_containers,
    running_service,
    wait_for_warm_containers,
)

pytestmark = pytest.mark.docker

SLOW_PRINT = "setTimeout(() => console.log('ok'), 1500)"


def test_each_warm_container_serves_one_execution_and_is_gone_afterwards(
    sandbox_service: Service, docker_client: docker.DockerClient
) -> None:
    run = code_runner(sandbox_service, "warm")  # asserts that each execution took a warm container
    results = [run("console.log(1)") for _ in range(5)]
    containers = [audit_record(sandbox_service, r.execution_id)["container_id"] for r in results]
    assert len(set(containers)) == len(containers)
    for container_id in containers:
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(container_id)


def test_a_warm_execution_gets_its_whole_timeout_however_long_the_container_waited(sandbox_service: Service) -> None:
    wait_for_warm_containers(sandbox_service)
    time.sleep(3)  # the ready containers have now waited longer than the whole timeout below
    result = code_runner(sandbox_service, "warm")("setTimeout(() => console.log('in time'), 500)", timeout_s=2)
    assert result.timed_out is False
    assert result.stdout == "in time\n"


@pytest.mark.security
def test_a_warm_container_has_the_cold_ones_security_context(sandbox_service: Service, cold_service: Service) -> None:
    warm = code_runner(sandbox_service, "warm")("console.log(1)")
    cold = code_runner(cold_service, "cold")("console.log(1)")
    warm_record, cold_record = (
        audit_record(sandbox_service, warm.execution_id),
        audit_record(cold_service, cold.execution_id),
    )
    assert warm_record["security"] == cold_record["security"]
    assert warm_record["limits"] == cold_record["limits"]


def test_the_queue_answers_429_when_full_and_serves_everything_it_accepted(tmp_path: Path) -> None:
    settings = {"METAAGENT_MAX_CONCURRENT_EXECUTIONS": "1", "METAAGENT_EXECUTION_QUEUE_SIZE": "2"}
    with running_service(tmp_path, **settings) as service, ThreadPoolExecutor(6) as threads:
        body = {"code": SLOW_PRINT, "timeout_s": 3}
        responses = list(threads.map(lambda _: service.post("/tools/code-interpreter", body), range(6)))
    served = [r.json() for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(served) == 3  # one running, two queued
    assert len(refused) == 3
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"].startswith("At capacity")
    for body in served:
        assert body["stdout"] == "ok\n", body
        # The last one waited two 1.5 s runs in the queue: had that counted against timeout_s, it timed out.
        assert body["timed_out"] is False
    assert sorted(b["queued_ms"] for b in served)[1:] >= [1000, 1000]  # the queued two waited for a 1.5 s run


def test_the_pool_refills_after_a_burst_and_is_emptied_at_shutdown(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    with running_service(tmp_path, METAAGENT_POOL_SIZE="2") as service:
        wait_for_warm_containers(service, 2)
        with ThreadPoolExecutor(4) as threads:
            body = {"code": "console.log('burst')", "timeout_s": 5}
            responses = list(threads.map(lambda _: service.post("/tools/code-interpreter", body), range(4)))
        assert [r.status_code for r in responses] == [200] * 4
        paths = [audit_record(service, r.json()["execution_id"])["container_path"] for r in responses]
        assert paths.count("warm") >= 2  # the two that were ready were used
        pool = wait_for_warm_containers(service, 2)
        assert pool["size"] == 2
        assert "metaagent_pool_containers 2.0" in service.get("/metrics").text
        assert pool["served"] == paths.count("warm")
        assert len(owned_containers(docker_client, service.pid)) == 2  # just the refilled pool: nothing left over

        service.process.send_signal(signal.SIGTERM)
        assert service.process.wait(timeout=60) == 0
        assert owned_containers(docker_client, service.pid) == []


def test_no_pool_when_it_is_off(tmp_path: Path, docker_client: docker.DockerClient) -> None:
    with running_service(tmp_path, METAAGENT_POOL_ENABLED="false") as service:
        result = code_runner(service, "cold")("console.log('cold')")
        pool = service.get("/health").json()["checks"]["warm_pool"]
        assert result.stdout == "cold\n"
        assert pool == {"ok": True, "ready": 0, "size": 0, "served": 0}
        assert owned_containers(docker_client, service.pid) == []


def _start_retries() -> float:
    return REGISTRY.get_sample_value("metaagent_pool_start_retries_total") or 0.0


def test_a_warm_container_whose_runner_dies_at_start_is_counted_and_another_started(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    """A crash at start (here node aborting before the runner's ready line, as V8 can at start-up) is
    retried in the pool, before any code exists: never lent to an execution, counted in /metrics."""
    crash = ["/usr/bin/node", "-e", "process.abort()"]

    async def go() -> tuple[float, int, bool]:
        engine = Engine()
        image = SandboxImage(engine, tag=None, cache_dir=tmp_path)

        async def crashing(execution_id: str, tag: str) -> ContainerSpec:
            return container_spec(execution_id, tag, 128, 0.5, command=crash, runtime=sandbox_runtime)

        pool = WarmPool(engine, image, size=1, memory_mb=128, make_spec=crashing)
        before = _start_retries()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):  # a bound: two starts on a loaded machine
                    while _start_retries() < before + 2:  # noqa: ASYNC110 - a Prometheus counter has no event to wait on
                        await anyio.sleep(0.05)
                lent = pool.take(image.tag) is not None
                pool.close()
            return _start_retries() - before, pool.ready, lent
        finally:
            engine.close()

    retries, ready, lent = anyio.run(go)
    assert retries >= 2  # the pool went on starting containers after the first crash
    assert (ready, lent) == (0, False)
    assert owned_containers(docker_client, os.getpid()) == []  # no crashed container left behind


def test_a_warm_runner_that_dies_while_it_waits_is_never_lent_and_its_end_is_logged(
    sandbox_runtime: Runtime, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Ready, then dead before any code comes: the pool must notice at the take and say how it ended.
    program = "process.stderr.write('metaagent-runner: ready\\n'); console.error('bye'); process.exit(7)"
    dies = ["/usr/bin/node", "-e", program]

    async def go() -> tuple[bool, float]:
        engine = Engine()
        image = SandboxImage(engine, tag=None, cache_dir=tmp_path)

        async def dying(execution_id: str, tag: str) -> ContainerSpec:
            return container_spec(execution_id, tag, 128, 0.5, command=dies, runtime=sandbox_runtime)

        pool = WarmPool(engine, image, size=1, memory_mb=128, make_spec=dying)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):  # a bound: one start on a loaded machine
                    while pool.ready < 1:  # noqa: ASYNC110 - the pool has no event for this
                        await anyio.sleep(0.05)
                    await anyio.sleep(1)  # the runner has exited by now
                    before = _start_retries()
                    lent = pool.take(image.tag) is not None
                    while "ended while it waited" not in caplog.text:  # noqa: ASYNC110 - a log line
                        await anyio.sleep(0.05)
                pool.close()
            return lent, _start_retries() - before
        finally:
            engine.close()

    with caplog.at_level("WARNING", logger="metaagent.pool"):
        lent, counted = anyio.run(go)
    assert (lent, counted) == (False, 1)
    line = next(r.getMessage() for r in caplog.records if "ended while it waited" in r.getMessage())
    assert "exit 7" in line
    assert "bye" in line


def _runner_pool(engine: Engine, tmp_path: Path, runtime: Runtime) -> WarmPool:
    image = SandboxImage(engine, tag=None, cache_dir=tmp_path)

    async def spec(execution_id: str, tag: str) -> ContainerSpec:
        return container_spec(execution_id, tag, 128, 0.5, runtime=runtime)

    return WarmPool(engine, image, size=1, memory_mb=128, make_spec=spec)


@pytest.mark.usefixtures("sandbox_service")  # only so that the image is there
def test_an_execution_that_finds_the_pool_empty_takes_the_container_starting_for_it(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    async def go() -> tuple[str, str | None, int]:
        engine = Engine()
        pool = _runner_pool(engine, tmp_path, sandbox_runtime)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):  # a bound: starts on a loaded machine
                    while pool.ready < 1:  # noqa: ASYNC110 - the pool has no event for this
                        await anyio.sleep(0.05)
                tag = pool.image.tag
                assert tag is not None
                first = pool.take(tag)
                assert first is not None
                pool.finished()  # the first execution ended: its replacement starts now
                while pool._starting < 1:  # noqa: ASYNC110 - the pool's loop begins that start
                    await anyio.sleep(0.01)
                assert pool.ready == 0
                second = await pool.take_or_wait(tag)  # the pool is empty: this waits for that start
                served = pool.served
                for warm in (first, second):
                    if warm is not None:
                        warm.prepared.sock.close()
                        await engine.remove(warm.prepared.container_id)
                pool.close()
            return first.execution_id, second.execution_id if second else None, served
        finally:
            engine.close()

    first, second, served = anyio.run(go)
    assert second is not None  # not the cold path
    assert second != first  # a fresh container, never the same one twice
    assert served == 2
    assert owned_containers(docker_client, os.getpid()) == []


@pytest.mark.usefixtures("sandbox_service")
def test_a_pool_that_closes_sends_its_waiting_executions_to_the_cold_path(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    async def go() -> tuple[bool, int]:
        engine = Engine()
        pool = _runner_pool(engine, tmp_path, sandbox_runtime)
        result: list[bool] = []
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):
                    while pool._starting < 1:  # noqa: ASYNC110 - the first start is in flight
                        await anyio.sleep(0.01)

                    async def wait() -> None:
                        result.append(await pool.take_or_wait(await pool.image.require()) is None)

                    group.start_soon(wait)
                    while not pool._takers:  # noqa: ASYNC110 - the execution waits now
                        await anyio.sleep(0.01)
                    pool.close()
            return result[0], pool.served
        finally:
            engine.close()

    went_cold, served = anyio.run(go)
    assert (went_cold, served) == (True, 0)
    assert owned_containers(docker_client, os.getpid()) == []
