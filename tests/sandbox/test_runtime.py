"""The isolation runtime for real: the choice at start-up (auto, an explicit runsc, an engine without
runsc), what /health and the audit log say, and runsc's leftovers on the host: no failed start leaves
any, and the sweeps at start and shutdown find them in runsc's own state and in /proc.

An engine without runsc is a private dockerd (tests/sandbox/private_engine.py), never the shared one.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import anyio
import docker
import httpx2
import pytest

from metaagent.errors import MetaAgentError
from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import image_tag
from metaagent.sandbox import leftovers
from metaagent.sandbox.engine import Engine
from metaagent.sandbox.execute import execute, payload
from metaagent.sandbox.runtime import RUNSC, registration_problem
from tests.sandbox.conftest import RUNTIME_UNDER_TEST, Service, audit_record, code_runner
from tests.sandbox.private_engine import PrivateEngine, private_engine
from tests.test_cli import run, serving

pytestmark = pytest.mark.docker

START_TIMEOUT_S = 120  # a bound, not a speed check: a loaded machine starts a service slowly


def engine_runtimes(client: docker.DockerClient) -> dict[str, list[str]]:
    runtimes = client.info()["Runtimes"]
    return {name: list((entry or {}).get("runtimeArgs") or []) for name, entry in runtimes.items()}


@pytest.fixture(scope="module")
def runsc_registered(docker_client: docker.DockerClient) -> None:
    problem = registration_problem(engine_runtimes(docker_client))
    assert problem is None, f"runsc {problem}: run scripts/ensure-docker (CI does)"


def health_when_chosen(base: str) -> dict[str, object]:
    """The container engine's health check once the runtime is chosen."""
    deadline = time.monotonic() + 120
    while True:
        checks = httpx2.get(f"{base}/health", timeout=30).json().get("checks")  # none while starting
        engine: dict[str, object] = checks["container_engine"] if checks else {"runtime": None}
        if engine["runtime"] is not None:
            return engine
        assert time.monotonic() < deadline, f"no runtime was chosen: {engine}"
        time.sleep(0.2)


def test_health_and_every_audit_record_name_the_runtime_auto_chose(
    sandbox_service: Service, docker_client: docker.DockerClient
) -> None:
    usable = registration_problem(engine_runtimes(docker_client)) is None
    expected = RUNTIME_UNDER_TEST if RUNTIME_UNDER_TEST in ("runc", "runsc") else ("runsc" if usable else "runc")
    engine = health_when_chosen(sandbox_service.base_url)
    assert engine["runtime"] == expected, engine
    result = code_runner(sandbox_service)("console.log(1)")
    assert audit_record(sandbox_service, result.execution_id)["security"]["runtime"] == expected


@pytest.mark.usefixtures("runsc_registered")
def test_an_explicit_runsc_that_works_is_in_force_after_its_self_test(tmp_path: Path, sandbox_service: Service) -> None:
    # sandbox_service: only so that the image is there.
    # The port opens once runsc has passed its self-test.
    with serving(tmp_path, START_TIMEOUT_S, METAAGENT_SANDBOX_RUNTIME="runsc") as (base, _process):
        engine = health_when_chosen(base)
        assert engine["runtime"] == "runsc"
        assert "passed its self-test" in str(engine["runtime_reason"])


@pytest.fixture(scope="module")
def engine_without_runsc() -> Iterator[PrivateEngine]:
    """A dockerd of its own with no daemon.json runtimes: runc only."""
    with private_engine() as engine:
        yield engine


def test_auto_without_runsc_uses_runc_and_says_why_in_one_warning(
    tmp_path: Path, engine_without_runsc: PrivateEngine
) -> None:
    with serving(tmp_path, START_TIMEOUT_S, DOCKER_HOST=engine_without_runsc.url) as (base, process):
        engine = health_when_chosen(base)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        log = process.stderr.read() if process.stderr else ""
    assert engine["runtime"] == "runc"
    assert "runsc is not registered with the container engine" in str(engine["runtime_reason"])
    warnings = [line for line in log.splitlines() if "sandbox runtime: runc, because runsc" in line]
    assert len(warnings) == 1, log
    assert "scripts/ensure-docker" in warnings[0]


def test_an_explicit_runsc_without_runsc_refuses_to_start_with_exit_2_and_the_fix(
    tmp_path: Path, engine_without_runsc: PrivateEngine
) -> None:
    result = run(tmp_path, "serve", METAAGENT_SANDBOX_RUNTIME="runsc", DOCKER_HOST=engine_without_runsc.url)
    assert result.returncode == 2, result.stderr
    assert "METAAGENT_SANDBOX_RUNTIME=runsc, but runsc cannot run the sandbox here" in result.stderr
    assert "is not registered with the container engine" in result.stderr
    assert "scripts/ensure-docker" in result.stderr


# --- runsc's leftovers ----------------------------------------------------------------------------------


@pytest.mark.security
@pytest.mark.usefixtures("runsc_registered", "sandbox_service")  # the service: only so that the image is there
def test_a_runsc_start_that_fails_leaves_no_process_or_state_behind() -> None:
    async def go() -> tuple[str, int | None]:
        engine = Engine()
        execution = Execution(new_execution_id(), 5, 256)
        spec = container_spec(execution.execution_id, image_tag(), 256, 0.5, runtime=RUNSC)
        # 32 pids leave gVisor's own host threads no room: every runsc start fails (issue 17).
        failing = dataclasses.replace(spec, pids_limit=32)
        exit_code = None
        try:
            outcome = await execute(engine, failing, payload("console.log(1)", None), execution, timeout_s=5, grace_s=1)
            exit_code = outcome.exit_code
        except MetaAgentError:
            pass  # the engine refused the start (its error): a failure too
        finally:
            engine.close()
        assert execution.container_id is not None
        return execution.container_id, exit_code

    container_id, exit_code = anyio.run(go)
    assert exit_code != 0  # the start failed: the program never ran
    client = docker.from_env()
    try:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(container_id)
    finally:
        client.close()
    assert container_id not in leftovers.scan()


