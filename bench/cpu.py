"""Host CPU per execution of `console.log(1)` (issue 18, item 1): the service with its warm pool, with
the pool off, and a `docker run --rm` of bare node with the service's flags, under runc and runsc; by
part of the machine, and (in this process, with the service's own engine code) by phase.

The parts: dockerd, containerd, the containerd shim of each container, the runtime (each run of `runc`
or `runsc` for one step, runsc's wrapper script, Docker's `libnetwork-setkey` hook that runc runs), the
container (under runc: runc's init, which becomes dumb-init, and node; under runsc: gVisor's sandbox,
its gofer and the `exe` processes it starts, where the code runs), and the client (the service process;
for `docker run --rm`, the docker CLI).

Method: per-thread accounting, never a system-wide figure. Other engineers run tests on this machine
at the same time; what their processes use never enters these figures except through dockerd and
containerd, which everyone shares (below).
- Every figure is a thread's time on a CPU as the scheduler sums it (se.sum_exec_runtime, in ns): read
  from /proc/<pid>/task/<tid>/schedstat while the thread runs, and taken from the kernel's taskstats
  exit record (cpu_run_virtual_total, the same sum) when it exits. A generic netlink socket receives
  the record of every thread that exits on any CPU, so the processes that live for milliseconds (each
  `runc` run, runc's init stages, the hook, the shim's launcher) are counted whole, without sampling
  /proc in time; utime and stime are not used, as this kernel charges them in whole ticks (4 ms).
  Why not the other ways: a shim daemonizes, so its parent is PID 1 (on this machine the VM's init,
  process_api), which reaps it with every other orphan of the machine, so no cumulative children time
  (cutime) holds the shims alone; /proc's utime and stime are truncated to 10 ms; and sampling /proc
  misses up to a poll's worth of each process's end and the whole of those shorter than a poll.
- The CPU between two marks is, per thread, the last value seen by the later mark minus the last seen
  by the earlier (bench/cpustat.py, `Ledger`): a thread alive throughout counts its growth, one born
  in between counts from 0, one that exited counts up to its exit. dockerd's and containerd's threads
  are read at every mark; a thread of theirs that exits in between is counted from its exit record.
- Whose process is whose: a thread of this process polls /proc every 20 ms and notes each new process's
  parent, name, command line and cgroup. A shim is the contender's when its container's labels say so
  (read from dockerd's config.v2.json on disk, not through the engine's API, which would cost dockerd
  CPU): the service's owner pid, or the benchmark's label on its `docker run` containers. Below a shim,
  through the parents the exit records and /proc give, a process is the container's when it ran in the
  container's cgroup or descends from one that did; a run of the runtime's command or of a hook is the
  runtime's even where it joined that cgroup (runsc's create does). A child that dockerd or
  containerd runs for one of the contender's containers counts with them: the launcher a shim was
  first seen below, or one whose command line names the container or its network namespace (dockerd's
  `set-ipv6` re-exec); the children they run for others do not count.
- A window is a batch of executions, back to back, from a steady state to the same steady state: for
  the pooled service from a full pool to a full pool again (so each taken container's start, done
  earlier, is matched by its refill's, done in the window, and the pool's idle time in the window is
  counted; a batch is no larger than the pool, so every execution is warm), otherwise from no
  container of the contender to none. The pooled service's refill is awaited by polling its /metrics
  (no engine call); the service's CPU per poll is measured beforehand and subtracted.
- dockerd and containerd serve every user of the engine. Their CPU is also measured in idle windows,
  when nothing of the benchmark runs, after every window; that background rate times each window's
  length is subtracted from their figures (never below 0). Contenders run in rounds, in a shuffled
  order, so that a change in the machine's load falls on all of them alike. The containers other users
  created and removed during the windows are counted and reported.
- Errors, measured in the same run: an exit record is made while the thread is still on the CPU, from
  the scheduler's sum as last brought up to date (at most a tick, 4 ms, before), and before the
  process's memory is freed; no record counts that tail. The docker CLI's rusage (what its parent is
  told at the reap) minus its records gives the tail per process. The container's cgroup (cpuacct),
  read at each poll, is a cross-check of the container's figure under runc. Records the kernel dropped
  (a full socket buffer) are counted.

The pooled service is also measured at rest, its pool full and no request, to show what keeping the
pool costs per second.

By phase (bench/cpu_phases.py): in this process, the service's own code (`prepare`, `wait_ready`,
`execute`) runs a pooled execution and a cold one while every engine call, the runner's ready line,
the hand-over of the code, the end of the container's stream and the shim's exit take a mark; the CPU
between two marks is the phase's. The marks' own work runs on the watching thread, which is left out
of this process's figure.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import docker

from bench import cpu_phases
from bench.baselines import BENCH_LABEL, EXPECTED_STDOUT, PROGRAM, ContenderFailed, docker_run_argv
from bench.cpustat import (
    CLIENT,
    COMPONENTS,
    CONTAINER,
    ENGINE,
    NETLINK_GENERIC,
    Window,
    background_rate,
    per_execution,
)
from bench.cpuwatch import Scope, Watcher, wait_until
from bench.latency import COLD, DOCKER_RUN, POOLED
from bench.service import BenchService
from bench.stats import Summary
from metaagent.sandbox.engine import OWNER_PID_LABEL
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime

SETTLE_TIMEOUT_S = 120.0
METRICS_CALIBRATION_CALLS = 20
METRICS_POLL_S = 0.1


def unavailable() -> str | None:
    """None when this machine allows the section's method; otherwise why not."""
    if os.geteuid() != 0:
        return "needs root (the kernel's exit records of other users' processes, dockerd's container files)"
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC):
            pass
    except OSError as exc:
        return f"no netlink socket ({exc})"
    return None


