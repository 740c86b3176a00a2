"""The isolation runtime of the sandbox containers: runc (the host's kernel) or runsc (gVisor, a kernel in
user space between the code and the host), chosen once per service by `METAAGENT_SANDBOX_RUNTIME`.

    runc    the host kernel, behind namespaces, cgroups, no capabilities and Docker's seccomp profile
    runsc   gVisor: the code's system calls go to gVisor's kernel, which itself runs as an unprivileged,
            seccomp-confined process on the host
    auto    runsc when the engine has it and a self-test passes, runc otherwise (one warning saying why)

The self-test is a container with the production flags under runsc running a probe program through the
real runner: what an execution needs, not only whether the engine lists the runtime. An explicit `runsc`
that fails it refuses to start (exit 2, with the fix); any other value does too.

What differs between the runtimes is how the same guarantees are enforced (measured on Debian's runsc
0.0~20221219, Docker 20.10, cgroup v1):
- The process limit. runsc's own host threads (its kernel, its file proxy, ptrace's stubs) live in the
  container's pids cgroup, and too low a limit kills gVisor's kernel (32 breaks every start); so under
  runsc the cgroup gets room for them and the guest's processes are capped by RLIMIT_NPROC inside
  gVisor, which counts the guest's tasks only. Under runc that rlimit would count every process of uid
  1001 on the host, across containers, so runc keeps the pids cgroup alone.
- The CPU share. runsc has no `update` command, so the engine cannot lower a running container's CPU
  quota: under runsc the container starts at the execution's share (the runner loads more slowly).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import anyio
import docker.errors

from metaagent.errors import ConfigError, Unavailable
from metaagent.executions import Execution, new_execution_id
from metaagent.sandbox.engine import ContainerSpec, Engine, EngineUnavailable
from metaagent.sandbox.execute import execute, payload
from metaagent.sandbox.provision import SandboxImage

log = logging.getLogger("metaagent.runtime")

Setting = Literal["auto", "runc", "runsc"]
SETTING = "METAAGENT_SANDBOX_RUNTIME"

# The most processes (threads included) an execution may have: a fork bomb stops here.
PROCESS_LIMIT = 32
# Under runsc the pids cgroup holds gVisor's own host threads, and the guest's limit is RLIMIT_NPROC, so the
# cgroup is only a backstop. Measured: an idle node holds 45 of them, a process and thread flood capped at
# 32 guest tasks up to 194; where the cgroup is lower, gVisor's kernel dies (exit 2: Go's fatal error) - at
# 32 on every start, at 64 once in 1,450 benign executions, at 128 under a flood. Twice the peak seen:
_RUNSC_HOST_PIDS = 384

PROBE_CODE = "console.log('metaagent-runtime-probe ' + require('os').release())"
_PROBE_PREFIX = "metaagent-runtime-probe "
# Bounds, not speed checks: a loaded machine runs the probe slowly, and a slow start must not cost the
# service its runsc. A start that hangs (the KVM platform under nested virtualisation does) fails here.
_PROBE_TIMEOUT_S = 60.0
_PROBE_DEADLINE_S = 180.0
_REGISTER_FIX = (
    "run scripts/ensure-docker as root (it installs Debian's runsc and registers it with dockerd with the "
    "runtime arguments --network=none --host-uds=open), or set METAAGENT_SANDBOX_RUNTIME=runc"
)


@dataclass(frozen=True)
class Runtime:
    """One runtime: its engine name, the kernel the code talks to, and how it enforces the limits."""

    name: str
    kernel: str
    updates_cpus: bool  # whether the engine can change a running container's CPU quota
    host_pids: int | None  # the pids cgroup's limit; None: the process limit itself
    guest_nproc: bool  # whether RLIMIT_NPROC caps the guest's processes

    def pids_limit(self) -> int:
        return self.host_pids or PROCESS_LIMIT

    def nproc(self) -> int | None:
        return PROCESS_LIMIT if self.guest_nproc else None


RUNC = Runtime("runc", "the host's Linux kernel", updates_cpus=True, host_pids=None, guest_nproc=False)
RUNSC = Runtime(
    "runsc", "gVisor, a kernel in user space", updates_cpus=False, host_pids=_RUNSC_HOST_PIDS, guest_nproc=True
)

ProbeSpec = Callable[[str, Runtime], ContainerSpec]  # (image tag, runtime) -> the production container


def parse_setting(value: str) -> Setting:
    """The setting's value, or ConfigError (exit 2) naming the values it takes."""
    normalised = value.strip().lower()
    for setting in get_args(Setting):
        if normalised == setting:
            return setting  # type: ignore[no-any-return]  # get_args loses the Literal's members' types
    raise ConfigError(
        f"{SETTING} must be runc, runsc or auto, not {value!r}",
        [
            "auto (the default): gVisor's runsc when it is installed and passes a self-test at start, runc otherwise",
            "runsc: gVisor only (refuses to start without it); runc: the host's kernel",
        ],
    )


# The runtime arguments the service needs (scripts/register-runsc adds them): without the first, every
# start fails ("cannot run with network enabled in root network namespace"); without the second, node
# cannot connect to the socket of an execution's network tunnel (EPERM).
REQUIRED_RUNSC_ARGS = ("--network=none", "--host-uds=open")


def registration_problem(runtimes: dict[str, list[str]]) -> str | None:
    """Why the engine's registration of runsc cannot serve the sandbox (None when it can)."""
    if RUNSC.name not in runtimes:
        return f"is not registered with the container engine (it lists {', '.join(sorted(runtimes))})"
    args = runtimes[RUNSC.name]
    missing = [arg for arg in REQUIRED_RUNSC_ARGS if arg not in args and not _implied(arg, args)]
    if missing:
        return f"is registered with the container engine without the runtime argument(s) {' '.join(missing)}"
    return None


