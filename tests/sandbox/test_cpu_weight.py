"""A container's CPU weight: low while its runner loads, a running execution's before any user code runs.

Read from the container's cgroup while the code runs: what the kernel enforces, not what the service meant
to ask for, nor the engine's record (which keeps the values of the create: the service sets a running
container's limits in its cgroup, see `metaagent.sandbox.cgroups.CpuControl`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import docker
import httpx2
import pytest

from metaagent.errors import Unavailable
from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import image_tag
from metaagent.sandbox.cgroups import MISSES_BEFORE_OFF, CpuControl, container_cgroup, mounted_hierarchy
from metaagent.sandbox.engine import RUNNING_CPU_SHARES, STARTING_CPU_SHARES, Engine
from metaagent.sandbox.execute import execute, payload, prepare
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime, registration_problem
from metaagent.tools.code_interpreter import DEFAULT_MEMORY_MB
from tests.sandbox.conftest import (
    Service,
    audit_record,
    private_cgroup_branch,
    running_service,
    wait_for_warm_containers,
)
from tests.sandbox.test_runtime import engine_runtimes

pytestmark = pytest.mark.docker

CPUS = 0.5
PERIOD_US = 100_000
# Says it runs, then spins on the CPU long enough to be looked at (the stream shows when it has started).
RUNNING_CODE = "console.log('running'); const end = Date.now() + 2500; while (Date.now() < end); console.log('done')"
# How long the CPU the spinning code uses is watched. It may use the quota over that time, and one CFS period's
# quota more at each end of the window (the kernel enforces the quota per 100 ms period).
WATCH_S = 1.0
RUNTIMES = {"runc": RUNC, "runsc": RUNSC}


def cpu_hierarchy() -> Path:
    hierarchy = mounted_hierarchy("cpu")
    assert hierarchy is not None, "a cgroup v1 cpu hierarchy, as scripts/ensure-docker runs the engine"
    return hierarchy


def cpu_limits(container_id: str) -> tuple[int, int]:
    """(cpu.shares, CPU quota in µs per 100 ms) of the container, as its cgroup holds them."""
    cgroup = container_cgroup(cpu_hierarchy(), container_id)
    assert cgroup is not None, f"container {container_id[:12]} has no cgroup where Docker puts one"
    assert int((cgroup / "cpu.cfs_period_us").read_text()) == PERIOD_US
    return int((cgroup / "cpu.shares").read_text()), int((cgroup / "cpu.cfs_quota_us").read_text())


def usable(runtime: Runtime, client: docker.DockerClient) -> Runtime:
    if runtime is RUNSC:
        assert registration_problem(engine_runtimes(client)) is None, "run scripts/ensure-docker (CI does)"
    return runtime


@pytest.mark.parametrize("runtime_name", RUNTIMES)
def test_a_starting_container_has_a_low_cpu_weight_and_every_cpu_and_then_its_executions_limits(
    runtime_name: str, docker_client: docker.DockerClient
) -> None:
    """Under runsc too, whose engine cannot update a running container: the service sets its cgroup."""
    runtime = usable(RUNTIMES[runtime_name], docker_client)

    async def starting_then_limited() -> tuple[tuple[int, int], tuple[int, int]]:
        engine = Engine()
        try:
            assert engine.cpu_control.available, engine.cpu_control.failure
            spec = container_spec(
                new_execution_id(), image_tag(), DEFAULT_MEMORY_MB, CPUS, runtime=runtime, cpu_control=True
            )
            assert spec.start_cpus is not None
            prepared = await prepare(engine, spec, start=True)
            try:
                starting = cpu_limits(prepared.container_id)
                await prepared.limit_cpus(engine)
                return starting, cpu_limits(prepared.container_id)
            finally:
                prepared.sock.close()
                await engine.remove(prepared.container_id)
        finally:
            engine.close()

    starting, limited = anyio.run(starting_then_limited)
    assert starting == (STARTING_CPU_SHARES, (os.cpu_count() or 1) * PERIOD_US)
    assert limited == (RUNNING_CPU_SHARES, int(CPUS * PERIOD_US))


def test_without_cpu_control_a_runsc_container_has_its_executions_limits_from_its_create() -> None:
    spec = container_spec(new_execution_id(), image_tag(), DEFAULT_MEMORY_MB, CPUS, runtime=RUNSC)
    assert (spec.start_cpus, spec.start_cpu_shares) == (None, None)


@pytest.fixture
def cpu_branch() -> Iterator[Path]:
    with private_cgroup_branch("cpu") as branch:
        yield branch


def test_cpu_control_writes_the_quota_and_weight_and_turns_itself_off_where_it_finds_no_cgroup(
    cpu_branch: Path,
) -> None:
    cgroup = cpu_branch / "docker" / "abc"
    cgroup.mkdir()
    control = CpuControl(cpu_branch)
    assert control.available
    assert control.limit("abc", 0.25, 512)
    assert int((cgroup / "cpu.cfs_quota_us").read_text()) == int(0.25 * int((cgroup / "cpu.cfs_period_us").read_text()))
    assert int((cgroup / "cpu.shares").read_text()) == 512
    # One container without a cgroup (it ended since it was ready) leaves the control on; several in a row
    # mean the engine's cgroups are elsewhere, so the service stops starting containers apart.
    assert not control.limit("not-here", 0.5, 1024)
    assert control.available
    assert control.limit("abc", 0.25, 512)  # a write that works starts the count again
    for _ in range(MISSES_BEFORE_OFF - 1):
        assert not control.limit("not-here", 0.5, 1024)
    assert control.available
    assert not control.limit("not-here", 0.5, 1024)
    assert not control.available
    assert "in a row had no cgroup" in str(control.failure)
    assert not control.limit("abc", 0.5, 1024)  # off stays off
    assert int((cgroup / "cpu.shares").read_text()) == 512
    assert not CpuControl(None).available


def cpu_used_s(container_id: str) -> float:
    """The CPU every process of the container has used (its cpuacct cgroup's)."""
    used_s = CpuControl.of_this_host().used_s(container_id)
    assert used_s is not None, f"container {container_id[:12]} has no cpuacct cgroup where Docker puts one"
    return used_s


def limits_while_the_code_runs(service: Service, path: str) -> tuple[int, int]:
    """The CPU limits of the container running RUNNING_CODE, read once the program has printed, and checked
    against what it uses while it spins; the execution must have taken `path` (warm or cold), as its audit
    record says."""
    body: dict[str, Any] = {"code": RUNNING_CODE, "timeout_s": 10}
    url = f"{service.base_url}/tools/code-interpreter"
    with httpx2.stream("POST", url, json=body, headers={"Accept": "text/event-stream"}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        events: Iterator[httpx2.ServerSentEvent] = iter(httpx2.EventSource(response))
        first = next(events)
        assert (first.event, first.json()["text"]) == ("stdout", "running\n")
        executions = service.get("/executions").json()["executions"]
        assert len(executions) == 1, executions
        container_id = executions[0]["container_id"]
        limits = cpu_limits(container_id)
        # What the kernel enforces, for every process of the sandbox (under runsc: gVisor's too). A busy
        # machine can only make it less.
        before, started = cpu_used_s(container_id), time.monotonic()
        time.sleep(WATCH_S)
        used_s, watched_s = cpu_used_s(container_id) - before, time.monotonic() - started
        rest = list(events)
    assert used_s <= CPUS * watched_s + 2 * CPUS * PERIOD_US / 1e6, (used_s, watched_s)
    assert rest[-1].event == "result"
    assert rest[-1].json()["stdout"] == "running\ndone\n"
    assert audit_record(service, rest[-1].json()["execution_id"])["container_path"] == path
    return limits


@pytest.mark.parametrize("pool", ["warm", "cold"])
@pytest.mark.parametrize("runtime_name", RUNTIMES)
def test_the_weight_and_share_of_a_running_execution_are_set_before_its_code_runs(
    runtime_name: str, pool: str, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    runtime = usable(RUNTIMES[runtime_name], docker_client)
    settings = {"METAAGENT_SANDBOX_RUNTIME": runtime.name, "METAAGENT_POOL_ENABLED": str(pool == "warm").lower()}
    with running_service(tmp_path, **settings) as service:
        if pool == "warm":
            wait_for_warm_containers(service)
        assert limits_while_the_code_runs(service, pool) == (RUNNING_CPU_SHARES, int(CPUS * PERIOD_US))


@pytest.mark.security
def test_under_runsc_a_container_whose_limits_cannot_be_set_gets_no_code_and_is_removed(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: the cgroup write fails, and runsc's engine has no `update` to fall back on."""
    usable(RUNSC, docker_client)

    async def run() -> str:
        engine = Engine()
        monkeypatch.setattr(engine.cpu_control, "limit", lambda *args: False)
        execution_id = new_execution_id()
        spec = container_spec(execution_id, image_tag(), DEFAULT_MEMORY_MB, CPUS, runtime=RUNSC, cpu_control=True)
        assert spec.start_cpus is not None  # started apart: its limits are still to be set
        try:
            with pytest.raises(Unavailable):
                await execute(
                    engine,
                    spec,
                    payload("console.log('ran')", None),
                    Execution(execution_id, 5, DEFAULT_MEMORY_MB),
                    timeout_s=5,
                    grace_s=1,
                )
        finally:
            engine.close()
        return spec.name

    name = anyio.run(run)
    assert docker_client.containers.list(all=True, filters={"name": name}) == []
