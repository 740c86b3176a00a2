"""The code interpreter tool: untrusted code, one fresh locked-down container per execution.

The request, its admission and audit are the same in every language; what the language contributes
(its image, its runner, its policy, the refusal of one not served) comes from `metaagent.languages`,
which sessions use too. The interpreter holds one `Lane` per served language, its image and its warm
pool, and every execution (one-shot or a session's start) goes through its request's lane: the same
functions serve every lane. The admission (execution slots) is one for all of them, and the isolation
runtime is chosen once, by a self-test in JavaScript's image.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
from pydantic import BaseModel, Field

from metaagent.audit import AuditLog
from metaagent.egress.allowlist import AllowList
from metaagent.errors import MetaAgentError, PackageRefused, ReplicaFull, RequestRefused, Unavailable
from metaagent.executions import Execution, ExecutionRegistry, new_execution_id
from metaagent.languages import JAVASCRIPT, PYTHON, Language, LanguageName, code_fields, served_language
from metaagent.languages.container import container_spec
from metaagent.packages.store import NO_PACKAGES, PackageStore, PreparedPackages
from metaagent.sandbox.engine import ContainerSpec, Engine
from metaagent.sandbox.execute import STDERR_CAP, STDOUT_CAP, Outcome, execute, payload
from metaagent.sandbox.network import ExecutionNetwork, SandboxNetwork
from metaagent.sandbox.output import OutputSink
from metaagent.sandbox.pool import Warm, WarmPool
from metaagent.sandbox.provision import SandboxImage
from metaagent.sandbox.runtime import ProbeSpec, Runtime, RuntimeChoice
from metaagent.sandbox.sizing import PoolLimits
from metaagent.validation import ToolRequest

log = logging.getLogger("metaagent.code_interpreter")

MAX_CODE_BYTES = 1024 * 1024
DEFAULT_MEMORY_MB = 256


class NetworkPolicy(ToolRequest):
    allow: list[str] = Field(
        min_length=1,
        max_length=32,
        description="Hosts the code may reach with http, https and fetch; each must be allowed by ALLOW_HTTP_HOSTS.",
    )


# The fields a one-shot run and a session's creation share, described once.
MEMORY_DESCRIPTION = f"Memory limit in MiB (no swap); Python needs at least {PYTHON.min_memory_mb}."
PACKAGES_DESCRIPTION = "npm packages from the package allow-list (JavaScript only)."
NETWORK_DESCRIPTION = "Egress for the code (JavaScript only); null means no network."
LANGUAGE_DESCRIPTION = (
    "javascript (Node.js 18) or python (Python 3.11 with numpy, pandas, scipy and matplotlib), if served."
)

# Set when the session is created; a call into a session leaves them out (or null).
SESSION_OWNED_FIELDS = ("memory_mb", "packages", "network", "language", "stdin")


class CodeInterpreterRequest(ToolRequest):
    """Run code in a fresh, isolated container and return its output: JavaScript (a CommonJS script on Node.js 18,
    the default) or, with language "python", Python 3.11 with numpy, pandas, scipy and matplotlib.

    The container has no network, a read-only file system except a 100 MB /tmp, no privileges, and
    limits on memory, CPU, processes and open files. JavaScript: core modules that reach the file system,
    other programs or raw sockets (fs, child_process, net, ...) are blocked; with `network`, http, https and
    fetch reach the listed hosts (and only those); print results with console.log. Python: it may write
    only in /tmp, `packages` are not supported (they are npm packages), with `network` urllib, http.client
    and sockets reach the listed hosts (and only those); print results with print().

    With `session_id` (from session_create), the code runs in that session instead, in the session's
    language: variables, functions and imports of earlier calls are still there, top-level await works,
    the value of the last expression comes back as `result` (and a Python session's matplotlib figures as
    `images`), and files work inside /workspace (the cwd, where uploaded files are) and /tmp. memory_mb,
    packages, network, language and stdin are the session's then: leave them out or null (or give the
    session's own value).
    """

    code: str = Field(
        min_length=1,
        max_length=MAX_CODE_BYTES,
        description="Source code in `language`: JavaScript (CommonJS) or Python.",
    )
    timeout_s: int = Field(default=8, ge=1, le=300, description="Wall-clock limit in seconds.")
    memory_mb: int = Field(default=DEFAULT_MEMORY_MB, ge=64, le=1024, description=MEMORY_DESCRIPTION)
    packages: list[str] = Field(default_factory=list, max_length=16, description=PACKAGES_DESCRIPTION)
    stdin: str | None = Field(default=None, max_length=MAX_CODE_BYTES, description="Standard input for the program.")
    network: NetworkPolicy | None = Field(default=None, description=NETWORK_DESCRIPTION)
    language: LanguageName = Field(default="javascript", description=LANGUAGE_DESCRIPTION)
    session_id: str | None = Field(
        default=None, max_length=64, description="Run in this session (see session_create); its state persists."
    )

    def session_values(self) -> dict[str, Any]:
        """The session-owned fields this session call gave a value, with their (validated) values:
        each must equal the session's own (a strict-mode caller sends every property)."""
        return {name: getattr(self, name) for name in SESSION_OWNED_FIELDS if name in self.model_fields_set}