def engine_data_root() -> str:
    client = docker.from_env()
    try:
        return str(client.info()["DockerRootDir"])
    finally:
        client.close()


@contextmanager
def runsc_beside_the_engine(tmp_path: Path, hostname: str, *, this_engines: bool = True) -> Iterator[tuple[str, str]]:
    """A runsc container that no engine knows, as a failed start can leave one: runsc's sandbox and gofer
    processes and its state, started with `runsc run -detach` (the host's / read-only as its root).
    With `this_engines`, its root file system lies in the shared engine's data root, as the root of every
    container that engine starts does (a link there to /); otherwise it looks like another engine's.
    Yields (container id, state root); ends it with runsc's own `delete` if a test left it."""
    runsc = shutil.which("runsc")
    assert runsc, "runsc is not installed: run scripts/ensure-docker"
    label = secrets.token_hex(6)
    bundle, root = tmp_path / f"bundle-{label}", tmp_path / f"state-{label}"
    bundle.mkdir(parents=True)
    root_fs = Path("/")
    if this_engines:
        root_fs = Path(engine_data_root()) / f"metaagent-test-root-{label}"
        root_fs.symlink_to("/")
    subprocess.run([runsc, "spec", "-bundle", str(bundle), "--", "/bin/sleep", "600"], check=True, timeout=30)
    spec = json.loads((bundle / "config.json").read_text())
    spec.update(hostname=hostname, root={"path": str(root_fs), "readonly": True})
    spec["process"].update(user={"uid": 1001, "gid": 1001}, terminal=False)
    (bundle / "config.json").write_text(json.dumps(spec))
    errors = tmp_path / f"runsc-run-{label}.err"
    for _attempt in range(5):
        # A new id each time: a sandbox swept while it started may still hold its id's control socket
        # ("address already in use"), as CI once saw.
        container_id = secrets.token_hex(32)
        argv = [runsc, "--root", str(root), "--network=none", "run", "-detach", "-bundle", str(bundle), container_id]
        # Into a file, not a pipe: the detached sandbox would hold a pipe open, and the wait for its end would hang.
        with errors.open("w") as stderr:
            started = subprocess.run(argv, timeout=60, stdout=subprocess.DEVNULL, stderr=stderr, check=False)
        if started.returncode == 0:
            break
        # A service of another test swept it while it started, as it should: runsc then dies of SIGKILL or
        # exits 128 when the sandbox it waits for is killed. Start it again; a real fault fails each time.
        subprocess.run([runsc, "--root", str(root), "delete", "-force", container_id], timeout=60, check=False)
    assert started.returncode == 0, f"runsc run exited with {started.returncode}: {errors.read_text()[-2000:]}"
    try:
        yield container_id, str(root)
    finally:
        subprocess.run([runsc, "--root", str(root), "delete", "-force", container_id], timeout=60, check=False)
        if this_engines:
            root_fs.unlink()


def traces(container_id: str, root: str) -> leftovers.Leftover | None:
    return leftovers.scan([root]).get(container_id)


def gone(container_id: str, root: str) -> bool:
    """Whether the container's traces are gone; a process sent SIGKILL may take a moment to end."""
    deadline = time.monotonic() + 10  # a bound, not a speed check
    while traces(container_id, root) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.security
@pytest.mark.usefixtures("runsc_registered")
def test_the_sweep_removes_forgotten_runsc_sandboxes_of_its_own_engine_only(tmp_path: Path) -> None:
    # Every service sweeps: one that another test starts meanwhile may remove ours first (which proves
    # nothing here), so ours is started again until it is there when this test's sweep begins.
    with (
        runsc_beside_the_engine(tmp_path, "web") as (foreign, foreign_root),
        runsc_beside_the_engine(tmp_path / "other", "sandbox", this_engines=False) as (others, others_root),
        ExitStack() as stack,
    ):
        for attempt in range(5):
            ours, root = stack.enter_context(runsc_beside_the_engine(tmp_path / str(attempt), "sandbox"))
            found = traces(ours, root)
            if found is not None and found.pids:  # runsc's sandbox process, at least
                break
        else:
            pytest.fail("another service's sweep removed each of five runsc containers before this test's sweep")

        async def sweep() -> int:
            engine = Engine()
            try:
                return await engine.remove_runtime_leftovers()
            finally:
                engine.close()

        anyio.run(sweep)
        assert gone(ours, root)  # no process, no state left
        kept = traces(foreign, foreign_root)
        assert kept is not None
        assert kept.pids
        # A sandbox of another engine on this host (its root elsewhere): this engine never knew it.
        other_engines = traces(others, others_root)
        assert other_engines is not None
        assert other_engines.pids


@pytest.mark.security
@pytest.mark.usefixtures("runsc_registered", "sandbox_service")
def test_the_service_sweeps_runsc_leftovers_at_start_and_at_shutdown(tmp_path: Path) -> None:
    # Every service sweeps, so another one starting meanwhile may take a leftover first: what this
    # proves is that none survives a start and a shutdown.
    with runsc_beside_the_engine(tmp_path, "sandbox") as (before, root):
        assert traces(before, root) is not None
        with serving(tmp_path, START_TIMEOUT_S) as (base, process):
            health_when_chosen(base)  # the start-up sweep runs before the runtime is chosen
            assert gone(before, root)
            with runsc_beside_the_engine(tmp_path, "sandbox") as (during, during_root):
                assert traces(during, during_root) is not None
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=60) == 0
                assert gone(during, during_root)
