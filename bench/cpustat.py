"""The arithmetic of the CPU section (bench/cpu.py): /proc and taskstats records parsed, each thread's CPU
time kept as a series of observations, processes sorted into the parts of an execution, sums and ratios.

Pure functions and plain data, no I/O: what tests/test_bench.py covers. The reasons for the method are
in bench/cpu.py's docstring.
"""

from __future__ import annotations

import itertools
import struct
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The parts of an execution's CPU, in the order of the tables.
DOCKERD = "dockerd"
CONTAINERD = "containerd"
SHIM = "shim"
RUNTIME = "runtime"
CONTAINER = "container"
CLIENT = "client"  # the service process; for `docker run --rm`, the docker CLI
COMPONENTS = (DOCKERD, CONTAINERD, SHIM, RUNTIME, CONTAINER, CLIENT)
ENGINE = (DOCKERD, CONTAINERD)  # shared with every other user of the engine: their background is subtracted


# --- /proc ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat this section reads (times in clock ticks)."""

    pid: int
    comm: str
    ppid: int
    utime: int
    stime: int
    cutime: int
    cstime: int
    starttime: int  # clock ticks after boot


def parse_stat(text: str) -> ProcStat:
    """One /proc/<pid>/stat line. The command name is in parentheses and may itself hold spaces and
    parentheses, so the fields are counted from its last closing parenthesis."""
    open_at, close_at = text.index("("), text.rindex(")")
    rest = text[close_at + 2 :].split()
    # After the name: state, ppid, pgrp, session, tty_nr, tpgid, flags, minflt, cminflt, majflt, cmajflt,
    # utime, stime, cutime, cstime, priority, nice, num_threads, itrealvalue, starttime (fields 3..22).
    return ProcStat(
        pid=int(text[:open_at]),
        comm=text[open_at + 1 : close_at],
        ppid=int(rest[1]),
        utime=int(rest[11]),
        stime=int(rest[12]),
        cutime=int(rest[13]),
        cstime=int(rest[14]),
        starttime=int(rest[19]),
    )


def parse_schedstat(text: str) -> int:
    """/proc/<pid>/task/<tid>/schedstat: the first field is the thread's time on a CPU, in nanoseconds
    (the scheduler's own sum, not sampled at ticks)."""
    return int(text.split()[0])


def cgroup_path(text: str, controller: str = "cpuacct") -> str | None:
    """The path of `controller` in /proc/<pid>/cgroup (cgroup v1 `N:cpu,cpuacct:/path`; v2 `0::/path`)."""
    unified = None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def shim_container_id(argv: list[str]) -> str | None:
    """The container id in a containerd shim's command line (`-id <id>`)."""
    for flag, value in itertools.pairwise(argv):
        if flag in ("-id", "--id"):
            return value
    return None


# The subcommands of runc and runsc that containerd's shim runs; the first one in a command line names it.
_RUNTIME_VERBS = ("create", "start", "state", "update", "kill", "delete", "init", "boot", "gofer", "umount", "events")


def process_label(comm: str, argv: list[str]) -> str:
    """A short name for what a process runs: `runc create`, `runsc-sandbox boot`, `libnetwork-setkey`
    (Docker's network hook, a run of dockerd's own binary, named `exe`), or its name."""
    words = [word for word in argv if word]
    if not words:
        return comm
    program = words[0].rsplit("/", 1)[-1]
    if program in ("sh", "bash") and len(words) > 1:  # runsc's wrapper script in /var/lib/docker/runtimes
        program = f"{program} {words[1].rsplit('/', 1)[-1]}"
    verb = next((word for word in words[1:] if word in _RUNTIME_VERBS), None)
    if program.startswith("containerd-shim"):
        verb = next((word for word in ("start", "delete") if word in words), None)
        return f"containerd-shim {verb}" if verb else "containerd-shim"
    if program in ("runc", "runsc") or program.startswith(("runsc-", "sh ", "bash ")) or program == "exe":
        return f"{program} {verb}" if verb else program
    return program