class CodeInterpreterResponse(BaseModel):
    execution_id: str
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    oom_killed: bool
    duration_ms: int
    killed: bool = Field(default=False, description="Stopped by DELETE /executions/{id}.")
    queued_ms: int = Field(default=0, description="Time spent waiting for a free slot (not counted in timeout_s).")


class Admission:
    """At most `capacity` executions at once and `queue_size` waiting; past that, 429 at once."""

    def __init__(self, capacity: int, queue_size: int) -> None:
        self.capacity = capacity
        self.queue_size = queue_size
        self._slots = anyio.Semaphore(capacity)
        self.waiting = 0

    @property
    def running(self) -> int:
        return self.capacity - self._slots.value

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        if self._slots.value == 0 and self.waiting >= self.queue_size:
            raise ReplicaFull(
                # Never how many run or wait: those are other tenants' work.
                "At capacity: every execution slot of the service is busy and its queue "
                "(METAAGENT_EXECUTION_QUEUE_SIZE) is full; retry shortly",
                retry_after_s=2,
            )
        self.waiting += 1
        queued_at = time.monotonic()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield time.monotonic() - queued_at
        finally:
            self._slots.release()


def probe_spec(cpus: float) -> ProbeSpec:
    """The runtime self-test's container: a JavaScript execution's, with the default memory and `cpus`
    (in JavaScript's image, whichever languages are served)."""
    return lambda image_ref, runtime: container_spec(
        new_execution_id(), image_ref, DEFAULT_MEMORY_MB, cpus, runtime=runtime, language=JAVASCRIPT
    )


def pool_memory_mb(language: Language) -> int:
    """The memory of a language's warm containers: the default request's, or the language's least if more."""
    return max(DEFAULT_MEMORY_MB, language.min_memory_mb)


@dataclass(frozen=True)
class Lane:
    """One served language's image and warm pool."""

    language: Language
    image: SandboxImage
    pool: WarmPool


