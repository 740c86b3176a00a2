"""Sessions: a call into a live session and `POST /sessions` against bare `node -e`, files through a
session's runner, and what idle sessions cost, against a service of their own in the same run.

- Calls and creation: rounds of three contenders in a shuffled order, as the latency rows: `1+1` into a
  session that stays open (result checked), `POST /sessions` with the pool full (waited for, untimed,
  before each; the session closed after it, untimed, and the pool's refill waited for), and `node -e`
  on the host. The audit log must say `container_path: warm` for each created session.
- Files: a 10 MiB file of random bytes `PUT` into a session's workspace and `GET` back (checked byte for
  byte), several times. The service's resident memory is sampled during the transfers, and its peak
  (VmHWM, reset through /proc/<pid>/clear_refs first) is compared with the file's size.
- Idle: first the service alone for the period (its CPU time, the baseline), then N sessions open and
  idle for the same period: the CPU time of the service process (/proc/<pid>/stat) and of each session's
  container (its cgroup, as bench/phases.py reads it), and the service's RSS before the sessions open,
  once they are open, and after the period.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.baselines import ContenderFailed, node_argv, time_process
from bench.phases import container_cpu_ms
from bench.service import BenchService
from bench.stats import Summary

CALL = "call into a live session (1+1)"
CREATE = "POST /sessions, pool warm"
NODE = "node -e (host)"
FILE_BYTES = 10 * 1024 * 1024
MIB = 1024 * 1024
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(stat: str) -> float:
    """User plus system CPU seconds of a process, from the text of /proc/<pid>/stat.

    The command name (field 2) may hold spaces and parentheses: fields are counted after its last `)`.
    utime and stime are fields 14 and 15, in clock ticks.
    """
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # fields[0] is field 3 (state)


def status_kib(status: str, name: str) -> int:
    """A `VmRSS:`-style line of /proc/<pid>/status, in KiB."""
    for line in status.splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise ValueError(f"no {name} in the process status")


def mib_per_second(size_bytes: int, elapsed_ms: float) -> float:
    return size_bytes / MIB / (elapsed_ms / 1000) if elapsed_ms > 0 else float("inf")


@dataclass(frozen=True)
class Process:
    """The service process, read from /proc."""

    pid: int

    def cpu_s(self) -> float:
        return process_cpu_s(Path(f"/proc/{self.pid}/stat").read_text())

    def kib(self, name: str) -> int:
        return status_kib(Path(f"/proc/{self.pid}/status").read_text(), name)

    def reset_peak(self) -> bool:
        """Sets VmHWM to the current VmRSS (Linux: `5` to clear_refs); False where that is refused."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError:
            return False
        return True


