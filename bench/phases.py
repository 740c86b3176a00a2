"""Where an execution's time goes, measured in this process with the service's own engine code.

A warm container is prepared as the pool prepares one: create, attach, start, then the runner loads
node and the module gate and says it is ready (the cold path does the same on the request path). Then
`execute` runs `console.log(1)` in it exactly as a request would; a second time while another warm
container starts, as the pool starts one the moment a request takes one. The engine's calls are timed one by
one, and the arrival of each chunk of the container's stream: from the start of `execute` to the
program's output, from the output to the engine reporting the container's exit (node and dumb-init
gone, the engine told), then `state` (inspect; only after an exit of 137) and `remove`, which a request
waits for before it is answered. What the end-to-end figure adds on top of `execute` is the service's HTTP, validation,
admission and audit.
"""

from __future__ import annotations

import math
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from bench.baselines import EXPECTED_STDOUT, PROGRAM
from bench.stats import Summary
from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.sandbox import execute as execute_module
from metaagent.sandbox.engine import ContainerSpec, ContainerState, Engine, sock_recv
from metaagent.sandbox.execute import Prepared, execute, payload, prepare, wait_ready
from metaagent.sandbox.runtime import RUNC, Runtime
from metaagent.tools.code_interpreter import DEFAULT_MEMORY_MB

EXECUTE = "execute (the request's engine part)"
# Prints once node is up, then waits on stdin as a warm runner does (so its CPU time can be read).
_PLAIN_NODE = ("/usr/bin/node", "-e", "process.stdout.write('up\\n'); process.stdin.resume()")


class TimedEngine(Engine):
    """The service's engine driver, with the duration of each call on the request path recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[float]] = defaultdict(list)

    def _record(self, name: str, started: float) -> None:
        self.calls[name].append((time.perf_counter() - started) * 1000)

    async def create(self, spec: ContainerSpec) -> str:
        started = time.perf_counter()
        container_id = await super().create(spec)
        self._record("create", started)
        return container_id

    async def attach(self, container_id: str) -> socket.socket:
        started = time.perf_counter()
        sock = await super().attach(container_id)
        self._record("attach", started)
        return sock

    async def start(self, container_id: str) -> None:
        started = time.perf_counter()
        await super().start(container_id)
        self._record("start", started)

    async def wait(self, container_id: str) -> int:
        started = time.perf_counter()
        status = await super().wait(container_id)
        self._record("wait", started)
        return status

    async def state(self, container_id: str) -> ContainerState:
        started = time.perf_counter()
        state = await super().state(container_id)
        self._record("state", started)
        return state

    async def remove(self, container_id: str) -> None:
        started = time.perf_counter()
        await super().remove(container_id)
        self._record("remove", started)


class StreamClock:
    """Stands in for `execute`'s `sock_recv` in this process: notes when the watched container's stream
    brings its first data after the payload, and when it ends (node and dumb-init have exited)."""

    def __init__(self) -> None:
        self._real = sock_recv
        self.watched: socket.socket | None = None
        self.first_data_at: float | None = None
        self.ended_at: float | None = None

    def watch(self, sock: socket.socket) -> None:
        self.watched, self.first_data_at, self.ended_at = sock, None, None

    async def __call__(self, sock: socket.socket, size: int) -> bytes:
        chunk = await self._real(sock, size)
        if sock is self.watched:
            if chunk and self.first_data_at is None:
                self.first_data_at = time.perf_counter()
            if not chunk and self.ended_at is None:
                self.ended_at = time.perf_counter()
        return chunk

    def install(self) -> None:
        vars(execute_module)["sock_recv"] = self  # the name `execute` looks up, in this process only

    def uninstall(self) -> None:
        vars(execute_module)["sock_recv"] = self._real


_CPU_USAGE_FILES = (
    "/sys/fs/cgroup/cpuacct/docker/{id}/cpuacct.usage",  # cgroup v1, cgroupfs driver: nanoseconds
    "/sys/fs/cgroup/docker/{id}/cpu.stat",  # cgroup v2, cgroupfs driver: usage_usec
    "/sys/fs/cgroup/system.slice/docker-{id}.scope/cpu.stat",  # cgroup v2, systemd driver
)


def container_cpu_ms(container_id: str) -> float | None:
    """CPU time the container's processes have used so far (all CPUs), from its cgroup; None if unknown.

    Unlike wall time it hardly depends on the machine's load, so it shows what each start costs.
    """
    for template in _CPU_USAGE_FILES:
        try:
            text = Path(template.format(id=container_id)).read_text()
        except OSError:
            continue
        if template.endswith("cpuacct.usage"):
            return int(text) / 1e6
        for line in text.splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e3
    return None


async def _plain_node(engine: TimedEngine, image: str, cpus: float, runtime: Runtime) -> tuple[float, float | None]:
    """Wall time from create to a bare `node -e` having printed, and its CPU time then: the runner's baseline."""
    spec = container_spec(
        new_execution_id(), image, DEFAULT_MEMORY_MB, cpus, command=list(_PLAIN_NODE), runtime=runtime
    )
    started = time.perf_counter()
    prepared = await prepare(engine, spec, start=True, ready_marker=b"")
    try:
        while not prepared.output.stdout.produced:
            if not await prepared.read_some():
                raise RuntimeError(f"node -e did not print: {prepared.output.stderr.text()[:300]!r}")
        return (time.perf_counter() - started) * 1000, container_cpu_ms(prepared.container_id)
    finally:
        prepared.sock.close()
        await engine.remove(prepared.container_id)