class CodeInterpreter:
    """Runs code in the languages of its images (one lane each), one-shot here and for sessions.

    `images` has one image per served language (JavaScript's among them: the runtime self-test and npm
    packages use it); `pool_limits` are each lane's, by language name (none: no pool), as
    `sandbox.sizing.pool_limits` makes them with the memory budget split among the lanes.
    """

    def __init__(
        self,
        engine: Engine,
        images: Sequence[SandboxImage],
        registry: ExecutionRegistry,
        audit: AuditLog,
        *,
        capacity: int,
        queue_size: int,
        cpus: float,
        grace_s: float,
        runtime: RuntimeChoice,
        pool_limits: Mapping[str, PoolLimits] | None = None,
        packages: PackageStore | None = None,
        network: SandboxNetwork | None = None,
        workspace_mb: int = 100,
    ) -> None:
        self.engine = engine
        self.runtime = runtime
        self.registry = registry
        self.audit = audit
        self.admission = Admission(capacity, queue_size)
        self.cpus = cpus
        self.grace_s = grace_s
        self.workspace_mb = workspace_mb
        self.lanes: dict[str, Lane] = {}
        for image in images:
            pool = WarmPool(
                engine,
                image,
                limits=(pool_limits or {}).get(image.language.name, PoolLimits.off()),
                memory_mb=pool_memory_mb(image.language),
                make_spec=self._pool_spec_of(image.language),
            )
            self.lanes[image.language.name] = Lane(image.language, image, pool)
        if JAVASCRIPT.name not in self.lanes:
            raise ValueError("the code interpreter needs JavaScript's image (its runtime self-test and packages)")
        self.packages = packages
        self.network = network
        self.closing = False

    def close(self) -> None:
        """Refuses new executions and stops refilling the pool (at a shutdown signal)."""
        self.closing = True
        for lane in self.lanes.values():
            lane.pool.close()
        if self.packages is not None:
            self.packages.stop_installing()

    async def __call__(
        self, request: CodeInterpreterRequest, caller: str | None = None, sink: OutputSink | None = None
    ) -> CodeInterpreterResponse:
        """Runs one execution; its answer. With `sink`, the output also goes there while it runs.

        Every refusal (400, 429, 503) is raised before `sink.started()`: after it, only failures.
        """
        self._refuse_if_closing()
        lane = self.lane(request.language, memory_mb=request.memory_mb, packages=request.packages)
        dependencies = self.check_packages(request.packages)
        allowlist = self.network_allowlist(request.network)
        image_ref = await lane.image.require()
        runtime = await self.runtime_in_force()
        outcome: Outcome | None = None
        error: str | None = None
        network: ExecutionNetwork | None = None
        # Packages are installed before the slot is taken: an install is not an execution's time.
        async with (
            self.provide_packages(request.packages, dependencies, caller) as packages,
            self.admission.slot() as queued_s,
        ):
            self._refuse_if_closing()  # the service may have begun to stop while this execution was queued
            warm = await self._take_warm(lane, request, image_ref)
            execution_id = warm.execution_id if warm else new_execution_id()
            execution = Execution(execution_id, request.timeout_s, request.memory_mb, caller=caller)
            if self.network is not None and allowlist is not None:
                network = self.network.for_execution(execution_id, allowlist)
            mounts = (*(network.mounts if network else ()), *((packages.mount(),) if packages else ()))
            spec = (
                warm.spec
                if warm
                else container_spec(
                    execution_id,
                    image_ref,
                    request.memory_mb,
                    self.cpus,
                    mounts,
                    workspace_mb=self.workspace_mb,
                    runtime=runtime,
                    language=lane.language,
                    cpu_control=self.engine.cpu_control.available,
                )
            )
            await self.registry.add(execution)
            try:
                end_token = secrets.token_hex(16) if lane.language.tells_its_end else None
                async with network or nullcontext():
                    outcome = await execute(
                        self.engine,
                        spec,
                        payload(request.code, request.stdin, network.runner if network else None, end_token),
                        execution,
                        timeout_s=request.timeout_s,
                        grace_s=self.grace_s,
                        prepared=warm.prepared if warm else None,
                        sink=sink,
                        end_token=end_token,
                        retire=lane.pool.retire if packages is None else None,  # a volume it holds goes after it
                    )
            except MetaAgentError as exc:
                error = exc.message
                raise
            finally:
                await self.registry.discard(execution)
                if warm is not None:
                    lane.pool.finished()
                self._audit(request, lane, execution, spec, warm is not None, outcome, error, packages, network)
        return CodeInterpreterResponse(
            execution_id=execution.execution_id,
            exit_code=outcome.exit_code,
            stdout=outcome.stdout.text(),
            stderr=outcome.stderr.text(),
            stdout_truncated=outcome.stdout.truncated,
            stderr_truncated=outcome.stderr.truncated,
            timed_out=outcome.timed_out,
            oom_killed=outcome.oom_killed,
            duration_ms=outcome.duration_ms,
            killed=outcome.killed,
            queued_ms=int(queued_s * 1000),
        )

    @property
    def javascript(self) -> Lane:
        """JavaScript's lane: its image is the runtime self-test's and the npm packages' (always served)."""
        return self.lanes[JAVASCRIPT.name]

    def lane(self, name: str, *, memory_mb: int, packages: list[str]) -> Lane:
        """The lane of a request's language; a 400 before anything starts for a language not served, or
        for what the language does not support (packages, too little memory)."""
        language = served_language(name, self.lanes)
        language.check_request(memory_mb=memory_mb, packages=packages)
        return self.lanes[language.name]

    async def runtime_in_force(self) -> Runtime:
        """The isolation runtime of every container of this interpreter, whatever its language
        (self-tested on first use, in JavaScript's image)."""
        if self.runtime.runtime is not None:
            return self.runtime.runtime
        image_ref = await self.javascript.image.require()
        return await self.runtime.require(self.engine, image_ref, probe_spec(self.cpus))

    def _pool_spec_of(self, language: Language) -> Callable[[str, str], Awaitable[ContainerSpec]]:
        async def pool_spec(execution_id: str, image_ref: str) -> ContainerSpec:
            return container_spec(
                execution_id,
                image_ref,
                pool_memory_mb(language),
                self.cpus,
                workspace_mb=self.workspace_mb,
                runtime=await self.runtime_in_force(),
                language=language,
                cpu_control=self.engine.cpu_control.available,
            )

        return pool_spec

    def _refuse_if_closing(self) -> None:
        if self.closing:
            raise Unavailable("The service is shutting down; retry on another instance")

    async def _take_warm(self, lane: Lane, request: CodeInterpreterRequest, image_ref: str) -> Warm | None:
        """A pooled container of the request's lane when the request is for its pool's configuration."""
        return await self.take_warm(lane, request.memory_mb, request.packages, request.network, image_ref)

    async def take_warm(
        self, lane: Lane, memory_mb: int, packages: list[str], network: object | None, image_ref: str
    ) -> Warm | None:
        """A warm container of `lane` for an execution or a session of its pool's configuration (no
        packages, no network), or None: the cold path. A taken one is told back with `lane.pool.finished()`."""
        if memory_mb != lane.pool.memory_mb or packages or network is not None:
            return None
        return await lane.pool.take_or_wait(image_ref)

    def check_packages(self, requested: list[str]) -> dict[str, str]:
        """The npm dependencies a request's packages come to; a 400 before anything runs otherwise."""
        if not requested:
            return {}
        if self.packages is None:
            raise PackageRefused(
                f"Package not allowed: {requested[0]} (packages are not served here: run the service)",
                package=requested[0],
                rule="not-allowed",
            )
        return self.packages.check(requested)

    @asynccontextmanager
    async def provide_packages(
        self, requested: list[str], dependencies: dict[str, str], caller: str | None
    ) -> AsyncIterator[PreparedPackages | None]:
        """The packages' volume (npm packages are JavaScript's: installed with JavaScript's image)."""
        if not dependencies or self.packages is None:
            yield None
            return
        image = await self.javascript.image.require()
        async with self.packages.provide(requested, dependencies, image, caller) as prepared:
            yield prepared

    def network_allowlist(self, network: NetworkPolicy | None) -> AllowList | None:
        """The execution's own egress allow-list, None without `network`; raises RequestRefused (400)."""
        if network is None:
            return None
        if self.network is None:
            raise RequestRefused("Network for sandboxed code is not enabled on this service; remove `network`")
        return self.network.allowlist_for(network.allow)

    def _audit(
        self,
        request: CodeInterpreterRequest,
        lane: Lane,
        execution: Execution,
        spec: ContainerSpec,
        warm: bool,
        outcome: Outcome | None,
        error: str | None,
        packages: PreparedPackages | None,
        network: ExecutionNetwork | None,
    ) -> None:
        result: dict[str, Any]
        if outcome is not None:
            result = {
                "status": "completed",
                "exit_code": outcome.exit_code,
                "timed_out": outcome.timed_out,
                "oom_killed": outcome.oom_killed,
                "killed": outcome.killed,
                "duration_ms": outcome.duration_ms,
                "stdout_bytes": outcome.stdout.produced,
                "stderr_bytes": outcome.stderr.produced,
            }
        else:
            result = {"status": "error", "error": error or "cancelled"}
        self.audit.append(
            "execution.finished",
            execution_id=execution.execution_id,
            caller=execution.caller,
            started_at=execution.started_at.isoformat(timespec="milliseconds"),
            finished_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            **code_fields(request.code),
            stdin_bytes=len((request.stdin or "").encode()),
            limits={
                "timeout_s": request.timeout_s,
                "memory_mb": request.memory_mb,
                "cpus": self.cpus,
                "stdout_cap": STDOUT_CAP,
                "stderr_cap": STDERR_CAP,
            },
            packages=packages.audit_record() if packages else {**NO_PACKAGES, "requested": request.packages},
            network=network.audit_record() if network else None,
            container_id=execution.container_id,
            container_path="warm" if warm else "cold",
            language=lane.language.name,
            image=spec.image,
            image_id=lane.image.image_id,
            security=spec.security_context(),
            outcome=result,
        )
