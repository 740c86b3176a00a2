"""Where a JavaScript sandbox's start goes in system calls, and what each kind costs under each runtime.

Two parts, both with the sandbox image's own node, runner and start-up snapshot:

1. **Counts.** The image's root fs is exported once and the runner run in a chroot of it as uid 1001,
   under `strace -f -c`: once with its stdin at EOF (the start: node, the snapshot, the gate, the ready
   line, then its refusal of an empty payload) and once with the payload of `console.log(1)` (the start
   and one small execution; the execution is the difference). The same binary and files make the same
   calls under runc; gVisor answers each of them itself. The calls are grouped by kind, beside the
   process's minor page faults and CPU (`getrusage`, the median of `rounds` runs without strace).
2. **Costs.** In real containers of the image, under runc and runsc, the CPU of every process of the
   container (its cgroup's `cpuacct.usage`, read at the program's ready line) for node doing nothing,
   node making 10,000 `fstat` calls, and node touching 64 MiB page by page: the differences are what a
   trapped system call and a page fault cost, beside the runner's own start to its ready line.
"""

from __future__ import annotations

import re
import resource
import shutil
import statistics
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import docker

from metaagent.executions import new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript import JAVASCRIPT
from metaagent.sandbox.engine import Engine
from metaagent.sandbox.execute import payload, prepare, wait_ready
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime
from metaagent.tools.code_interpreter import DEFAULT_MEMORY_MB