# --- taskstats (generic netlink) -----------------------------------------------------------------------

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
TASKSTATS_CMD_GET = 1
TASKSTATS_CMD_NEW = 2
TASKSTATS_CMD_ATTR_REGISTER_CPUMASK = 3
TASKSTATS_CMD_ATTR_DEREGISTER_CPUMASK = 4
TASKSTATS_TYPE_STATS = 3
TASKSTATS_TYPE_AGGR_PID = 4  # one thread's record; AGGR_TGID (5) carries delay sums only, not CPU
_NLM_F_REQUEST = 1
_NLM_F_ACK = 4
NLMSG_ERROR = 2  # an acknowledgement (error 0) or a refusal (-errno)
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port
_GENL_HEADER = struct.Struct("=BBH")  # command, version, reserved
_ATTR_HEADER = struct.Struct("=HH")  # length, type
# Offsets in struct taskstats (linux/taskstats.h), stable since version 11, the first with ac_tgid.
_TS_VERSION, _TS_CPU_RUN_VIRTUAL_TOTAL, _TS_COMM, _TS_PID, _TS_UTIME, _TS_BTIME64, _TS_TGID = (
    0,
    72,
    80,
    128,
    152,
    344,
    368,
)
_TS_COMM_LEN = 32
MIN_TASKSTATS_VERSION = 11


def _align(length: int) -> int:
    return (length + 3) & ~3


def netlink_attribute(kind: int, payload: bytes) -> bytes:
    length = _ATTR_HEADER.size + len(payload)
    return _ATTR_HEADER.pack(length, kind) + payload + b"\0" * (_align(length) - length)


def genl_message(family: int, command: int, attributes: bytes, sequence: int, *, ack: bool = False) -> bytes:
    body = _GENL_HEADER.pack(command, 1, 0) + attributes
    flags = _NLM_F_REQUEST | (_NLM_F_ACK if ack else 0)
    return _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(body), family, flags, sequence, 0) + body


def acknowledgement(datagram: bytes, sequence: int) -> int | None:
    """The error code (0: done, else -errno) the kernel answered the request `sequence` with, if the
    datagram holds that answer."""
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(datagram):
        length, kind, _, answered, _ = _NLMSG_HEADER.unpack_from(datagram, offset)
        if length < _NLMSG_HEADER.size:
            break
        if kind == NLMSG_ERROR and answered == sequence and length >= _NLMSG_HEADER.size + 4:
            return int(struct.unpack_from("=i", datagram, offset + _NLMSG_HEADER.size)[0])
        offset += _align(length)
    return None