async def _warm_container(
    engine: TimedEngine, image: str, cpus: float, runtime: Runtime
) -> tuple[str, ContainerSpec, Prepared]:
    execution_id = new_execution_id()
    spec = container_spec(
        execution_id, image, DEFAULT_MEMORY_MB, cpus, runtime=runtime, cpu_control=engine.cpu_control.available
    )
    prepared = await prepare(engine, spec, start=True)
    if not await wait_ready(prepared):
        prepared.sock.close()
        await engine.remove(prepared.container_id)
        raise RuntimeError(f"the runner did not start: {prepared.output.stderr.text()[:300]!r}")
    return execution_id, spec, prepared


async def _one(
    engine: TimedEngine, clock: StreamClock, image: str, cpus: float, runtime: Runtime, *, refill: bool
) -> dict[str, float]:
    """One pooled execution; with `refill`, another warm container starts meanwhile, as the pool does."""
    engine.calls.clear()
    started = time.perf_counter()
    execution_id, spec, prepared = await _warm_container(engine, image, cpus, runtime)
    warm_ms = (time.perf_counter() - started) * 1000
    start_calls = {name: engine.calls[name][0] for name in ("create", "attach", "start")}
    warm_cpu_ms = container_cpu_ms(prepared.container_id)
    await anyio.sleep(0.2)  # the start's own work settles, as in a pool that waits for requests
    engine.calls.clear()
    clock.watch(prepared.sock)
    refilled: list[Prepared] = []
    async with anyio.create_task_group() as group:
        if refill:

            async def start_another() -> None:
                refilled.append((await _warm_container(engine, image, cpus, runtime))[2])

            group.start_soon(start_another)
        started = time.perf_counter()
        execution = Execution(execution_id, 8, DEFAULT_MEMORY_MB)
        outcome = await execute(
            engine, spec, payload(PROGRAM, None), execution, timeout_s=8, grace_s=5, prepared=prepared
        )
        execute_ms = (time.perf_counter() - started) * 1000
        wait_ms, remove_ms = engine.calls["wait"][0], engine.calls["remove"][0]
        state_ms = sum(engine.calls["state"])  # none after a clean exit: only an exit of 137 is asked about
    for other in refilled:
        other.sock.close()
        await engine.remove(other.container_id)
    if outcome.stdout.text() != EXPECTED_STDOUT:
        raise RuntimeError(f"the pooled execution printed {outcome.stdout.text()!r}")
    output_ms = ((clock.first_data_at or started) - started) * 1000
    ended_ms = ((clock.ended_at or started) - started) * 1000
    return {
        "warm_cpu_ms": math.nan if warm_cpu_ms is None else warm_cpu_ms,
        "warm_ms": warm_ms,
        **start_calls,
        "execute_ms": execute_ms,
        "output_ms": output_ms,
        "ended_ms": ended_ms,
        "wait_ms": wait_ms,
        "state_ms": state_ms,
        "remove_ms": remove_ms,
    }


async def _measure(image: str, cpus: float, iterations: int, warmup: int, runtime: Runtime) -> dict[str, list[float]]:
    engine = TimedEngine()
    clock = StreamClock()
    phases: dict[str, list[float]] = defaultdict(list)
    clock.install()
    try:
        for index in range(warmup + iterations):
            quiet = await _one(engine, clock, image, cpus, runtime, refill=False)
            busy = await _one(engine, clock, image, cpus, runtime, refill=True)
            plain_ms, plain_cpu_ms = await _plain_node(engine, image, cpus, runtime)
            if index < warmup:
                continue
            phases["warm start (pool, off the request path)"].append(quiet["warm_ms"])
            phases["  create"].append(quiet["create"])
            phases["  attach"].append(quiet["attach"])
            phases["  start"].append(quiet["start"])
            phases["  runner loads node and the gate"].append(
                quiet["warm_ms"] - quiet["create"] - quiet["attach"] - quiet["start"]
            )
            phases[EXECUTE].append(quiet["execute_ms"])
            phases["  payload sent to output received"].append(quiet["output_ms"])
            phases["  output to end of stream (node exits)"].append(quiet["ended_ms"] - quiet["output_ms"])
            phases["  end of stream to exit reported"].append(quiet["wait_ms"] - quiet["ended_ms"])
            phases["  inspect (state; only at exit 137)"].append(quiet["state_ms"])
            phases["  remove"].append(quiet["remove_ms"])
            phases["execute while another warm container starts"].append(busy["execute_ms"])
            phases["bare node -e in the same container: create to output"].append(plain_ms)
            if plain_cpu_ms is not None and not math.isnan(quiet["warm_cpu_ms"]):
                phases["CPU time of a warm start, in the container (runner + gate)"].append(quiet["warm_cpu_ms"])
                phases["CPU time of bare node -e up, in the container"].append(plain_cpu_ms)
    finally:
        clock.uninstall()
        engine.close()
    return phases


def measure(
    *,
    image: str,
    cpus: float,
    iterations: int,
    warmup: int,
    progress: Callable[[str], None],
    runtime: Runtime = RUNC,
) -> dict[str, Any]:
    phases = anyio.run(_measure, image, cpus, iterations, warmup, runtime)
    progress(f"phases ({runtime.name}): {iterations} pooled executions, and as many while a refill starts")
    return {
        "iterations": iterations,
        "phases_ms": {name: Summary.of(values).as_dict() for name, values in phases.items()},
    }
