"""The container is the boundary: hostile programs run with the production container settings but
without the trusted runner (`node -e`), so each guarantee is proven by the container alone, not by the
in-process module gate that would otherwise stop these programs earlier.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest

from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import image_tag
from metaagent.packages.install import archive
from metaagent.sandbox.engine import OWNER_PID_LABEL, SERVICE_LABEL, WIRE_DIR, Engine, Mount, sock_recv
from metaagent.sandbox.execute import Outcome, execute
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime
from metaagent.sandbox.wire_socket import WireListener, came_from

pytestmark = [pytest.mark.docker, pytest.mark.security]

RunRaw = Callable[..., Outcome]
# A bound for the floods, which end themselves (their report at 2.5 s): their children share the
# container's CPU share, so on a loaded machine the report comes late.
PROGRAM_EXITS_ITSELF_S = 30


@pytest.fixture
def run_raw(sandbox_runtime: Runtime) -> RunRaw:  # the service behind the runtime guarantees the image is built
    def run(code: str, *, memory_mb: int = 256, timeout_s: float = 10, mounts: tuple[Mount, ...] = ()) -> Outcome:
        async def go() -> Outcome:
            engine = Engine()
            execution = Execution(new_execution_id(), int(timeout_s), memory_mb)
            command = ["/usr/bin/node", "-e", code]
            spec = container_spec(
                execution.execution_id, image_tag(), memory_mb, 0.5, mounts, command, runtime=sandbox_runtime
            )
            try:
                return await execute(engine, spec, b"", execution, timeout_s=timeout_s, grace_s=2, ready_marker=b"")
            finally:
                engine.close()

        runner: Callable[[], Coroutine[Any, Any, Outcome]] = go
        return anyio.run(runner)

    return run


def report(outcome: Outcome) -> dict[str, Any]:
    assert outcome.exit_code == 0, outcome.stderr.text()
    result: dict[str, Any] = json.loads(outcome.stdout.text())
    return result


def report_list(outcome: Outcome) -> list[dict[str, str]]:
    assert outcome.exit_code == 0, outcome.stderr.text()
    result: list[dict[str, str]] = json.loads(outcome.stdout.text())
    return result


def test_fork_bomb_is_contained_by_the_process_limit(run_raw: RunRaw) -> None:
    outcome = run_raw(
        """
        const cp = require('child_process');
        let started = 0, refused = 0;
        for (let i = 0; i < 100; i++) {
          const child = cp.spawn(process.execPath, ['-e', 'setTimeout(() => {}, 4000)']);
          child.on('spawn', () => started++);
          child.on('error', () => refused++);
        }
        setTimeout(() => { console.log(JSON.stringify({started, refused})); process.exit(0); }, 2500);
        """,
        timeout_s=PROGRAM_EXITS_ITSELF_S,
    )
    counts = report(outcome)
    assert counts["refused"] > 0
    assert counts["started"] < 32


def test_thread_flood_is_contained_by_the_process_limit(run_raw: RunRaw) -> None:
    # Threads count as processes against the limit: the pids cgroup under runc, RLIMIT_NPROC in gVisor.
    outcome = run_raw(
        """
        const { Worker } = require('worker_threads');
        let started = 0, refused = 0;
        for (let i = 0; i < 100; i++) {
          try {
            const worker = new Worker('setTimeout(() => {}, 4000)', { eval: true });
            worker.on('online', () => started++);
            worker.on('error', () => refused++);
          } catch (e) { refused++; }
        }
        setTimeout(() => { console.log(JSON.stringify({started, refused})); process.exit(0); }, 2500);
        """,
        timeout_s=PROGRAM_EXITS_ITSELF_S,
    )
    counts = report(outcome)
    assert counts["refused"] > 0
    assert counts["started"] < 32


def test_no_shell_can_be_started(run_raw: RunRaw) -> None:
    outcome = run_raw(
        """
        const cp = require('child_process');
        const tryRun = (p) => cp.spawnSync(p, ['-c', 'echo hi']).error.code;
        const codes = ['/bin/sh', '/bin/bash', '/usr/bin/env'].map(tryRun);
        console.log(JSON.stringify({codes}));
        """
    )
    assert report(outcome)["codes"] == ["ENOENT", "ENOENT", "ENOENT"]


def test_memory_hog_is_killed_at_the_memory_limit(run_raw: RunRaw, sandbox_runtime: Runtime) -> None:
    # Buffers live outside node's heap limit, so only the container's cgroup stops this one.
    outcome = run_raw("const keep = []; for (;;) keep.push(Buffer.alloc(8 << 20, 1));", memory_mb=64)
    assert outcome.exit_code == 137, outcome
    assert not outcome.timed_out
    assert not outcome.killed
    assert outcome.oom_killed


@pytest.mark.parametrize(
    "path", ["/app/x", "/etc/passwd", "/opt/metaagent/runner.js", "/usr/bin/node", "/x", "/dev/shm/x"]
)
def test_writing_outside_tmp_fails(run_raw: RunRaw, path: str) -> None:
    outcome = run_raw(
        f"""
        let result;
        try {{ require('fs').writeFileSync({json.dumps(path)}, 'owned'); result = 'WROTE'; }}
        catch (e) {{ result = e.code; }}
        console.log(JSON.stringify({{result}}));
        """
    )
    assert report(outcome)["result"] in ("EROFS", "ENOENT", "EACCES")


def test_tmp_is_writable_but_not_executable(run_raw: RunRaw) -> None:
    outcome = run_raw(
        """
        const fs = require('fs');
        fs.writeFileSync('/tmp/x', '#!/usr/bin/node\\nconsole.log(1)', {mode: 0o755});
        let exec;
        try { require('child_process').execFileSync('/tmp/x'); exec = 'RAN'; } catch (e) { exec = e.code; }
        console.log(JSON.stringify({read: fs.readFileSync('/tmp/x', 'utf8').length, exec}));
        """
    )
    result = report(outcome)
    assert result["read"] > 0
    assert result["exec"] == "EACCES"


def test_writing_past_100_mb_in_tmp_fails(run_raw: RunRaw) -> None:
    outcome = run_raw(
        """
        const fs = require('fs');
        const chunk = Buffer.alloc(1 << 20, 1);
        let written = 0, error = null;
        try { for (let i = 0; i < 200; i++) { fs.appendFileSync('/tmp/big', chunk); written++; } }
        catch (e) { error = e.code; }
        console.log(JSON.stringify({written, error}));
        """,
        memory_mb=512,
    )
    result = report(outcome)
    assert result["error"] == "ENOSPC"
    assert result["written"] <= 100


def test_inode_flood_in_tmp_ends_in_enospc_under_runc_and_at_the_memory_limit_under_runsc(
    run_raw: RunRaw, sandbox_runtime: Runtime
) -> None:
    flood = """
        const fs = require('fs');
        let made = 0, error = null;
        try { for (let i = 0; ; i++) { fs.writeFileSync('/tmp/f' + i, ''); made++; } }
        catch (e) { error = e.code; }
        console.log(JSON.stringify({made, error}));
        """
    if sandbox_runtime is RUNC:
        outcome = run_raw(flood)
        result = report(outcome)
        assert result["error"] == "ENOSPC"  # the tmpfs's 16,384 inodes
        assert not outcome.oom_killed
    else:
        # gVisor's tmpfs has no inode limit: its inodes live in gVisor's memory, inside the memory limit,
        # and the kill at the limit is the OOM killer's.
        outcome = run_raw(flood, memory_mb=64, timeout_s=120)
        assert outcome.exit_code == 137, outcome
        assert not outcome.timed_out
        assert not outcome.killed
        assert outcome.oom_killed


def test_opening_300_files_fails(run_raw: RunRaw) -> None:
    outcome = run_raw(
        """
        const fs = require('fs');
        const fds = []; let error = null;
        try { for (let i = 0; i < 300; i++) fds.push(fs.openSync('/opt/metaagent/runner.js', 'r')); }
        catch (e) { error = e.code; }
        console.log(JSON.stringify({opened: fds.length, error}));
        """
    )
    result = report(outcome)
    assert result["error"] == "EMFILE"
    assert result["opened"] < 256


def test_process_runs_as_uid_1001_without_capabilities(run_raw: RunRaw, sandbox_runtime: Runtime) -> None:
    outcome = run_raw(
        """
        const status = require('fs').readFileSync('/proc/self/status', 'utf8');
        const found = (name) => status.match(new RegExp('^' + name + ':\\\\s*(.*)$', 'm'));
        const field = (name) => found(name) && found(name)[1].trim();
        console.log(JSON.stringify({
          uid: process.getuid(), gid: process.getgid(), user: require('os').userInfo().username,
          CapEff: field('CapEff'), CapPrm: field('CapPrm'), CapBnd: field('CapBnd'), NoNewPrivs: field('NoNewPrivs'),
        }));
        """
    )
    result = report(outcome)
    assert (result["uid"], result["gid"], result["user"]) == (1001, 1001, "sandbox")
    assert result["CapEff"] == result["CapPrm"] == result["CapBnd"] == "0000000000000000"
    # gVisor's /proc/self/status has no NoNewPrivs line; its kernel gets the flag from the same spec.
    assert result["NoNewPrivs"] == ("1" if sandbox_runtime is RUNC else None)


def test_only_loopback_exists_and_connections_fail(run_raw: RunRaw, upstream: str) -> None:
    port = upstream.rsplit(":", 1)[1]
    outcome = run_raw(
        f"""
        const net = require('net');
        const interfaces = Object.keys(require('os').networkInterfaces());
        const routes = require('fs').readFileSync('/proc/net/route', 'utf8').trim().split('\\n').length - 1;
        const done = (connect) => {{ console.log(JSON.stringify({{interfaces, routes, connect}})); process.exit(0); }};
        const socket = net.connect({port}, '127.0.0.1');
        socket.on('connect', () => done('CONNECTED'));
        socket.on('error', (e) => done(e.code));
        """
    )
    result = report(outcome)
    assert result["interfaces"] == ["lo"]
    assert result["routes"] == 0
    assert result["connect"] == "ECONNREFUSED"  # the container's own loopback, not the host's


def test_no_mount_reveals_a_path_of_the_service_or_its_users(
    run_raw: RunRaw, tmp_path: Path, sandbox_runtime: Runtime
) -> None:
    outcome = run_raw(
        """
        const lines = require('fs').readFileSync('/proc/self/mountinfo', 'utf8').trim().split('\\n');
        const mounts = lines.map((line) => { const f = line.split(' '); return {root: f[3], at: f[4]}; });
        console.log(JSON.stringify(mounts));
        """
    )
    mounts = report_list(outcome)
    # A bind mount shows the host folder it came from as its root. The only ones are Docker's own
    # /etc/hostname, /etc/hosts and /etc/resolv.conf (under the engine's data root) and the engine's
    # masking of /proc and /sys paths; the code itself arrives on stdin, never through a mount.
    # Under runsc, gVisor's kernel shows no host path at all: every mount's root is its own "/".
    # The wire volume (where a session's supervisor finds its socket) shows its folder under the engine's
    # data root too.
    docker_files = {"/etc/hostname", "/etc/hosts", "/etc/resolv.conf"}
    for mount in mounts:
        if sandbox_runtime is RUNSC:
            assert mount["root"] == "/", mount
        elif mount["at"] in docker_files:
            assert mount["root"].startswith("/var/lib/docker/containers/"), mount
        elif mount["at"] == WIRE_DIR:
            assert mount["root"].startswith("/var/lib/docker/volumes/metaagent-wire-"), mount
        elif mount["root"] != "/":
            assert mount["at"].startswith(("/proc", "/sys", "/dev")), mount
    text = outcome.stdout.text()
    for host_path in ("/work/", "/root", str(tmp_path), "/var/cache/metaagent"):
        assert host_path not in text


def test_the_wire_folder_cannot_be_listed_or_written_and_a_socket_in_it_is_reached_by_its_name(
    sandbox_runtime: Runtime,
) -> None:
    """Every container has the wire volume (read-only): its sandboxed user can neither list it nor make a
    file there, and reaches a session's socket only by the name the service gave it (wire_socket.py); the
    connection is known to come from that container."""
    code = """
    const fs = require('fs'); const net = require('net');
    const outcome = (f) => { try { f(); return 'done'; } catch (e) { return e.code; } };
    const found = { list: outcome(() => fs.readdirSync('/run/metaagent-wire')),
                    write: outcome(() => fs.writeFileSync('/run/metaagent-wire/x.sock', '')) };
    const wire = net.connect(process.argv[1]);
    wire.on('connect', () => wire.end(JSON.stringify(found)));
    wire.on('error', (e) => { console.log(JSON.stringify({ ...found, connect: e.code })); });
    """

    async def go() -> tuple[bytes, Outcome, dict[str, bool]]:
        engine = Engine()
        try:
            listener = WireListener(await engine.wire_folder())
            execution = Execution(new_execution_id(), 30, 256)
            command = ["/usr/bin/node", "-e", code, listener.path_in_container]
            spec = container_spec(execution.execution_id, image_tag(), 256, 0.5, (), command, runtime=sandbox_runtime)
            said, heard = b"", anyio.Event()
            peer: dict[str, bool] = {}
            async with anyio.create_task_group() as group:

                async def take() -> None:
                    nonlocal said
                    connection = await listener.accept()
                    assert execution.container_id is not None
                    peer["its container"] = came_from(connection, execution.container_id)
                    peer["another container"] = came_from(connection, "f" * 64)
                    peer["a prefix of its id"] = came_from(connection, execution.container_id[:12])
                    with connection:
                        while chunk := await sock_recv(connection, 4096):
                            said += chunk
                    heard.set()

                group.start_soon(take)
                outcome = await execute(engine, spec, b"", execution, timeout_s=30, grace_s=2, ready_marker=b"")
                with anyio.move_on_after(10):
                    await heard.wait()
                group.cancel_scope.cancel()
            return said, outcome, peer
        finally:
            await engine.remove_owned(within_s=30)
            engine.close()

    said, outcome, peer = anyio.run(go)
    assert outcome.exit_code == 0, outcome.stderr.text()
    # The kernel's record of who connected names a process of this container (wire_socket.came_from).
    assert peer == {"its container": True, "another container": False, "a prefix of its id": False}
    found = json.loads(said)
    assert found["list"] == "EACCES", (said, outcome.stdout.text())
    assert found["write"] in ("EROFS", "EACCES")  # runc's kernel checks the mount first, gVisor's the folder


def test_a_package_volume_reveals_no_path_outside_the_engine_data_root(
    run_raw: RunRaw, tmp_path: Path, sandbox_runtime: Runtime
) -> None:
    """Installed packages arrive as a named volume (as the package store makes them): readable by the
    sandbox user, writable by nobody, and its mount shows only a path under the engine's data root."""
    tree = tmp_path / "node_modules"
    (tree / "probe").mkdir(parents=True)
    (tree / "probe" / "index.js").write_text("module.exports = 'from the volume';")
    volume = f"metaagent-npm-test-{new_execution_id()}"
    # With this process as its owner: another service's start would otherwise remove its fill's helper
    # container, halfway, as an orphan's.
    labels = {SERVICE_LABEL: "metaagent-test", OWNER_PID_LABEL: str(os.getpid())}

    async def fill() -> None:
        engine = Engine()
        try:
            await engine.create_volume(volume, labels)
            await engine.fill_volume(volume, image_tag(), archive(tree, tmp_path / "tree.tar"), labels)
        finally:
            engine.close()

    async def remove() -> None:
        engine = Engine()
        try:
            assert await engine.remove_volume(volume)
        finally:
            engine.close()

    anyio.run(fill)
    try:
        outcome = run_raw(
            """
            const fs = require('fs');
            const lines = fs.readFileSync('/proc/self/mountinfo', 'utf8').trim().split('\\n');
            const mounts = lines.map((line) => { const f = line.split(' '); return {root: f[3], at: f[4]}; });
            let write = 'allowed';
            try { fs.writeFileSync('/app/node_modules/probe/index.js', 'x'); } catch (e) { write = e.code; }
            const loaded = require('/app/node_modules/probe');
            console.log(JSON.stringify({mounts, write, loaded, uid: process.getuid()}));
            """,
            mounts=(Mount(target="/app/node_modules", source=volume),),
        )
    finally:
        anyio.run(remove)
    result = report(outcome)
    assert result["uid"] == 1001
    assert result["loaded"] == "from the volume"
    package_mount = next(m for m in result["mounts"] if m["at"] == "/app/node_modules")
    if sandbox_runtime is RUNC:
        assert result["write"] == "EROFS"
        assert package_mount["root"] == f"/var/lib/docker/volumes/{volume}/_data"
    else:  # gVisor refuses the write to the read-only mount with EACCES, and shows no host path
        assert result["write"] == "EACCES"
        assert package_mount["root"] == "/"
    for mount in result["mounts"]:
        assert (
            mount["root"] == "/"
            or mount["root"].startswith("/var/lib/docker/")
            or mount["at"].startswith(("/proc", "/sys", "/dev"))
        ), mount
    for host_path in ("/work/", "/root", str(tmp_path), "/var/cache/metaagent"):
        assert host_path not in outcome.stdout.text()


