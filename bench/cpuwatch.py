"""Watching the host's processes for the CPU section: the kernel's exit records (taskstats), /proc, and
the containers' cgroups. The method and why it is accurate are in bench/cpu.py's docstring; the
arithmetic is in bench/cpustat.py.

One `Watcher` per run. Its thread drains the exit records every 20 ms and notes every new process
(parent, name, cgroup; for a containerd shim, its container and that container's labels). `mark()`
reads the CPU time of every thread of the processes a contender owns, and of dockerd and containerd,
so that `account()` can give the CPU of each part of an execution between two marks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

from bench.cpustat import (
    CTRL_ATTR_FAMILY_NAME,
    CTRL_CMD_GETFAMILY,
    GENL_ID_CTRL,
    NETLINK_GENERIC,
    TASKSTATS_CMD_ATTR_DEREGISTER_CPUMASK,
    TASKSTATS_CMD_ATTR_REGISTER_CPUMASK,
    TASKSTATS_CMD_GET,
    Accounting,
    ExitRecord,
    Ledger,
    Process,
    acknowledgement,
    cgroup_path,
    classify,
    exit_records,
    family_id,
    genl_message,
    netlink_attribute,
    parse_schedstat,
    parse_stat,
    process_label,
    shim_container_id,
)

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
POLL_S = 0.02
_RECEIVE_BUFFER = 32 << 20  # exit records of a few seconds of a busy machine; more are counted as lost
_SO_RCVBUFFORCE = 33  # Linux: like SO_RCVBUF, past rmem_max (needs CAP_NET_ADMIN)

Owner = Callable[[Mapping[str, str]], bool]  # a container's labels -> whether the contender owns it


class WatchUnavailable(RuntimeError):
    """The kernel or the permissions do not allow this section's method (the reason says which)."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def online_cpus() -> str:
    text = _read(Path("/sys/devices/system/cpu/online"))
    return text.strip() if text else f"0-{(os.cpu_count() or 1) - 1}"


class TaskstatsSocket:
    """A listener for every thread's exit record on every CPU (generic netlink family TASKSTATS)."""

    def __init__(self) -> None:
        try:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        except OSError as exc:
            raise WatchUnavailable(f"no generic netlink socket ({exc})") from exc
        try:
            self.sock.bind((0, 0))
            self.sock.settimeout(5)
            self.sock.send(
                genl_message(
                    GENL_ID_CTRL, CTRL_CMD_GETFAMILY, netlink_attribute(CTRL_ATTR_FAMILY_NAME, b"TASKSTATS\0"), 1
                )
            )
            found = family_id(self.sock.recv(65536))
            if found is None:
                raise WatchUnavailable("the kernel has no taskstats (CONFIG_TASKSTATS)")
            self.family = found
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RECEIVE_BUFFER)
            except OSError:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
            self.cpus = online_cpus().encode() + b"\0"
            self.sock.send(
                genl_message(
                    self.family,
                    TASKSTATS_CMD_GET,
                    netlink_attribute(TASKSTATS_CMD_ATTR_REGISTER_CPUMASK, self.cpus),
                    2,
                    ack=True,
                )
            )
            answer = None
            while answer is None:  # exit records may come before the answer: they are not needed yet
                answer = acknowledgement(self.sock.recv(1 << 16), 2)
            if answer != 0:
                raise OSError(-answer, os.strerror(-answer))
            self.sock.setblocking(False)
        except OSError as exc:
            self.sock.close()
            raise WatchUnavailable(f"cannot listen to taskstats exit records ({exc}); run as root") from exc
        self.lost = 0  # datagrams the kernel dropped (receive buffer full)

    def drain(self) -> list[ExitRecord]:
        """Every record waiting now: all threads that exited before this call."""
        records: list[ExitRecord] = []
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return records
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.lost += 1
                    continue
                raise
            records.extend(exit_records(data, self.family))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # closing the socket deregisters it too
            self.sock.send(
                genl_message(
                    self.family,
                    TASKSTATS_CMD_GET,
                    netlink_attribute(TASKSTATS_CMD_ATTR_DEREGISTER_CPUMASK, self.cpus),
                    3,
                )
            )
        self.sock.close()


@dataclass(frozen=True)
class Scope:
    """Whose CPU a contender's figures count: the containers it owns, its client process(es)."""

    owner: Owner
    clients: tuple[int, ...] = ()  # long-lived client processes (the service)
    client_children: tuple[int, str] | None = None  # (parent, name): short-lived clients (docker CLIs)


def _pids_named(name: str) -> list[int]:
    return [
        int(entry.name)
        for entry in PROC.iterdir()
        if entry.name.isdigit() and (_read(entry / "comm") or "").strip() == name
    ]


