"""One execution in one fresh container: create, attach, start (or take those three from the warm pool),
wait for the runner's ready line, hold the container to its CPU share, hand over the code, watch the
clock, read the capped output, classify how it ended, and remove the container on every path.

The runner outside the process is what enforces time and output: SIGTERM at the deadline (dumb-init
forwards it to node), SIGKILL `grace_s` later, and bytes counted on the stream itself, where no
JavaScript can write around them.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from metaagent.errors import sole_error
from metaagent.executions import Execution
from metaagent.latch import Latch, first_of
from metaagent.sandbox.engine import ContainerSpec, Engine, sock_recv, sock_sendall
from metaagent.sandbox.output import CappedBuffer, Demultiplexer, OutputSink

STDOUT_CAP = 50 * 1024
STDERR_CAP = 25 * 1024
# The runner's first write, on stderr, once node and the module gate are loaded (runner.js says the same).
RUNNER_READY = b"metaagent-runner: ready\n"
# How long a runner may take to load: far more than it needs on a loaded machine, and still a bound.
START_TIMEOUT_S = 60.0
# After SIGKILL the engine reports the exit within milliseconds; this only bounds a misbehaving engine.
_EXIT_AFTER_KILL_S = 30.0
_DRAIN_AFTER_EXIT_S = 5.0
_SIGNAL_EXITS = 128  # an exit code from here up is a signal's
_SIGKILL_EXIT = _SIGNAL_EXITS + 9


@dataclass(frozen=True)
class Outcome:
    container_id: str
    exit_code: int | None
    stdout: CappedBuffer
    stderr: CappedBuffer
    timed_out: bool
    oom_killed: bool
    killed: bool
    duration_ms: int
    told_end: bool = False  # the runner told the program's end, and the answer did not wait for the container's


@dataclass(frozen=True)
class RunnerEgress:
    """What the runner needs to route node's http, https and fetch through an execution's tunnel socket."""

    socket_path: str  # inside the container
    max_tunnels: int  # the runner queues connections past this, rather than have the service refuse them
    extra_ca_pem: bytes = b""  # trusted besides the image's CA bundle


def _header(fields: dict[str, object], egress: RunnerEgress | None) -> tuple[bytes, bytes]:
    """The runner's JSON header line (with the egress fields) and the extra CA PEMs that follow the body."""
    extra_ca = b""
    if egress is not None:
        extra_ca = egress.extra_ca_pem
        fields = {
            **fields,
            "egress_socket": egress.socket_path,
            "egress_max_tunnels": egress.max_tunnels,
            "extra_ca_bytes": len(extra_ca),
        }
    return json.dumps(fields).encode() + b"\n", extra_ca


def payload(code: str, stdin: str | None, egress: RunnerEgress | None = None, end_token: str | None = None) -> bytes:
    """The runner's stdin protocol: a JSON header line, the code, the program's stdin, then extra CA PEMs.

    With `end_token`, the runner tells its program's end on both streams (`output.EndWatch`): only a
    runner whose program is its child does, as it alone knows when the program has ended."""
    code_bytes = code.encode("utf-8")
    stdin_bytes = (stdin or "").encode("utf-8")
    fields: dict[str, object] = {"code_bytes": len(code_bytes), "stdin_bytes": len(stdin_bytes)}
    if end_token is not None:
        fields["end_token"] = end_token
    header, extra_ca = _header(fields, egress)
    return header + code_bytes + stdin_bytes + extra_ca


def session_payload(egress: RunnerEgress | None, wire_socket: str) -> bytes:
    """What makes a started runner a session's: its header (and extra CAs); requests follow (session_wire)
    on the socket at `wire_socket`, once the supervisor connects (wire_socket.py)."""
    header, extra_ca = _header({"session": True, "wire_socket": wire_socket}, egress)
    return header + extra_ca


# Takes a container whose program has ended, to remove it in the background; False when it cannot.
Retire = Callable[[str], bool]


def _ended_by_itself(code: int | None) -> bool:
    """A told exit the answer may rest on: not a signal's (128 + n), which may be the OOM killer's, and
    which only the engine can tell apart."""
    return code is not None and code < _SIGNAL_EXITS