SANDBOX_USER = "1001:1001"
GROUPS: dict[str, tuple[str, ...]] = {
    "memory (mmap, mprotect, munmap, madvise, brk)": ("mmap", "mprotect", "munmap", "madvise", "brk", "mremap"),
    "files (open, stat, read, close, readlink, ...)": (
        "openat", "open", "close", "read", "pread64", "newfstatat", "fstat", "statx", "lseek", "readlink",
        "readlinkat", "access", "faccessat2", "getdents64", "fcntl", "ioctl",
    ),
    "threads and waits (futex, clone, epoll)": (
        "futex", "clone", "clone3", "set_robust_list", "rseq", "sched_yield", "sched_getaffinity", "epoll_wait",
        "epoll_pwait", "epoll_ctl", "epoll_create1", "eventfd2", "exit", "exit_group", "wait4", "set_tid_address",
    ),
    "signals": ("rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "kill", "tgkill"),
}  # fmt: skip
OTHER = "other (write, pipes, sockets, process, time)"
_READY = "process.stderr.write('metaagent-runner: ready\\n'); process.stdin.resume()"
PROBES = {
    "node, nothing": f"{_READY}",
    "node, 10,000 fstat calls": f"const fs = require('fs'); for (let i = 0; i < 10000; i++) fs.fstatSync(0); {_READY}",
    "node, 64 MiB touched page by page": (
        f"const b = Buffer.alloc(64 << 20); for (let i = 0; i < b.length; i += 4096) b[i] = 1; {_READY}"
    ),
}
RUNNER_START = "the runner, to its ready line"


def _group_of(name: str) -> str:
    return next((group for group, names in GROUPS.items() if name in names), OTHER)


def parse_strace_summary(text: str) -> Counter[str]:
    """Calls per system call from `strace -c`'s table (the `errors` column may be empty)."""
    calls: Counter[str] = Counter()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and re.fullmatch(r"\d+\.\d+", fields[0]) and fields[-1] != "total":
            calls[fields[-1]] += int(fields[3])
    return calls


def grouped(calls: Counter[str]) -> dict[str, int]:
    groups: dict[str, int] = defaultdict(int)
    for name, count in calls.items():
        groups[_group_of(name)] += count
    return {group: groups.get(group, 0) for group in (*GROUPS, OTHER)}


def _export_rootfs(client: docker.DockerClient, image: str, into: Path) -> None:
    container = client.containers.create(image, command=["/usr/bin/node"])
    try:
        with subprocess.Popen(["tar", "-x", "-C", str(into)], stdin=subprocess.PIPE) as tar:
            assert tar.stdin is not None
            for chunk in container.export():
                tar.stdin.write(cast(bytes, chunk))  # the stubs say str; the engine sends the tar's bytes
            tar.stdin.close()
            if tar.wait() != 0:
                raise RuntimeError("tar could not unpack the image's root fs")
    finally:
        container.remove(force=True)


def _runner_argv(rootfs: Path) -> list[str]:
    command = JAVASCRIPT.runner_command(DEFAULT_MEMORY_MB)
    return ["chroot", f"--userspec={SANDBOX_USER}", str(rootfs), *command]


def _run(argv: list[str], stdin: bytes) -> tuple[float, int]:
    """(CPU ms, minor page faults) of one run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu_s * 1000, after.ru_minflt - before.ru_minflt


def _counts(rootfs: Path, stdin: bytes, rounds: int, workdir: Path) -> dict[str, Any]:
    argv = _runner_argv(rootfs)
    summary = workdir / "strace.txt"
    subprocess.run(
        ["strace", "-f", "-c", "-o", str(summary), *argv], input=stdin, capture_output=True, check=False, timeout=120
    )
    calls = parse_strace_summary(summary.read_text())
    runs = [_run(argv, stdin) for _ in range(rounds)]
    return {
        "calls": dict(calls),
        "groups": grouped(calls),
        "total": sum(calls.values()),
        "cpu_ms": statistics.median(cpu for cpu, _ in runs),
        "minor_faults": statistics.median(faults for _, faults in runs),
    }


async def _container_cpu_ms(engine: Engine, image: str, runtime: Runtime, command: list[str] | None) -> float:
    """CPU of every process of a container from its create to its ready line (its cgroup's)."""
    spec = container_spec(new_execution_id(), image, DEFAULT_MEMORY_MB, 2.0, command=command, runtime=runtime)
    prepared = await prepare(engine, spec, start=True)
    try:
        if not await wait_ready(prepared):
            raise RuntimeError(f"no ready line: {prepared.output.stderr.text()[:300]!r}")
        used_s = engine.cpu_control.used_s(prepared.container_id)
        if used_s is None:
            raise RuntimeError("the container's cpuacct cgroup cannot be read (cgroup v1 and root are needed)")
        return used_s * 1000
    finally:
        prepared.sock.close()
        await engine.remove(prepared.container_id)


async def _costs(image: str, runtimes: list[Runtime], rounds: int) -> dict[str, dict[str, float]]:
    engine = Engine()
    try:
        medians: dict[str, dict[str, float]] = {}
        for runtime in runtimes:
            samples: dict[str, list[float]] = defaultdict(list)
            for _ in range(rounds):  # interleaved, so that a change in the machine's load touches every probe
                samples[RUNNER_START].append(await _container_cpu_ms(engine, image, runtime, None))
                for name, code in PROBES.items():
                    command = ["/usr/bin/node", "-e", code]
                    samples[name].append(await _container_cpu_ms(engine, image, runtime, command))
            medians[runtime.name] = {name: statistics.median(values) for name, values in samples.items()}
        return medians
    finally:
        engine.close()


def measure(image: str, *, runsc: bool, rounds: int, progress: Callable[[str], None]) -> dict[str, Any]:
    if shutil.which("strace") is None:
        raise RuntimeError("the syscalls section needs strace (apt-get install strace)")
    client = docker.from_env()
    with tempfile.TemporaryDirectory(prefix="metaagent-bench-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        rootfs.mkdir()
        _export_rootfs(client, image, rootfs)
        progress("syscalls: counting the runner's calls under strace")
        start = _counts(rootfs, b"", rounds, Path(tmp))
        with_code = _counts(rootfs, payload("console.log(1)", None), rounds, Path(tmp))
    client.close()
    progress("syscalls: the CPU of a trapped call and of a page fault, per runtime")
    costs = anyio.run(_costs, image, [RUNC, RUNSC] if runsc else [RUNC], rounds)
    return {"image": image, "rounds": rounds, "start": start, "start_and_execution": with_code, "costs": costs}


def lines(result: dict[str, Any]) -> list[str]:
    """The section's tables, as the README has them."""
    start, both = result["start"], result["start_and_execution"]
    out = [
        f"System calls of the runner (chroot of {result['image']}, strace -f -c; CPU and faults: median of "
        f"{result['rounds']} runs without strace)",
        "",
        "| kind | start (to ready, then EOF) | start and `console.log(1)` | the execution |",
        "|---|---|---|---|",
    ]
    for group in (*GROUPS, OTHER):
        a, b = start["groups"][group], both["groups"][group]
        out.append(f"| {group} | {a:,} | {b:,} | {b - a:,} |")
    out.append(f"| all calls | {start['total']:,} | {both['total']:,} | {both['total'] - start['total']:,} |")
    out.append(
        f"| minor page faults | {start['minor_faults']:,.0f} | {both['minor_faults']:,.0f} | "
        f"{both['minor_faults'] - start['minor_faults']:,.0f} |"
    )
    out.append(
        f"| CPU on the host (no sandbox) | {start['cpu_ms']:.0f} ms | {both['cpu_ms']:.0f} ms | "
        f"{both['cpu_ms'] - start['cpu_ms']:.0f} ms |"
    )
    costs = result["costs"]
    runtimes = list(costs)
    out += [
        "",
        f"CPU of the container's processes to the ready line (cgroup; median of {result['rounds']} interleaved rounds)",
        "",
        "| program | " + " | ".join(runtimes) + " |",
        "|---|" + "---|" * len(runtimes),
    ]
    for name in (RUNNER_START, *PROBES):
        out.append(f"| {name} | " + " | ".join(f"{costs[r][name]:.0f} ms" for r in runtimes) + " |")
    for runtime in runtimes:
        row = costs[runtime]
        per_call_us = (row["node, 10,000 fstat calls"] - row["node, nothing"]) * 1000 / 10_000
        per_fault_us = (row["node, 64 MiB touched page by page"] - row["node, nothing"]) * 1000 / (64 * 256)
        out.append(f"- {runtime}: {per_call_us:.1f} µs a call, {per_fault_us:.2f} µs a page touched")
    return out