class Watcher:
    """The exit records and /proc, watched from a thread of this process; see the module docstring."""

    def __init__(self, docker_root: Path) -> None:
        self.docker_root = docker_root
        self.dockerd = tuple(_pids_named("dockerd"))
        self.containerd = tuple(_pids_named("containerd"))
        if not self.dockerd or not self.containerd:
            raise WatchUnavailable(f"dockerd ({self.dockerd}) or containerd ({self.containerd}) not found in /proc")
        self._boot_s = _boot_time()
        self._ticks = os.sysconf("SC_CLK_TCK")
        self.taskstats = TaskstatsSocket()
        self.ledger = Ledger()
        self.processes: dict[int, Process] = {}
        self.children: dict[int, set[int]] = {}
        self.listed: set[int] = set()  # the pids in /proc at the last poll
        self.ended: dict[int, float] = {}  # pid -> when its exit record came (monotonic)
        self.shims: dict[int, str] = {}  # every shim seen: pid -> container id
        self.candidates: set[int] = set()  # live processes named like a shim (see `_find_shims`)
        self.scopes: list[Scope] = []  # the contenders': whose containers are the benchmark's
        self.labels: dict[str, dict[str, str]] = {}
        self.sandbox_keys: dict[str, str] = {}  # container id -> its network namespace's name
        self.cgroup_ns: dict[str, int] = {}  # container id -> its cgroup's CPU as last read
        self.shim_exits: list[tuple[int, float]] = []  # (pid, monotonic): others' executions are counted
        self.sampled_records = 0
        self.watch_thread_id: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # `mark` hands its work to the thread: then all of this process's watching runs on one thread,
        # which the in-process driver leaves out of its own CPU.
        self._asked, self._answered = threading.Event(), threading.Event()
        self._question: Scope | None = None
        self._answer = 0
        self._ask_lock = threading.Lock()
        with self._lock:
            self._poll()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-watch", daemon=True)
        self._thread.start()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.taskstats.close()

    def _run(self) -> None:
        self.watch_thread_id = threading.get_native_id()
        while not self._stop.is_set():
            asked = self._asked.wait(POLL_S)
            with self._lock:
                self._drain()
                self._poll()
                if asked:
                    self._asked.clear()
                    self._answer = self._mark(self._question)
                    self._answered.set()

    # -- the bookkeeping, under the lock --

    def _set_process(self, pid: int, process: Process) -> None:
        old = self.processes.get(pid)
        if old is not None and old.ppid != process.ppid:
            self.children.get(old.ppid, set()).discard(pid)
        self.processes[pid] = process
        self.children.setdefault(process.ppid, set()).add(pid)

    def _drain(self) -> None:
        for record in self.taskstats.drain():
            self.sampled_records += record.sampled
            self.ledger.exited(record)
            known = self.processes.get(record.tgid)
            if known is None or not known.same_as(record.start_s):
                self._set_process(record.tgid, Process(record.ppid, record.comm, None, record.start_s))
            elif record.tid == record.tgid and record.comm != known.comm:  # it ran exec after it was seen
                self._set_process(
                    record.tgid, replace(known, comm=record.comm, label=self._exec_label(known, record.comm))
                )
            if record.tid == record.tgid:
                self.ended[record.tgid] = time.monotonic()
                if self.shims.get(record.tgid) is not None:
                    self.shim_exits.append((record.tgid, time.monotonic()))

    def _exec_label(self, known: Process, comm: str) -> str:
        """`runc init → dumb-init`; or, if it was seen between fork and exec, only its name now."""
        parent = self.processes.get(known.ppid)
        if parent is not None and parent.label == known.label:
            return comm
        return f"{known.label.split(' → ')[0]} → {comm}"

    def _alive(self, pid: int) -> bool:
        return pid in self.listed and pid not in self.ended

    def _poll(self) -> None:
        """Notes every process that appeared since the last poll, and what belongs to the containers."""
        current = {int(entry) for entry in os.listdir(PROC) if entry.isdigit()}
        for pid in current - self.listed:
            self._note(pid)
        self.listed = current
        self._find_shims()
        for pid, container_id in self.shims.items():
            known = container_id in self.labels
            if self._alive(pid) and (
                not known or (self._benchmarks(container_id) and container_id not in self.sandbox_keys)
            ):
                self._read_config(container_id)
        self._read_cgroups()

    def _note(self, pid: int) -> None:
        stat_text = _read(PROC / str(pid) / "stat")
        if stat_text is None:
            return
        stat = parse_stat(stat_text)
        start_s = self._boot_s + stat.starttime / self._ticks
        known = self.processes.get(pid)
        if known is not None and known.same_as(start_s) and pid in self.ended:
            return  # a zombie whose exit record came first
        self.ended.pop(pid, None)
        cgroup_text = _read(PROC / str(pid) / "cgroup")
        argv = (_read(PROC / str(pid) / "cmdline") or "").split("\0")
        cgroup = cgroup_path(cgroup_text) if cgroup_text else None
        process = Process(stat.ppid, stat.comm, cgroup, start_s, process_label(stat.comm, argv), tuple(argv[:16]))
        self._set_process(pid, process)
        self.shims.pop(pid, None)
        if stat.comm.startswith("containerd-shim"):
            self.candidates.add(pid)

    def _find_shims(self) -> None:
        """Which processes named like a shim are one. A shim daemon has its container's `-id` and no
        `start` (its launcher) or `delete`; a process seen between its fork and exec has its parent's
        name and command line, so each is looked at again until it runs something else or ends."""
        for pid in list(self.candidates):
            stat_text, argv_text = _read(PROC / str(pid) / "stat"), _read(PROC / str(pid) / "cmdline")
            if not self._alive(pid) or stat_text is None or argv_text is None:
                self.candidates.discard(pid)
                continue
            stat, argv = parse_stat(stat_text), argv_text.split("\0")
            if not stat.comm.startswith("containerd-shim"):
                self.candidates.discard(pid)
                self.shims.pop(pid, None)
                self._set_process(
                    pid, replace(self.processes[pid], comm=stat.comm, label=process_label(stat.comm, argv))
                )
                continue
            container_id = shim_container_id(argv)
            if container_id and not {"start", "delete"} & set(argv) and self.processes[pid].ppid not in self.shims:
                self.shims[pid] = container_id
                self._set_process(pid, replace(self.processes[pid], label=process_label(stat.comm, argv)))

    def _read_config(self, container_id: str) -> None:
        """The container's labels, and its network namespace once dockerd has written it (at start)."""
        text = _read(self.docker_root / "containers" / container_id / "config.v2.json")
        if not text:
            return
        config = json.loads(text)
        labels = (config.get("Config") or {}).get("Labels") or {}
        self.labels[container_id] = {str(k): str(v) for k, v in labels.items()}
        sandbox_key = str((config.get("NetworkSettings") or {}).get("SandboxKey") or "")
        if sandbox_key:
            self.sandbox_keys[container_id] = sandbox_key.rsplit("/", 1)[-1]

    def _descendants(self, roots: Iterable[int]) -> dict[int, int]:
        """Every live process below the live ones of `roots`: pid -> the root it is below. The walk goes
        through processes that ended: a live one stays noted below the parent it was first seen with."""
        found: dict[int, int] = {}
        visited: set[int] = set()
        queue = [(root, root) for root in roots if self._alive(root)]
        while queue:
            pid, root = queue.pop()
            if pid in visited:
                continue
            visited.add(pid)
            if self._alive(pid):
                found[pid] = root
            queue.extend((child, root) for child in self.children.get(pid, ()) if child not in visited)
        return found

    def _read_cgroups(self) -> None:
        """For each live process below a shim: its cgroup, until it is its container's (runsc's sandbox
        moves into it after it starts), and its command line if it was first seen before its exec; and
        each container cgroup's CPU so far (a cross-check of the ledger)."""
        ours = [pid for pid, container_id in self.shims.items() if self._benchmarks(container_id)]
        for pid, shim in self._descendants(ours).items():
            container_id, process = self.shims[shim], self.processes[pid]
            if pid == shim:
                continue
            parent = self.processes.get(process.ppid)
            if parent is not None and parent.label == process.label:  # seen between fork and exec
                stat_text, argv = _read(PROC / str(pid) / "stat"), _read(PROC / str(pid) / "cmdline")
                if stat_text and argv is not None:
                    comm = parse_stat(stat_text).comm
                    words = argv.split("\0")
                    process = replace(process, comm=comm, label=process_label(comm, words), args=tuple(words[:16]))
            if process.cgroup is None or container_id not in process.cgroup:
                text = _read(PROC / str(pid) / "cgroup")
                process = replace(process, cgroup=cgroup_path(text) if text else process.cgroup)
            if process != self.processes[pid]:
                self._set_process(pid, process)
            if process.cgroup and container_id in process.cgroup:
                usage = _cgroup_usage_ns(process.cgroup)
                if usage is not None:
                    self.cgroup_ns[container_id] = max(usage, self.cgroup_ns.get(container_id, 0))

    def _benchmarks(self, container_id: str) -> bool:
        """Whether a container is one of the benchmark's (a registered scope owns it): only theirs are
        looked at closely."""
        labels = self.labels.get(container_id)
        return labels is not None and any(scope.owner(labels) for scope in self.scopes)

    def register(self, scope: Scope) -> Scope:
        with self._lock:
            self.scopes.append(scope)
        return scope

    def _owned_shims(self, scope: Scope) -> dict[int, str]:
        return {pid: cid for pid, cid in self.shims.items() if cid in self.labels and scope.owner(self.labels[cid])}

    def _read_threads(self, pid: int) -> None:
        try:
            tids = os.listdir(PROC / str(pid) / "task")
        except OSError:
            return  # gone: its exit records say the rest
        for tid in tids:
            text = _read(PROC / str(pid) / "task" / tid / "schedstat")
            if text:
                self.ledger.observe(int(tid), pid, parse_schedstat(text))

    def _prune(self) -> None:
        """Forgets processes that ended over a minute ago; a live process below one is hung on its parent."""
        horizon = time.monotonic() - 60
        for pid in [pid for pid, at in self.ended.items() if at < horizon]:
            process = self.processes.pop(pid, None)
            del self.ended[pid]
            self.shims.pop(pid, None)
            orphans = self.children.pop(pid, set())
            if process is None:
                continue
            self.children.get(process.ppid, set()).discard(pid)
            for child in orphans:
                if child in self.processes:
                    self._set_process(child, replace(self.processes[child], ppid=process.ppid))

    # -- what the benchmark calls --

    def owned_shims(self, scope: Scope) -> dict[int, str]:
        with self._lock:
            return self._owned_shims(scope)

    def live_shims(self, scope: Scope) -> dict[int, str]:
        """The scope's shims running at the thread's last poll."""
        with self._lock:
            return {pid: cid for pid, cid in self._owned_shims(scope).items() if self._alive(pid)}

    def mark(self, scope: Scope | None) -> int:
        """Reads every thread of dockerd, containerd and the scope's live processes, then takes in every
        exit record so far; returns the mark for `account`. The watching thread does it."""
        with self._ask_lock:
            self._question = scope
            self._answered.clear()
            self._asked.set()
            if not self._answered.wait(60):
                raise RuntimeError("the CPU watcher's thread did not answer in 60 s")
            return self._answer

    def _mark(self, scope: Scope | None) -> int:
        pids = set(self.dockerd) | set(self.containerd)
        if scope is not None:
            pids |= set(scope.clients) | set(self._descendants(list(self._owned_shims(scope))))
        for pid in pids:
            self._read_threads(pid)
            known = self.processes.get(pid)
            comm = (_read(PROC / str(pid) / "comm") or "").strip()
            if known is not None and comm and comm != known.comm:  # it ran exec: named as at its exit
                self._set_process(pid, replace(known, comm=comm, label=self._exec_label(known, comm)))
        self._drain()
        return self.ledger.mark()

    def account(self, start: int, end: int, scope: Scope) -> Accounting:
        """The CPU of the scope's parts between two marks (the watching thread's own left out)."""
        with self._lock:
            cpu_ns = self.ledger.between(start, end, exclude={self.watch_thread_id or 0})
            shims = self._owned_shims(scope)
            keys = {*shims.values(), *(self.sandbox_keys[cid] for cid in shims.values() if cid in self.sandbox_keys)}
            components = classify(
                cpu_ns,
                self.processes,
                shims=shims,
                keys=keys,
                dockerd=self.dockerd,
                containerd=self.containerd,
                clients=scope.clients,
                client_children=scope.client_children,
            )
            return Accounting.of(cpu_ns, components, self.processes)

    def container_cgroup_ms(self, container_ids: Iterable[str]) -> float:
        with self._lock:
            return sum(self.cgroup_ns.get(cid, 0) for cid in container_ids) / 1e6

    def forget_before(self, mark: int) -> None:
        """Frees what intervals from `mark` on do not need."""
        with self._lock:
            self.ledger.forget_before(mark)
            self._prune()


def _boot_time() -> float:
    for line in (_read(PROC / "stat") or "").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return time.time() - time.monotonic()


def _cgroup_usage_ns(path: str) -> int | None:
    """A cgroup's CPU time so far: cgroup v1's cpuacct.usage, or v2's usage_usec."""
    relative = path.lstrip("/")
    text = _read(CGROUP / "cpuacct" / relative / "cpuacct.usage")
    if text is not None:
        return int(text)
    text = _read(CGROUP / relative / "cpu.stat")
    for line in (text or "").splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) * 1000
    return None


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)