def _implied(required: str, args: list[str]) -> bool:
    # --host-uds=all allows what =open does, and more.
    return required == "--host-uds=open" and "--host-uds=all" in args


class RuntimeChoice:
    """The runtime in force, chosen once: at start for `runc`, after the self-test for `runsc` and `auto`.

    The engine's registration is looked at first (`check_registration`, at start); the probe needs the
    sandbox image, so it runs once the image is there (`require`, from the start-up sequence or the first
    execution). While the engine does not answer, nothing is chosen and the next call tries again.
    """

    def __init__(self, setting: Setting) -> None:
        self.setting: Setting = setting
        self.runtime: Runtime | None = RUNC if setting == "runc" else None
        self.reason = f"{SETTING}=runc" if setting == "runc" else "not chosen yet: runsc's self-test needs the image"
        # Why the start-up sequence could not choose yet (no engine, no image); the next execution tries.
        self.deferred: str | None = None
        self._lock = anyio.Lock()

    @property
    def has_run(self) -> bool:
        """Whether the choice has been made, or tried since start-up and put off (`defer`)."""
        return self.runtime is not None or self.deferred is not None

    def defer(self, why: str) -> None:
        """The start-up sequence could not choose (`why`): the choice waits for the first execution."""
        if self.runtime is None:
            self.deferred = why
            self.reason = f"not chosen yet: {why}"

    @classmethod
    def parse(cls, value: str) -> RuntimeChoice:
        return cls(parse_setting(value))

    async def check_registration(self, engine: Engine) -> None:
        """Chooses runc (auto) or refuses (runsc) at once when the engine's runsc cannot work."""
        if self.runtime is None and (problem := registration_problem(await engine.runtimes())):
            self.runtime = self._without_runsc(problem)

    async def require(self, engine: Engine, image_tag: str, probe_spec: ProbeSpec) -> Runtime:
        """The runtime in force, testing runsc first if not chosen yet.

        ConfigError when the setting is `runsc` and runsc fails; EngineUnavailable (nothing chosen) when
        the engine itself fails.
        """
        if self.runtime is not None:
            return self.runtime
        async with self._lock:
            if self.runtime is None:
                self.runtime = await self._choose(engine, image_tag, probe_spec)
        return self.runtime

    async def _choose(self, engine: Engine, image_tag: str, probe_spec: ProbeSpec) -> Runtime:
        problem = registration_problem(await engine.runtimes())
        guest = ""
        if problem is None:
            problem, guest = await self_test(engine, probe_spec(image_tag, RUNSC))
        if problem is not None:
            return self._without_runsc(problem)
        self.reason = f"{SETTING}={self.setting}: runsc passed its self-test (guest kernel {guest})"
        log.info("sandbox runtime: runsc, gVisor (%s)", self.reason)
        return RUNSC

    def _without_runsc(self, problem: str) -> Runtime:
        if self.setting == "runsc":
            raise ConfigError(f"{SETTING}=runsc, but runsc cannot run the sandbox here: it {problem}", [_REGISTER_FIX])
        self.reason = f"{SETTING}=auto: runsc {problem}"
        log.warning("sandbox runtime: runc, because runsc %s; for gVisor, %s", problem, _REGISTER_FIX)
        return RUNC


async def self_test(engine: Engine, spec: ContainerSpec) -> tuple[str | None, str]:
    """(None, the guest's kernel release) when `spec`'s container runs the probe; otherwise (why not, "").

    EngineUnavailable when the engine itself does not answer: that says nothing about the runtime.
    """
    execution = Execution(new_execution_id(), int(_PROBE_TIMEOUT_S), spec.memory_mb)
    outcome = None
    try:
        with anyio.move_on_after(_PROBE_DEADLINE_S):
            outcome = await execute(
                engine, spec, payload(PROBE_CODE, None), execution, timeout_s=_PROBE_TIMEOUT_S, grace_s=1
            )
    except EngineUnavailable as exc:
        if not isinstance(exc.__cause__, docker.errors.APIError):
            raise  # no answer from the engine at all
        return f"failed to start a container ({exc.message})", ""
    except Unavailable as exc:
        return f"failed to start a container ({exc.message})", ""
    if outcome is None:
        return f"did not run a probe container within {_PROBE_DEADLINE_S:.0f} s (a hung start)", ""
    out = outcome.stdout.text()
    if outcome.exit_code != 0 or not out.startswith(_PROBE_PREFIX):
        how = ", ".join(
            name for name, flag in (("timed out", outcome.timed_out), ("OOM-killed", outcome.oom_killed)) if flag
        )
        detail = (outcome.stderr.text() or out)[:300].strip()
        return f"failed its self-test (the probe exited {outcome.exit_code}{f', {how}' if how else ''}: {detail!r})", ""
    return None, out.removeprefix(_PROBE_PREFIX).strip()


async def settle(
    choice: RuntimeChoice, engine: Engine, image: SandboxImage, probe_spec: ProbeSpec, *, build: bool
) -> Runtime:
    """Chooses now, before the service serves anything: an explicit `runsc` must not start without it.

    ConfigError when runsc cannot work, or cannot be tested (no engine, no image).
    """
    try:
        await choice.check_registration(engine)
        if choice.runtime is not None:
            return choice.runtime
        await image.refresh(build=build)
        if image.image_id is None:
            reason = image.error or "the sandbox image is not ready"
            raise ConfigError(f"{SETTING}={choice.setting}, but runsc cannot be tested: {reason}")
        return await choice.require(engine, image.tag, probe_spec)
    except EngineUnavailable as exc:
        raise ConfigError(f"{SETTING}={choice.setting}, but runsc cannot be tested: {exc.message}") from None