def netlink_attributes(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of each attribute in `data`; the nested and byte-order flags are masked off."""
    found, offset = [], 0
    while offset + _ATTR_HEADER.size <= len(data):
        length, kind = _ATTR_HEADER.unpack_from(data, offset)
        if length < _ATTR_HEADER.size:
            break
        found.append((kind & 0x3FFF, data[offset + _ATTR_HEADER.size : offset + length]))
        offset += _align(length)
    return found


def netlink_messages(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload after the netlink header) of each message in one datagram."""
    found, offset = [], 0
    while offset + _NLMSG_HEADER.size <= len(data):
        length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
        if length < _NLMSG_HEADER.size:
            break
        found.append((kind, data[offset + _NLMSG_HEADER.size : offset + length]))
        offset += _align(length)
    return found


def family_id(reply: bytes) -> int | None:
    """The generic netlink family id in a CTRL_CMD_GETFAMILY reply; None if the reply is an error."""
    for kind, payload in netlink_messages(reply):
        if kind != GENL_ID_CTRL:
            continue
        for attribute, value in netlink_attributes(payload[_GENL_HEADER.size :]):
            if attribute == CTRL_ATTR_FAMILY_ID:
                return int(struct.unpack_from("=H", value)[0])
    return None


@dataclass(frozen=True)
class ExitRecord:
    """What the kernel reports as a thread exits: who it was and its whole time on a CPU."""

    tid: int
    tgid: int
    ppid: int  # the process's parent (its thread group's), at the exit
    comm: str
    cpu_ns: int
    start_s: int = 0  # when the process began, seconds since the epoch (tells a reused pid apart)
    sampled: bool = False  # cpu_ns is utime+stime (tick-sampled), the kernel gave no scheduler sum


def parse_taskstats(stats: bytes) -> ExitRecord | None:
    """One struct taskstats; None for a version without the thread group id."""
    if len(stats) < _TS_TGID + 4 or struct.unpack_from("=H", stats, _TS_VERSION)[0] < MIN_TASKSTATS_VERSION:
        return None
    virtual_ns = struct.unpack_from("=Q", stats, _TS_CPU_RUN_VIRTUAL_TOTAL)[0]
    utime_us, stime_us = struct.unpack_from("=QQ", stats, _TS_UTIME)
    pid, ppid = struct.unpack_from("=II", stats, _TS_PID)
    comm = stats[_TS_COMM : _TS_COMM + _TS_COMM_LEN].split(b"\0", 1)[0].decode(errors="replace")
    sampled = virtual_ns == 0 and utime_us + stime_us > 0
    return ExitRecord(
        tid=pid,
        tgid=struct.unpack_from("=I", stats, _TS_TGID)[0],
        ppid=ppid,
        comm=comm,
        cpu_ns=(utime_us + stime_us) * 1000 if sampled else virtual_ns,
        start_s=struct.unpack_from("=Q", stats, _TS_BTIME64)[0],
        sampled=sampled,
    )


def exit_records(datagram: bytes, family: int) -> list[ExitRecord]:
    """The per-thread exit records in one datagram from the taskstats family."""
    records = []
    for kind, payload in netlink_messages(datagram):
        if kind != family or payload[:1] != bytes([TASKSTATS_CMD_NEW]):
            continue
        for attribute, nested in netlink_attributes(payload[_GENL_HEADER.size :]):
            if attribute != TASKSTATS_TYPE_AGGR_PID:
                continue
            for inner, stats in netlink_attributes(nested):
                if inner == TASKSTATS_TYPE_STATS and (record := parse_taskstats(stats)) is not None:
                    records.append(record)
    return records


# --- the ledger: each thread's CPU time as a series of observations ---------------------------------


@dataclass
class _Thread:
    tgid: int
    observations: list[tuple[int, int]] = field(default_factory=list)  # (sequence, cpu_ns)
    exited: bool = False


class Ledger:
    """Every observation of a thread's CPU time, in order: a reading of its schedstat while it runs, or
    its exit record. The CPU between two marks is, summed over threads, the last value seen by the later
    mark minus the last value seen by the earlier one (none seen yet: 0). So a thread alive throughout
    counts its growth, one born in between counts from 0, and one that exited counts up to its exit:
    nothing twice and nothing lost, at whatever moment the observations were made.

    A reading after the thread's exit record (a zombie not reaped yet) changes nothing; a thread id
    seen again in another thread group after its exit (the kernel reused it) starts a new thread.
    """

    def __init__(self) -> None:
        self._sequence = 0
        self._threads: dict[tuple[int, int], _Thread] = {}
        self._generation: dict[int, int] = defaultdict(int)

    def mark(self) -> int:
        """A point between observations: every observation so far is at or before it."""
        self._sequence += 1
        return self._sequence

    def _current(self, tid: int, tgid: int) -> _Thread:
        key = (tid, self._generation[tid])
        thread = self._threads.get(key)
        if thread is not None and thread.exited:
            self._generation[tid] += 1
            key, thread = (tid, self._generation[tid]), None
        if thread is None:
            thread = self._threads[key] = _Thread(tgid)
        return thread

    def observe(self, tid: int, tgid: int, cpu_ns: int) -> None:
        last = self._threads.get((tid, self._generation[tid]))
        if last is not None and last.exited and last.tgid == tgid:
            return  # its exit record came first: the reading is of a zombie
        self._sequence += 1
        self._current(tid, tgid).observations.append((self._sequence, cpu_ns))

    def exited(self, record: ExitRecord) -> None:
        self._sequence += 1
        thread = self._current(record.tid, record.tgid)
        thread.observations.append((self._sequence, record.cpu_ns))
        thread.exited = True

    def between(self, start: int, end: int, exclude: frozenset[int] | set[int] = frozenset()) -> dict[int, int]:
        """CPU nanoseconds per thread group between two marks; `exclude`: thread ids left out."""
        totals: dict[int, int] = defaultdict(int)
        for (tid, _), thread in self._threads.items():
            if tid in exclude:
                continue
            grown = _value_at(thread.observations, end) - _value_at(thread.observations, start)
            if grown:
                totals[thread.tgid] += grown
        return dict(totals)

    def forget_before(self, mark: int) -> None:
        """Drops what no interval starting at or after `mark` needs: threads that exited before it, and
        every other thread's observations before it but the last."""
        for key, thread in list(self._threads.items()):
            if thread.exited and thread.observations[-1][0] < mark:
                del self._threads[key]
                continue
            earlier = [i for i, (sequence, _) in enumerate(thread.observations) if sequence <= mark]
            if len(earlier) > 1:
                del thread.observations[: earlier[-1]]


def _value_at(observations: list[tuple[int, int]], mark: int) -> int:
    value = 0
    for sequence, cpu_ns in observations:
        if sequence > mark:
            break
        value = cpu_ns
    return value


# --- which part of an execution a process is ------------------------------------------------------


@dataclass(frozen=True)
class Process:
    """What is known of one process: its parent, its name, and (if it was seen running) its cgroup."""

    ppid: int
    comm: str
    cgroup: str | None = None
    start_s: float = 0.0  # seconds since the epoch
    label: str = ""  # what it runs, from its command line (see `process_label`); else its name
    args: tuple[str, ...] = ()  # its command line, if it was seen running

    def same_as(self, start_s: float) -> bool:
        """Whether a process that began at `start_s` is this one rather than a later one with its pid
        (taskstats gives whole seconds; a pid is not reused within seconds)."""
        return abs(self.start_s - start_s) <= 2


def classify(
    tgids: Iterable[int],
    processes: Mapping[int, Process],
    *,
    shims: Mapping[int, str],
    dockerd: Iterable[int],
    containerd: Iterable[int],
    clients: Iterable[int] = (),
    client_children: tuple[int, str] | None = None,
    keys: Iterable[str] = (),
) -> dict[int, str]:
    """The component of each thread group that belongs to the contender; the others are left out.

    `shims` are the contender's containerd shims (pid -> container id). Below a shim, a process is the
    container's if it ran in a cgroup named after the container, descends from one that did, or is one
    of runc's init stages (`runc:[0:PARENT]` and on: the container's first process being set up);
    everything else below it, and every run of the runtime's command or of its hooks wherever it ran
    (see `is_runtime_invocation`), is the runtime's.
    A child that dockerd or containerd runs for one of the contender's containers counts with them:
    the launcher a shim was first seen below, or one whose command line names one of `keys` (the
    containers' ids, their network namespaces: dockerd's `set-ipv6` re-exec). `client_children` (pid,
    name): a child of that process by that name is a client (the benchmark's own `docker` CLIs).
    """
    fixed = dict.fromkeys(dockerd, DOCKERD) | dict.fromkeys(containerd, CONTAINERD) | dict.fromkeys(clients, CLIENT)
    launchers = {processes[shim].ppid for shim in shims if shim in processes}
    named = tuple(keys)
    found: dict[int, str] = {}
    for tgid in tgids:
        process = processes.get(tgid)
        parent = fixed.get(process.ppid) if process is not None else None
        if process is not None and parent in ENGINE and tgid not in fixed:
            if tgid in launchers or any(key in arg for arg in process.args for key in named):
                found[tgid] = parent
            continue
        component = _component(tgid, processes, shims, fixed, client_children)
        if component is not None:
            found[tgid] = component
    return found


def _component(
    tgid: int,
    processes: Mapping[int, Process],
    shims: Mapping[int, str],
    fixed: dict[int, str],
    client_children: tuple[int, str] | None,
) -> str | None:
    if tgid in fixed:
        return fixed[tgid]
    if tgid in shims:
        return SHIM
    first = processes.get(tgid)
    invocation = first is not None and is_runtime_invocation(first.label)
    in_container = False
    pid, seen = tgid, set()
    while pid not in seen:
        seen.add(pid)
        process = processes.get(pid)
        if process is None:
            return None
        if not is_runtime_invocation(process.label) and _runs_in_container(process, shims):
            in_container = True
        parent = process.ppid
        if parent in shims:
            return CONTAINER if in_container and not invocation else RUNTIME
        if client_children is not None and (parent, process.comm) == client_children and pid == tgid:
            return CLIENT
        pid = parent
    return None


_INVOKED = {"create", "start", "state", "update", "kill", "delete", "events"}


def is_runtime_invocation(label: str) -> bool:
    """A run of the runtime's command for one step (`runc create`, runsc's wrapper script) or of a hook
    it runs (Docker's `libnetwork-setkey`): the runtime's cost even where it ran in the container's
    cgroup (`runsc create` joins it, and its hooks with it)."""
    words = label.split()
    if not words:
        return False
    if words[0] in ("runc", "runsc"):
        return len(words) == 1 or words[1] in _INVOKED
    return (words[0] in ("sh", "bash") and words[1:2] == ["runsc"]) or words[0] == "libnetwork-setkey"


def _runs_in_container(process: Process, shims: Mapping[int, str]) -> bool:
    return process.comm.startswith("runc:[") or any(_in_cgroup_of(process, cid) for cid in shims.values())


def _in_cgroup_of(process: Process, container_id: str) -> bool:
    return process.cgroup is not None and container_id in process.cgroup


def by_component(cpu_ns: Mapping[int, int], components: Mapping[int, str]) -> dict[str, float]:
    """Milliseconds per component (every component present, 0 when none of its processes ran)."""
    totals = dict.fromkeys(COMPONENTS, 0.0)
    for tgid, nanoseconds in cpu_ns.items():
        component = components.get(tgid)
        if component is not None:
            totals[component] += nanoseconds / 1e6
    return totals


def by_process(
    cpu_ns: Mapping[int, int], components: Mapping[int, str], processes: Mapping[int, Process]
) -> dict[str, float]:
    """Milliseconds per `component: process label` (dockerd's and containerd's own threads left out)."""
    totals: dict[str, float] = defaultdict(float)
    for tgid, nanoseconds in cpu_ns.items():
        component = components.get(tgid)
        process = processes.get(tgid)
        if component is None or process is None or (component in ENGINE and process.comm == component):
            continue
        totals[f"{component}: {process.label or process.comm}"] += nanoseconds / 1e6
    return dict(totals)


@dataclass(frozen=True)
class Accounting:
    """The CPU of a contender's parts over one interval: ms per component and per process label, and
    how many processes (thread groups) of each component ran."""

    cpu_ms: dict[str, float]
    by_process: dict[str, float]
    processes: dict[str, int]

    @classmethod
    def of(
        cls, cpu_ns: Mapping[int, int], components: Mapping[int, str], processes: Mapping[int, Process]
    ) -> Accounting:
        counts = dict.fromkeys(COMPONENTS, 0)
        for tgid in cpu_ns:
            if tgid in components:
                counts[components[tgid]] += 1
        return cls(by_component(cpu_ns, components), by_process(cpu_ns, components, processes), counts)


# --- per execution ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One measured batch: CPU per component (ms) over its executions and its duration."""

    executions: int
    seconds: float
    cpu_ms: dict[str, float]


def per_execution(
    windows: Iterable[Window], background_ms_per_s: Mapping[str, float], *, clamp: bool = True
) -> dict[str, float]:
    """CPU ms per execution by component and in total, over all windows; the background rate of the
    shared engine processes (measured while nothing of the benchmark ran) times each window's length is
    subtracted from theirs, never below zero with `clamp`. Without it, parts of a whole (the phases of
    an execution) keep their sign, so that their sum is not biased upwards."""
    totals = dict.fromkeys(COMPONENTS, 0.0)
    executions = 0
    for window in windows:
        executions += window.executions
        for component in COMPONENTS:
            value = window.cpu_ms.get(component, 0.0)
            if component in ENGINE:
                value -= background_ms_per_s.get(component, 0.0) * window.seconds
            totals[component] += value
    if executions == 0:
        return {**totals, "total": 0.0}
    result = {component: (max(0.0, value) if clamp else value) / executions for component, value in totals.items()}
    return {**result, "total": sum(result.values())}


def background_rate(windows: Iterable[Window]) -> dict[str, float]:
    """The engine processes' CPU ms per second over idle windows."""
    seconds = 0.0
    totals = dict.fromkeys(ENGINE, 0.0)
    for window in windows:
        seconds += window.seconds
        for component in ENGINE:
            totals[component] += window.cpu_ms.get(component, 0.0)
    return {component: (value / seconds if seconds else 0.0) for component, value in totals.items()}