def test_kill_of_a_container_that_already_exited_is_harmless() -> None:
    async def go() -> None:
        engine = Engine()
        try:
            await engine.kill("metaagent-no-such-container", "SIGKILL")
        finally:
            engine.close()

    anyio.run(go)


def test_deadlines_hold_when_more_executions_run_than_the_default_worker_threads(sandbox_runtime: Runtime) -> None:
    """Each running execution waits for its container in a thread; those waits must not take the
    threads that the kills at the deadlines need (anyio's default pool, here shrunk to 3)."""

    async def go() -> list[Outcome]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 3
        engine = Engine()
        outcomes: list[Outcome] = []

        async def one() -> None:
            execution = Execution(new_execution_id(), 1, 128)
            command = ["/usr/bin/node", "-e", "for (;;) {}"]
            spec = container_spec(
                execution.execution_id, image_tag(), 128, 0.5, command=command, runtime=sandbox_runtime
            )
            outcomes.append(await execute(engine, spec, b"", execution, timeout_s=1, grace_s=1, ready_marker=b""))

        try:
            with anyio.fail_after(120):  # without threads of their own the kills never run: a hang
                async with anyio.create_task_group() as group:
                    for _ in range(5):
                        group.start_soon(one)
        finally:
            engine.close()
        return outcomes

    outcomes = anyio.run(go)
    assert len(outcomes) == 5
    assert all(o.timed_out for o in outcomes)
