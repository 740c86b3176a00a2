"""The container of one execution or session, in whichever language: one spec for every caller.

The code interpreter tool (one-shot runs and its warm pool) and sessions build their containers here, so
that the limits, labels, runtime and start-up CPU treatment are written once; the language contributes
only its image (chosen by the caller) and its runner's command.
"""

from __future__ import annotations

import os

from metaagent.languages import DEFAULT_LANGUAGE, Language
from metaagent.sandbox.engine import (
    EXECUTION_LABEL,
    OWNER_PID_LABEL,
    SERVICE_LABEL,
    STARTING_CPU_SHARES,
    ContainerSpec,
    Mount,
)
from metaagent.sandbox.runtime import RUNC, Runtime


def container_spec(
    execution_id: str,
    image: str,
    memory_mb: int,
    cpus: float,
    mounts: tuple[Mount, ...] = (),
    command: list[str] | None = None,
    workspace_mb: int = 100,
    runtime: Runtime = RUNC,
    language: Language = DEFAULT_LANGUAGE,
    cpu_control: bool = False,
) -> ContainerSpec:
    """The container of one execution. `command` replaces the runner only in the tests of the container layer.
    `cpu_control`: whether the service sets a running container's CPU limits in its cgroup (`Engine.cpu_control`),
    which lets a container start apart under a runtime whose engine cannot update it."""
    runner = language.runner_command(memory_mb)
    starts_apart = (runtime.updates_cpus or cpu_control) and not command
    return ContainerSpec(
        # The trusted runner loads (its interpreter and the gate) with the machine's CPUs, not the
        # execution's share, and with a starting container's low CPU weight; the share and a running
        # execution's weight apply before the code is handed over. A command of the tests' runs at once,
        # and so does everything under a runtime that cannot change a running container's quota.
        start_cpus=float(os.cpu_count() or 1) if starts_apart else None,
        start_cpu_shares=STARTING_CPU_SHARES if starts_apart else None,
        runtime=runtime.name,
        pids_limit=runtime.pids_limit(),
        nproc=runtime.nproc(),
        name=f"metaagent-{execution_id}",
        image=image,
        command=["/usr/bin/dumb-init", "--", *(command or runner)],
        memory_mb=memory_mb,
        cpus=cpus,
        labels={SERVICE_LABEL: "metaagent", EXECUTION_LABEL: execution_id, OWNER_PID_LABEL: str(os.getpid())},
        mounts=mounts,
        workspace_mb=workspace_mb,
    )
