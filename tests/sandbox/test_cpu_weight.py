"""A container's CPU weight: low while its runner loads, a running execution's before any user code runs.

Read from the engine (and from the cgroup the engine made, where this host's layout shows it) while the
code runs: what the engine enforces, not what the service meant to ask for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import docker
import httpx2
import pytest

from metaagent.executions import new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import image_tag
from metaagent.sandbox.engine import RUNNING_CPU_SHARES, STARTING_CPU_SHARES, Engine
from metaagent.sandbox.execute import prepare
from metaagent.sandbox.runtime import RUNC, RUNSC, registration_problem
from metaagent.tools.code_interpreter import DEFAULT_MEMORY_MB
from tests.sandbox.conftest import Service, audit_record, running_service, wait_for_warm_containers
from tests.sandbox.test_runtime import engine_runtimes

pytestmark = pytest.mark.docker

CPUS = 0.5
PERIOD_US = 100_000
# Says it runs, then keeps running long enough to be looked at (the stream shows when it has started).
RUNNING_CODE = "console.log('running'); setTimeout(() => console.log('done'), 1500)"


def cpu_limits(client: docker.DockerClient, container_id: str) -> tuple[int, int]:
    """(cpu.shares, CPU quota in µs per 100 ms) as the engine holds them, checked against the cgroup."""
    host_config = client.api.inspect_container(container_id)["HostConfig"]
    shares, quota = int(host_config["CpuShares"]), int(host_config["CpuQuota"])
    for controller in ("cpu,cpuacct", "cpu"):  # cgroup v1 with the cgroupfs driver, as scripts/ensure-docker runs it
        cgroup = Path("/sys/fs/cgroup") / controller / "docker" / container_id
        if cgroup.is_dir():
            assert int((cgroup / "cpu.shares").read_text()) == shares
            assert int((cgroup / "cpu.cfs_quota_us").read_text()) == quota
            break
    return shares, quota


def test_a_starting_container_has_a_low_cpu_weight_and_every_cpu(docker_client: docker.DockerClient) -> None:
    spec = container_spec(new_execution_id(), image_tag(), DEFAULT_MEMORY_MB, CPUS, runtime=RUNC)
    assert spec.start_cpus is not None

    async def created() -> tuple[int, int]:
        engine = Engine()
        try:
            prepared = await prepare(engine, spec, start=True)
            try:
                return cpu_limits(docker_client, prepared.container_id)
            finally:
                prepared.sock.close()
                await engine.remove(prepared.container_id)
        finally:
            engine.close()

    assert anyio.run(created) == (STARTING_CPU_SHARES, int(spec.start_cpus * PERIOD_US))


def limits_while_the_code_runs(service: Service, client: docker.DockerClient, path: str) -> tuple[int, int]:
    """The CPU limits of the container running RUNNING_CODE, read once the program has printed; the
    execution must have taken `path` (warm or cold), as its audit record says."""
    body: dict[str, Any] = {"code": RUNNING_CODE, "timeout_s": 10}
    url = f"{service.base_url}/tools/code-interpreter"
    with httpx2.stream("POST", url, json=body, headers={"Accept": "text/event-stream"}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        events: Iterator[httpx2.ServerSentEvent] = iter(httpx2.EventSource(response))
        first = next(events)
        assert (first.event, first.json()["text"]) == ("stdout", "running\n")
        executions = service.get("/executions").json()["executions"]
        assert len(executions) == 1, executions
        limits = cpu_limits(client, executions[0]["container_id"])
        rest = list(events)
    assert rest[-1].event == "result"
    assert rest[-1].json()["stdout"] == "running\ndone\n"
    assert audit_record(service, rest[-1].json()["execution_id"])["container_path"] == path
    return limits


@pytest.mark.parametrize("pool", ["warm", "cold"])
def test_under_runc_the_weight_and_share_of_a_running_execution_are_set_before_its_code_runs(
    pool: str, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    settings = {"METAAGENT_SANDBOX_RUNTIME": "runc", "METAAGENT_POOL_ENABLED": str(pool == "warm").lower()}
    with running_service(tmp_path, **settings) as service:
        if pool == "warm":
            wait_for_warm_containers(service)
        limits = limits_while_the_code_runs(service, docker_client, pool)
        assert limits == (RUNNING_CPU_SHARES, int(CPUS * PERIOD_US))


def test_under_runsc_an_execution_has_a_running_executions_weight_and_share_from_its_start(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    assert registration_problem(engine_runtimes(docker_client)) is None, "run scripts/ensure-docker (CI does)"
    # runsc cannot change a running container's limits, so they are final at create.
    spec = container_spec(new_execution_id(), image_tag(), DEFAULT_MEMORY_MB, CPUS, runtime=RUNSC)
    assert (spec.start_cpus, spec.start_cpu_shares) == (None, None)
    with running_service(tmp_path, METAAGENT_SANDBOX_RUNTIME="runsc", METAAGENT_POOL_ENABLED="false") as service:
        limits = limits_while_the_code_runs(service, docker_client, "cold")
        assert limits == (RUNNING_CPU_SHARES, int(CPUS * PERIOD_US))
