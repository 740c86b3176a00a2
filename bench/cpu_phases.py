"""The CPU section's phases (bench/cpu.py): one pooled and one cold execution at a time in this process,
with the service's own engine code (`prepare`, `wait_ready`, `execute`), a mark taken at the end of
every engine call, at the runner's ready line, at the hand-over of the code, at the end of the
container's stream and when its shim is gone; the CPU between two marks is the phase's.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass

import anyio

from bench.baselines import EXPECTED_STDOUT, PROGRAM, ContenderFailed
from bench.cpustat import COMPONENTS, Window, per_execution
from bench.cpuwatch import Scope, Watcher
from bench.phases import StreamClock
from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.sandbox.engine import EXECUTION_LABEL, OWNER_PID_LABEL, ContainerSpec, ContainerState, Engine
from metaagent.sandbox.execute import execute, payload, prepare, wait_ready
from metaagent.sandbox.output import Stream
from metaagent.sandbox.runtime import Runtime
from metaagent.tools.code_interpreter import DEFAULT_MEMORY_MB

SHIM_GONE_TIMEOUT_S = 120.0
IDLE_PHASE = "idle in the pool"
WALL = "wall"  # a phase's wall time, beside its CPU
PHASES = (
    "create",
    "attach",
    "start",
    "runner load",
    IDLE_PHASE,
    "hand-over",
    "update (CPU share)",
    "user code",
    "exit reported",
    "inspect",
    "remove",
    "after remove (shim exits)",
)


class Probe:
    """Marks taken at the phases' boundaries of one execution in this process."""

    def __init__(self, watcher: Watcher, scope: Scope) -> None:
        self.watcher = watcher
        self.scope = scope
        self.marks: list[tuple[str, int, float]] = []  # (the phase that ends here, mark, monotonic)
        self.before_update = "runner load"

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self.watcher.mark(self.scope), time.monotonic()))

    def phases(self, background: dict[str, float]) -> dict[str, dict[str, float]]:
        """CPU ms per component of each phase of the execution just run, and its wall time ("wall"); a
        phase reached twice is summed."""
        found: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys([*COMPONENTS, WALL], 0.0))
        for (_, start, started), (phase, end, ended) in itertools.pairwise(self.marks):
            window = Window(1, ended - started, self.watcher.account(start, end, self.scope).cpu_ms)
            for component, value in per_execution([window], background, clamp=False).items():
                if component in COMPONENTS:
                    found[phase][component] += value
            found[phase][WALL] += (ended - started) * 1000
        return dict(found)


class ProbedEngine(Engine):
    """The service's engine driver, marking the end of each call on an execution's path."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    async def create(self, spec: ContainerSpec) -> str:
        container_id = await super().create(spec)
        self.probe.mark("create")
        return container_id

    async def attach(self, container_id: str) -> socket.socket:
        sock = await super().attach(container_id)
        self.probe.mark("attach")
        return sock

    async def start(self, container_id: str) -> None:
        await super().start(container_id)
        self.probe.mark("start")

    async def limit_cpus(self, container_id: str, cpus: float) -> None:
        self.probe.mark(self.probe.before_update)
        await super().limit_cpus(container_id, cpus)
        self.probe.mark("update (CPU share)")

    async def wait(self, container_id: str) -> int:
        status = await super().wait(container_id)
        self.probe.mark("exit reported")
        return status

    async def state(self, container_id: str) -> ContainerState:
        state = await super().state(container_id)
        self.probe.mark("inspect")
        return state

    async def remove(self, container_id: str) -> None:
        await super().remove(container_id)
        self.probe.mark("remove")


class EndOfStreamMark(StreamClock):
    """Marks "user code" when the execution's stream ends: node and dumb-init have exited."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe
        self.marked = False

    async def __call__(self, sock: socket.socket, size: int) -> bytes:
        chunk = await self._real(sock, size)
        if not chunk and not self.marked:
            self.marked = True  # one execution at a time runs in this process: the first end is its
            self.probe.mark("user code")
        return chunk


@dataclass
class HandOverMark:
    """The execution's output sink: `started()` is the hand-over of the code."""

    probe: Probe

    def started(self) -> None:
        self.probe.mark(self.probe.before_update)

    def output(self, stream: Stream, text: str) -> None:
        pass


async def _one_in_process(
    probe: Probe, engine: ProbedEngine, clock: EndOfStreamMark, image: str, cpus: float, runtime: Runtime, *, warm: bool
) -> None:
    probe.marks.clear()
    clock.marked = False
    execution_id = new_execution_id()
    spec = container_spec(
        execution_id, image, DEFAULT_MEMORY_MB, cpus, runtime=runtime, cpu_control=engine.cpu_control.available
    )
    probe.mark("begin")
    prepared = None
    if warm:
        prepared = await prepare(engine, spec, start=True)
        if not await wait_ready(prepared):
            prepared.sock.close()
            await engine.remove(prepared.container_id)
            raise ContenderFailed(f"the runner did not start: {prepared.output.stderr.text()[:300]!r}")
        probe.mark("runner load")
        await anyio.sleep(0.2)  # as in a pool waiting for a request
        probe.mark(IDLE_PHASE)
    probe.before_update = "hand-over" if warm else "runner load"
    outcome = await execute(
        engine,
        spec,
        payload(PROGRAM, None),
        Execution(execution_id, 8, DEFAULT_MEMORY_MB),
        timeout_s=8,
        grace_s=5,
        prepared=prepared,
        sink=HandOverMark(probe),
    )
    if outcome.stdout.text() != EXPECTED_STDOUT:
        raise ContenderFailed(f"the in-process execution printed {outcome.stdout.text()!r}")
    with anyio.move_on_after(SHIM_GONE_TIMEOUT_S):
        while True:  # the watcher's thread sees the shim go within its poll
            if not probe.watcher.live_shims(probe.scope):
                break
            await anyio.sleep(0.02)
    probe.mark("after remove (shim exits)")


async def measure(
    watcher: Watcher, image: str, cpus: float, runtime: Runtime, iterations: int, background: dict[str, float]
) -> dict[str, dict[str, dict[str, float]]]:
    pid = str(os.getpid())
    scope = watcher.register(
        Scope(
            owner=lambda labels: labels.get(OWNER_PID_LABEL) == pid and EXECUTION_LABEL in labels,
            clients=(os.getpid(),),
        )
    )
    probe = Probe(watcher, scope)
    engine = ProbedEngine(probe)
    clock = EndOfStreamMark(probe)
    sums: dict[str, dict[str, dict[str, float]]] = {"warm": {}, "cold": {}}
    clock.install()
    try:
        for index in range(iterations + 1):  # the first of each path warms this process up
            for path in ("warm", "cold"):
                await _one_in_process(probe, engine, clock, image, cpus, runtime, warm=path == "warm")
                if index == 0:
                    continue
                for phase, components in probe.phases(background).items():
                    total = sums[path].setdefault(phase, dict.fromkeys([*COMPONENTS, WALL], 0.0))
                    for component, value in components.items():
                        total[component] += value / iterations
                watcher.forget_before(probe.marks[-1][1])
    finally:
        clock.uninstall()
        engine.close()
    return {path: {phase: found[phase] for phase in PHASES if phase in found} for path, found in sums.items()}