def _told_outcome(prepared: Prepared, *, execution_time_ms: int) -> Outcome:
    output = prepared.output
    output.finish()
    return Outcome(
        container_id=prepared.container_id,
        exit_code=output.told_exit_code,
        stdout=output.stdout,
        stderr=output.stderr,
        timed_out=False,
        oom_killed=False,
        killed=False,
        duration_ms=execution_time_ms,
        told_end=True,
    )


@dataclass
class Prepared:
    """A created container, its attach socket and the reader of its output; `started` once started."""

    container_id: str
    sock: socket.socket
    output: Demultiplexer
    started: bool
    cpus: float  # the execution's CPU limit
    cpus_limited: bool  # whether the container is held to `cpus` yet (see ContainerSpec.start_cpus)

    async def limit_cpus(self, engine: Engine) -> None:
        """Holds the container to its CPU limit; done before any user code is handed over."""
        if not self.cpus_limited:
            await engine.limit_cpus(self.container_id, self.cpus)
            self.cpus_limited = True

    async def send(self, data: bytes) -> None:
        """Writes to the container's stdin; OSError once the container is gone."""
        await sock_sendall(self.sock, data)

    async def read_some(self) -> bool:
        """Reads what the stream has (waiting for it); False at the end of the stream.

        Always yields to the event loop: asyncio's sock_recv returns at once while the socket has data,
        so a container that never stops writing would otherwise hold the loop for every other caller.
        One read is at most 64 KiB, so a container costs the loop a bounded slice per turn."""
        await anyio.lowlevel.checkpoint()
        try:
            chunk = await sock_recv(self.sock, 65536)
        except OSError:
            return False  # the engine closed the stream under us: the container is gone
        self.output.feed(chunk)
        return bool(chunk)


async def _attach_shielded(engine: Engine, container_id: str) -> socket.socket:
    """The attach, seen through: one abandoned halfway would return a socket nobody closes."""
    with anyio.CancelScope(shield=True):
        sock = await engine.attach(container_id)
    return sock  # noqa: RET504 (a return inside the scope reads to mypy as a missing return: scopes may swallow)


async def prepare(engine: Engine, spec: ContainerSpec, *, start: bool, ready_marker: bytes = RUNNER_READY) -> Prepared:
    """Creates and attaches (and with `start`, starts) a container; removes it again if that fails."""
    with anyio.CancelScope(shield=True):  # a create abandoned halfway would leave a container nobody knows
        container_id = await engine.create(spec)
    sock: socket.socket | None = None
    try:
        sock = await _attach_shielded(engine, container_id)
        if start:
            await engine.start(container_id)
    except BaseException:
        if sock is not None:
            sock.close()
        with anyio.CancelScope(shield=True):
            await engine.remove_failed(container_id)
        raise
    output = Demultiplexer(STDOUT_CAP, STDERR_CAP, ready_marker)
    return Prepared(container_id, sock, output, start, spec.cpus, cpus_limited=spec.start_cpus is None)


async def wait_ready(prepared: Prepared) -> bool:
    """Reads until the runner says it is ready for its payload; False if it failed or the stream ended."""
    with anyio.move_on_after(START_TIMEOUT_S):
        while not prepared.output.ready and not prepared.output.start_failed:
            if not await prepared.read_some():
                break
    return prepared.output.ready


async def execute(
    engine: Engine,
    spec: ContainerSpec,
    data: bytes,
    execution: Execution,
    *,
    timeout_s: float,
    grace_s: float,
    prepared: Prepared | None = None,
    ready_marker: bytes = RUNNER_READY,
    sink: OutputSink | None = None,
    end_token: str | None = None,
    retire: Retire | None = None,
) -> Outcome:
    """Runs one payload in `prepared` (a warm container) or in a container created now from `spec`.

    Either way the container serves this execution only, and is removed before this returns, or, when the
    runner told the program's end (`end_token`, the payload's) and `retire` takes the container, after.
    With `sink`, the output goes there too as it comes, and `sink.started()` is called as the code is
    handed over.
    """
    execution.state = "starting"
    if prepared is None:
        prepared = await prepare(engine, spec, start=False, ready_marker=ready_marker)
    execution.container_id = prepared.container_id
    if end_token is not None:
        prepared.output.expect_end(end_token)
    outcome: Outcome | None = None
    try:
        outcome = await _run(engine, prepared, data, execution, timeout_s=timeout_s, grace_s=grace_s, sink=sink)
        return outcome
    finally:
        prepared.sock.close()
        with anyio.CancelScope(shield=True):
            if outcome is not None and outcome.told_end and retire is not None and retire(prepared.container_id):
                pass  # removed in the background: the container's program has ended
            elif prepared.output.ready:
                await engine.remove(prepared.container_id)
            else:  # the runner never started: what a failed start may leave goes too
                await engine.remove_failed(prepared.container_id)