class RssSampler:
    """The highest VmRSS of a process seen while the block runs, read every few milliseconds."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, self.process.kib("VmRSS"))
            self._stop.wait(0.002)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _Sessions:
    """The session routes of one bench service, each answer checked."""

    def __init__(self, service: BenchService) -> None:
        self.service = service

    def create(self) -> str:
        response = self.service.client.post("/sessions")
        if response.status_code != 201:
            raise ContenderFailed(f"POST /sessions: {response.status_code} {response.text[:300]}")
        return str(response.json()["session_id"])

    def close(self, session_id: str) -> None:
        response = self.service.client.delete(f"/sessions/{session_id}")
        if response.status_code != 200:
            raise ContenderFailed(f"DELETE /sessions/{session_id}: {response.status_code} {response.text[:300]}")

    def call(self, session_id: str, code: str, result: str) -> None:
        response = self.service.client.post(f"/sessions/{session_id}/execute", json={"code": code})
        body: dict[str, Any] = response.json()
        if response.status_code != 200 or body.get("result") != result or body.get("exit_code") != 0:
            raise ContenderFailed(f"{code} in a session: {response.status_code} {body}")

    def container_paths(self, session_ids: list[str]) -> dict[str, int]:
        """How many of these sessions the audit log says took each path ("warm", "cold")."""
        records = self.service.session_records()
        counts: dict[str, int] = {}
        for session_id in session_ids:
            path = str(records.get(session_id, {}).get("container_path", "missing"))
            counts[path] = counts.get(path, 0) + 1
        return counts


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def _calls(
    service: BenchService, sessions: _Sessions, node: str, rounds: int, warmup: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    live = sessions.create()
    measured: list[str] = []  # the sessions of the timed creations, for their paths in the audit log

    def create() -> float:
        service.wait_pool_full()
        started = time.perf_counter()
        session_id = sessions.create()
        elapsed_ms = (time.perf_counter() - started) * 1000
        measured.append(session_id)
        sessions.close(session_id)
        service.wait_pool_full()  # the refill done: it competes with no contender
        return elapsed_ms

    contenders: dict[str, Callable[[], float]] = {
        CALL: lambda: _timed(lambda: sessions.call(live, "1+1", "2")),
        CREATE: create,
        NODE: lambda: time_process(node_argv(node)),
    }
    rng = random.Random(1)  # fixed: two runs shuffle alike
    order = list(contenders)
    for _ in range(warmup):
        for name in order:
            contenders[name]()
    measured.clear()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds):
        rng.shuffle(order)
        for name in order:
            samples[name].append(contenders[name]())
        if (index + 1) % 10 == 0 or index + 1 == rounds:
            progress(f"sessions ({service.name}): {index + 1}/{rounds} rounds")
    sessions.close(live)
    return {
        "rounds": rounds,
        "warmup_rounds": warmup,
        "summaries": {name: Summary.of(values).as_dict() for name, values in samples.items()},
        "samples_ms": samples,
        "create_paths": sessions.container_paths(measured),
    }


def _files(service: BenchService, sessions: _Sessions, process: Process, transfers: int) -> dict[str, Any]:
    session_id = sessions.create()
    data = os.urandom(FILE_BYTES)
    digest = hashlib.sha256(data).hexdigest()
    path = f"/sessions/{session_id}/files/bench/data.bin"
    up: list[float] = []
    down: list[float] = []
    rss_before = process.kib("VmRSS")
    peak_reset = process.reset_peak()
    with RssSampler(process) as sampler:
        for _ in range(transfers):
            started = time.perf_counter()
            written = service.client.put(path, content=data)
            up.append((time.perf_counter() - started) * 1000)
            if written.status_code != 201 or written.json().get("sha256") != digest:
                raise ContenderFailed(f"PUT of 10 MiB: {written.status_code} {written.text[:300]}")
            started = time.perf_counter()
            read = service.client.get(path)
            down.append((time.perf_counter() - started) * 1000)
            if read.status_code != 200 or read.content != data:
                raise ContenderFailed(f"GET of 10 MiB: {read.status_code}, {len(read.content)} bytes, not the file")
    hwm = process.kib("VmHWM") if peak_reset else 0
    sessions.close(session_id)
    peak = max(hwm, sampler.peak_kib)
    growth_kib = max(0, peak - rss_before)
    return {
        "size_bytes": FILE_BYTES,
        "transfers": transfers,
        "upload_ms": Summary.of(up).as_dict(),
        "download_ms": Summary.of(down).as_dict(),
        "upload_mib_s": mib_per_second(FILE_BYTES, Summary.of(up).p50),
        "download_mib_s": mib_per_second(FILE_BYTES, Summary.of(down).p50),
        "rss_before_kib": rss_before,
        "rss_peak_kib": peak,
        "peak_from": "VmHWM and sampled VmRSS" if peak_reset else "sampled VmRSS",
        "rss_growth_kib": growth_kib,
        "growth_per_file": growth_kib * 1024 / FILE_BYTES,
    }


def _cpu_of(container_ids: list[str]) -> dict[str, float | None]:
    return {container_id: container_cpu_ms(container_id) for container_id in container_ids}


def _idle(service: BenchService, sessions: _Sessions, process: Process, count: int, seconds: float) -> dict[str, Any]:
    service.wait_pool_full()
    started = process.cpu_s()
    time.sleep(seconds)
    baseline_cpu_s = process.cpu_s() - started
    rss_before = process.kib("VmRSS")
    opened = [sessions.create() for _ in range(count)]
    try:
        service.wait_pool_full()  # the refills done: what follows is idle
        time.sleep(1.0)  # the last answers' own work settles
        records = service.session_records()
        containers = [str(records[session_id]["container_id"]) for session_id in opened]
        rss_open = process.kib("VmRSS")
        cpu_before, containers_before = process.cpu_s(), _cpu_of(containers)
        time.sleep(seconds)
        cpu_after, containers_after = process.cpu_s(), _cpu_of(containers)
        rss_after = process.kib("VmRSS")
    finally:
        for session_id in opened:
            sessions.close(session_id)
    used = [
        (after - before) / 1000
        for before, after in ((containers_before[c], containers_after[c]) for c in containers)
        if before is not None and after is not None
    ]
    return {
        "sessions": count,
        "seconds": seconds,
        "service_cpu_s_alone": baseline_cpu_s,
        "service_cpu_s": cpu_after - cpu_before,
        "containers_measured": len(used),
        "containers_cpu_s": sum(used) if used else None,
        "container_cpu_s_max": max(used) if used else None,
        "rss_kib": {"before": rss_before, "open": rss_open, "after_idle": rss_after},
        "paths": sessions.container_paths(opened),
    }


def measure(
    service: BenchService,
    *,
    node: str,
    rounds: int,
    warmup: int,
    transfers: int,
    idle_sessions: int,
    idle_seconds: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    if service.process is None:
        raise RuntimeError("the sessions service is not running")
    process = Process(service.process.pid)
    sessions = _Sessions(service)
    result = _calls(service, sessions, node, rounds, warmup, progress)
    result["files"] = _files(service, sessions, process, transfers)
    files = result["files"]
    progress(
        f"sessions ({service.name}): 10 MiB up {files['upload_mib_s']:.0f} MiB/s, down "
        f"{files['download_mib_s']:.0f} MiB/s, RSS +{files['rss_growth_kib'] / 1024:.1f} MiB"
    )
    result["idle"] = _idle(service, sessions, process, idle_sessions, idle_seconds)
    progress(f"sessions ({service.name}): {idle_sessions} idle for {idle_seconds:g} s measured")
    return result