# --- the contenders ---------------------------------------------------------------------------------


def _pool_ready(service: BenchService) -> int:
    """JavaScript's pool's ready containers from /metrics (no engine call, unlike /health)."""
    for line in service.client.get("/metrics").text.splitlines():
        if line.startswith('metaagent_pool_containers{language="javascript"} '):
            return int(float(line.split()[1]))
    raise RuntimeError(f"the {service.name} service's /metrics has no metaagent_pool_containers")


@dataclass
class ServiceContender:
    """`POST /tools/code-interpreter` to a service of the benchmark's own, pooled or with the pool off."""

    name: str
    runtime: Runtime
    service: BenchService
    watcher: Watcher
    pooled: bool
    size: int = 0  # the pool's, once known
    poll_cost_ms: float = 0.0
    execution_ids: list[str] = field(default_factory=list)

    @property
    def scope(self) -> Scope:
        pid = str(self.process_id)
        return Scope(owner=lambda labels: labels.get(OWNER_PID_LABEL) == pid, clients=(self.process_id,))

    @property
    def process_id(self) -> int:
        assert self.service.process is not None
        return self.service.process.pid

    def prepare(self) -> None:
        """Outside the window (through /health, which pings the engine): a full pool."""
        if self.pooled:
            self.service.wait_pool_full()
            self.size = int(self.service.warm_pool()["size"])

    def calibrate(self) -> None:
        """The service's CPU for one /metrics request, subtracted per poll from the pooled windows."""
        start = self.watcher.mark(self.scope)
        for _ in range(METRICS_CALIBRATION_CALLS):
            _pool_ready(self.service)
        end = self.watcher.mark(self.scope)
        self.poll_cost_ms = self.watcher.account(start, end, self.scope).cpu_ms[CLIENT] / METRICS_CALIBRATION_CALLS

    def _wait_full(self) -> int:
        polls, deadline = 0, time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            polls += 1
            if _pool_ready(self.service) >= self.size:
                return polls
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.service.name} service's pool did not refill\n{self.service.log_tail()}")
            time.sleep(METRICS_POLL_S)

    def run(self, executions: int) -> int:
        """The batch, back to back; returns how many /metrics polls it made. A batch no larger than the
        pool is served warm from the full pool it starts with; a larger one waits for a refill when the
        pool is out."""
        polls = 0
        for index in range(executions):
            if self.pooled and index >= self.size:
                polls += self._wait_full()
            response = self.service.client.post("/tools/code-interpreter", json={"code": PROGRAM})
            body: dict[str, Any] = response.json()
            if response.status_code != 200 or body.get("stdout") != EXPECTED_STDOUT:
                raise ContenderFailed(f"{self.service.name}: {response.status_code} {body}")
            self.execution_ids.append(str(body["execution_id"]))
        return polls

    def settle(self, before: set[int]) -> int:
        """Until the steady state again: the pool refilled, or every container of the batch gone."""
        if self.pooled:
            return self._wait_full()
        _settled(self.watcher, self.scope, before)
        return 0

    def paths(self) -> dict[str, int]:
        known = self.service.container_paths()
        counts: dict[str, int] = defaultdict(int)
        for execution_id in self.execution_ids:
            counts[known.get(execution_id, "missing")] += 1
        return dict(counts)