async def _run(
    engine: Engine,
    prepared: Prepared,
    data: bytes,
    execution: Execution,
    *,
    timeout_s: float,
    grace_s: float,
    sink: OutputSink | None,
) -> Outcome:
    container_id, sock, output = prepared.container_id, prepared.sock, prepared.output
    if sink is not None:
        output.listen(sink.output)
    exited, settled, drained, told = Latch(), Latch(), Latch(), Latch()
    status: list[int] = []
    if not prepared.started:
        await engine.start(container_id)

    async def watch_exit() -> None:
        status.append(await engine.wait(container_id))
        exited.set()

    async def pump() -> None:
        try:
            while await prepared.read_some():
                if output.ready or output.start_failed:
                    settled.set()
                if _ended_by_itself(output.told_exit_code):
                    told.set()
        finally:
            drained.set()

    timed_out = killed = False
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(watch_exit)
            group.start_soon(pump)
            if not output.ready:  # a cold container: the clock starts once its runner waits for the code
                with anyio.move_on_after(START_TIMEOUT_S):
                    await first_of(settled, exited, drained, execution.kill_requested)
            if output.ready:  # otherwise the runner failed to start: its exit and stderr say why
                await prepared.limit_cpus(engine)
                if sink is not None:
                    sink.started()
                try:
                    await sock_sendall(sock, data)
                    sock.shutdown(socket.SHUT_WR)  # EOF on the container's stdin
                except OSError:
                    pass  # the container ended already
            started = time.monotonic()
            execution.state = "running"
            with anyio.move_on_after(timeout_s):
                await first_of(exited, execution.kill_requested, told)
            if told.is_set() and not exited.is_set():
                # The program has ended and all of its output is here: the container's own end (its
                # runner, init and sandbox going, the engine told) is not the caller's to wait for.
                duration_ms = int((time.monotonic() - started) * 1000)
                group.cancel_scope.cancel()
                return _told_outcome(prepared, execution_time_ms=duration_ms)
            if execution.kill_requested.is_set() and not exited.is_set():
                killed = True
                await engine.kill(container_id, "SIGKILL")
            elif not exited.is_set():
                timed_out = True
                execution.state = "stopping"
                await engine.kill(container_id, "SIGTERM")
                with anyio.move_on_after(grace_s):
                    await first_of(exited, execution.kill_requested)
                if not exited.is_set():
                    await engine.kill(container_id, "SIGKILL")
            with anyio.move_on_after(_EXIT_AFTER_KILL_S):
                await exited.wait()
            duration_ms = int((time.monotonic() - started) * 1000)
            with anyio.move_on_after(_DRAIN_AFTER_EXIT_S):
                await drained.wait()
            group.cancel_scope.cancel()
    except BaseExceptionGroup as group_error:  # an engine failure in a task: raise it, not its group
        raise sole_error(group_error) from None
    output.finish()  # the stream is drained: a listener gets the last piece before the outcome exists
    exit_code = status[0] if status else None
    oom_killed = False
    # The OOM killer's kill is a SIGKILL, an exit of 137 (the program and dumb-init are all the container
    # runs): the engine is asked whether it was one then, or when the wait did not say how it ended.
    if exit_code in (None, _SIGKILL_EXIT):
        state = await engine.state(container_id)
        exit_code = state.exit_code if exit_code is None else exit_code
        oom_killed = state.oom_killed
    elif exit_code != 0:
        # Under runsc the cgroup's kill can land on one of gVisor's own processes instead, and the sandbox
        # may then end with its own failure's code (gVisor's kernel dying exits 2). So any failed exit asks
        # the memory cgroup's record (kept in this process: no engine call); an OOM there killed the
        # program, whatever code the sandbox's end gave.
        oom_killed = engine.saw_oom(container_id)
    return Outcome(
        container_id=container_id,
        exit_code=exit_code,
        stdout=output.stdout,
        stderr=output.stderr,
        timed_out=timed_out,
        oom_killed=oom_killed,
        killed=killed,
        duration_ms=duration_ms,
    )
