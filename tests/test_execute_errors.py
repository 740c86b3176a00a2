"""How `execute` reports an engine that fails mid-execution: as the engine's own error, never a group."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest

from metaagent.executions import Execution
from metaagent.sandbox.engine import ContainerSpec, ContainerState, EngineUnavailable
from metaagent.sandbox.execute import execute

SPEC = ContainerSpec(name="n", image="i", command=["c"], memory_mb=256, cpus=0.5, labels={})


class EngineThatDiesWhileWaiting:
    """Pure logic: the container 'runs' until the engine goes away under `wait`."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.ours.setblocking(False)
        self.removed: list[str] = []

    async def create(self, spec: ContainerSpec) -> str:
        return "c1"

    async def attach(self, container_id: str) -> socket.socket:
        return self.ours

    async def start(self, container_id: str) -> None:
        pass

    async def wait(self, container_id: str) -> int:
        await anyio.sleep(0.01)
        raise EngineUnavailable("The container engine is unavailable (gone); start it with scripts/ensure-docker")

    async def kill(self, container_id: str, signal: str) -> None:
        raise EngineUnavailable("The container engine is unavailable (gone); start it with scripts/ensure-docker")

    async def state(self, container_id: str) -> ContainerState:
        return ContainerState(None, oom_killed=False)

    async def remove(self, container_id: str) -> None:
        self.removed.append(container_id)


async def test_an_engine_failure_mid_execution_is_raised_as_itself_and_the_container_removed() -> None:
    engine: Any = EngineThatDiesWhileWaiting()
    execution = Execution("exe_x", 5, 256)
    with pytest.raises(EngineUnavailable, match="engine is unavailable"):
        await execute(engine, SPEC, b"", execution, timeout_s=5, grace_s=1, ready_marker=b"")
    assert engine.removed == ["c1"]
    engine.theirs.close()


class EngineWhoseSandboxEndsWith(EngineThatDiesWhileWaiting):
    """Pure logic: the container ends with `exit_code` while its memory cgroup's record says `oom`."""

    def __init__(self, exit_code: int, oom: bool) -> None:
        super().__init__()
        self.exit_code, self.oom = exit_code, oom

    async def wait(self, container_id: str) -> int:
        self.theirs.close()
        return self.exit_code

    def saw_oom(self, container_id: str) -> bool:
        return self.oom


@pytest.mark.parametrize(("exit_code", "oom"), [(2, True), (1, False)])
async def test_a_failed_exit_is_an_oom_kill_when_the_memory_cgroup_saw_one_whatever_its_code(
    exit_code: int, oom: bool
) -> None:
    """Under runsc the cgroup's kill can land on gVisor's own kernel, whose death exits 2, not 137."""
    engine: Any = EngineWhoseSandboxEndsWith(exit_code, oom)
    outcome = await execute(engine, SPEC, b"", Execution("exe_x", 5, 256), timeout_s=5, grace_s=1, ready_marker=b"")
    assert (outcome.exit_code, outcome.oom_killed) == (exit_code, oom)
    assert engine.removed == ["c1"]