@dataclass
class DockerRunContender:
    """`docker run --rm` of bare node with the service's flags under the runtime (bench/baselines.py)."""

    name: str
    runtime: Runtime
    image: str
    cpus: float
    watcher: Watcher

    @property
    def scope(self) -> Scope:
        pid = os.getpid()
        return Scope(owner=lambda labels: labels.get(BENCH_LABEL) == str(pid), client_children=(pid, "docker"))

    def prepare(self) -> None:
        pass

    def run(self, executions: int) -> int:
        for _ in range(executions):
            done = subprocess.run(
                docker_run_argv(self.image, self.cpus, self.runtime),
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if done.returncode != 0 or done.stdout != EXPECTED_STDOUT:
                raise ContenderFailed(
                    f"docker run ({self.runtime.name}) exited {done.returncode}: {done.stderr[-500:]!r}"
                )
        return 0

    def settle(self, before: set[int]) -> int:
        _settled(self.watcher, self.scope, before)
        return 0


def _settled(watcher: Watcher, scope: Scope, before: set[int]) -> None:
    """Until every container the batch made is gone (shims left from before it, a runtime's leftovers
    of a failed start, are not waited for)."""
    try:
        wait_until(lambda: set(watcher.live_shims(scope)) <= before, SETTLE_TIMEOUT_S, "the batch's containers to go")
    except RuntimeError as exc:
        left = {pid: cid[:12] for pid, cid in watcher.live_shims(scope).items() if pid not in before}
        raise RuntimeError(f"{exc}: shims still running {left}") from None


Contender = ServiceContender | DockerRunContender


def _children_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


# --- windows ----------------------------------------------------------------------------------------

IDLE_SCOPE = Scope(owner=lambda labels: False)


@dataclass
class Tally:
    """One contender's windows and what they showed."""

    windows: list[Window] = field(default_factory=list)
    by_process_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    processes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    foreign_exits: int = 0
    metrics_polls: int = 0
    rest: list[Window] = field(default_factory=list)  # the pooled service at rest, its pool full
    children_ms: float = 0.0  # CPU of this process's children as the kernel told it when it reaped them
    cgroup_ms: float = 0.0
    ledger_container_ms: float = 0.0


def _foreign_exits(watcher: Watcher, since: float, until: float, ours: set[int]) -> int:
    return sum(1 for pid, at in watcher.shim_exits if since <= at <= until and pid not in ours)


def _window(watcher: Watcher, contender: Contender, executions: int, tally: Tally | None) -> None:
    contender.prepare()
    shims_before, live_before = set(watcher.owned_shims(contender.scope)), set(watcher.live_shims(contender.scope))
    start, started, children_ms = watcher.mark(contender.scope), time.monotonic(), _children_cpu_ms()
    polls = contender.run(executions)
    children_ms = _children_cpu_ms() - children_ms
    polls += contender.settle(live_before)
    end, seconds = watcher.mark(contender.scope), time.monotonic() - started
    accounting = watcher.account(start, end, contender.scope)
    if tally is not None:
        cpu_ms = dict(accounting.cpu_ms)
        poll_cost = contender.poll_cost_ms if isinstance(contender, ServiceContender) else 0.0
        cpu_ms[CLIENT] = max(0.0, cpu_ms[CLIENT] - polls * poll_cost)
        tally.windows.append(Window(executions, seconds, cpu_ms))
        client = "client: service process" if isinstance(contender, ServiceContender) else "client: docker CLI"
        for label, value in accounting.by_process.items():
            if label.startswith("client: "):
                label, value = client, max(0.0, value - polls * poll_cost)
            tally.by_process_ms[label] += value
        for component, count in accounting.processes.items():
            tally.processes[component] += count
        owned = watcher.owned_shims(contender.scope)
        tally.foreign_exits += _foreign_exits(watcher, started, started + seconds, set(owned))
        tally.metrics_polls += polls
        tally.children_ms += children_ms
        created = {cid for pid, cid in owned.items() if pid not in shims_before}
        if contender.runtime is RUNC and not (isinstance(contender, ServiceContender) and contender.pooled):
            tally.cgroup_ms += watcher.container_cgroup_ms(created)
            tally.ledger_container_ms += accounting.cpu_ms[CONTAINER]
    watcher.forget_before(end)


def _rest(watcher: Watcher, contender: ServiceContender, seconds: float, tally: Tally) -> None:
    """The pooled service with its pool full and no request: what keeping the pool costs per second."""
    contender.prepare()
    start, started = watcher.mark(contender.scope), time.monotonic()
    time.sleep(seconds)
    end, elapsed = watcher.mark(contender.scope), time.monotonic() - started
    tally.rest.append(Window(0, elapsed, watcher.account(start, end, contender.scope).cpu_ms))
    watcher.forget_before(end)


def _idle(watcher: Watcher, seconds: float, windows: list[Window], foreign: list[int]) -> None:
    start, started = watcher.mark(None), time.monotonic()
    time.sleep(seconds)
    end, elapsed = watcher.mark(None), time.monotonic() - started
    windows.append(Window(0, elapsed, watcher.account(start, end, IDLE_SCOPE).cpu_ms))
    foreign.append(_foreign_exits(watcher, started, started + elapsed, set()))
    watcher.forget_before(end)


def _summary(contender: Contender, tally: Tally, background: dict[str, float]) -> dict[str, Any]:
    executions = sum(window.executions for window in tally.windows)
    per_window = [per_execution([window], background)["total"] for window in tally.windows]
    result: dict[str, Any] = {
        "name": contender.name,
        "runtime": contender.runtime.name,
        "executions": executions,
        "windows": len(tally.windows),
        "per_execution_ms": per_execution(tally.windows, background),
        "raw_per_execution_ms": per_execution(tally.windows, {}),
        "window_totals_ms": Summary.of(per_window).as_dict() if per_window else None,
        "by_process_ms": {label: value / executions for label, value in sorted(tally.by_process_ms.items())},
        "processes_per_execution": {c: tally.processes.get(c, 0) / executions for c in COMPONENTS},
        "foreign_container_exits": tally.foreign_exits,
        "seconds": sum(window.seconds for window in tally.windows),
    }
    if isinstance(contender, ServiceContender):
        result["paths"] = contender.paths()
        if contender.pooled:
            result["metrics_polls"] = tally.metrics_polls
            result["metrics_poll_cost_ms"] = contender.poll_cost_ms
            rest_s = sum(window.seconds for window in tally.rest)
            rest = {c: sum(w.cpu_ms.get(c, 0.0) for w in tally.rest) / rest_s for c in COMPONENTS if c not in ENGINE}
            result["at_rest_ms_per_s"] = rest
            # What the pool at rest would use over the windows' time, per execution: part of the figure.
            result["at_rest_share_ms"] = sum(rest.values()) * result["seconds"] / executions
    if tally.ledger_container_ms:
        result["container_cgroup_over_ledger"] = tally.cgroup_ms / tally.ledger_container_ms
    if isinstance(contender, DockerRunContender):
        clis = executions  # one docker CLI per execution
        counted = sum(window.cpu_ms[CLIENT] for window in tally.windows)
        result["exit_tail_ms_per_process"] = (tally.children_ms - counted) / clis if clis else None
    return result


# --- the section --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _services(runtimes: list[Runtime]) -> Iterator[dict[tuple[str, str], BenchService]]:
    with contextlib.ExitStack() as stack:
        services = {}
        for runtime in runtimes:
            for kind, settings in (("pooled", {}), ("cold", {"METAAGENT_POOL_ENABLED": "false"})):
                services[(kind, runtime.name)] = stack.enter_context(
                    BenchService(f"cpu-{kind}-{runtime.name}", METAAGENT_SANDBOX_RUNTIME=runtime.name, **settings)
                )
        yield services


def measure(
    *,
    image: str,
    cpus: float,
    runsc: bool,
    rounds: int,
    batch: int,
    idle_s: float,
    phase_iterations: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    runtimes = [RUNC, RUNSC] if runsc else [RUNC]
    client = docker.from_env()
    try:
        docker_root = Path(str(client.info().get("DockerRootDir") or "/var/lib/docker"))
    finally:
        client.close()
    progress("cpu: starting the services (warm pool on and off, per runtime)")
    with _services(runtimes) as services, Watcher(docker_root) as watcher:
        contenders: list[Contender] = []
        for runtime in runtimes:
            contenders.append(ServiceContender(POOLED, runtime, services[("pooled", runtime.name)], watcher, True))
            contenders.append(ServiceContender(COLD, runtime, services[("cold", runtime.name)], watcher, False))
            contenders.append(DockerRunContender(DOCKER_RUN, runtime, image, cpus, watcher))
        for contender in contenders:
            watcher.register(contender.scope)
        for contender in contenders:
            if isinstance(contender, ServiceContender) and contender.pooled:
                contender.prepare()
                contender.calibrate()
            _window(watcher, contender, 1, None)  # warm-up: first requests, first containers
        tallies = {id(contender): Tally() for contender in contenders}
        idle_windows: list[Window] = []
        idle_foreign: list[int] = []
        rng = random.Random(18)  # fixed: two runs shuffle alike
        order = list(contenders)
        for index in range(rounds):
            rng.shuffle(order)
            for contender in order:
                _window(watcher, contender, batch, tallies[id(contender)])
                if isinstance(contender, ServiceContender) and contender.pooled:
                    _rest(watcher, contender, idle_s, tallies[id(contender)])
                _idle(watcher, idle_s, idle_windows, idle_foreign)
            progress(f"cpu: round {index + 1}/{rounds} ({len(order)} contenders x {batch} executions)")
        background = background_rate(idle_windows)
        rows = [_summary(contender, tallies[id(contender)], background) for contender in contenders]
        phases = {}
        for runtime in runtimes:
            phases[runtime.name] = anyio.run(
                cpu_phases.measure, watcher, image, cpus, runtime, phase_iterations, background
            )
            progress(f"cpu: phases under {runtime.name}, {phase_iterations} warm and {phase_iterations} cold")
        return {
            "program": PROGRAM,
            "rounds": rounds,
            "batch": batch,
            "idle_s": idle_s,
            "contenders": rows,
            "background_ms_per_s": background,
            "idle_seconds": sum(window.seconds for window in idle_windows),
            "idle_foreign_container_exits": sum(idle_foreign),
            "lost_record_datagrams": watcher.taskstats.lost,
            "sampled_records": watcher.sampled_records,
            "phase_iterations": phase_iterations,
            "phases_ms": phases,
        }
