"""The sessions of this service: their containers, their calls and file requests, and their ends.

A session is created in its language's lane: on a warm container of that lane when it asks for its
pool's configuration, else on a new one, with the same container spec (`languages.container`), limits
and audit as a one-shot execution (`tools.code_interpreter`), and the workspace. Its calls and file
requests run one at a time, in arrival order; at most `queue_size` wait (429 past that). It ends when it
is closed, idle past its `idle_timeout_s`, past the lifetime cap, when its process ends, or when the
service stops; for an hour afterwards its id answers 410 with the reason. To every caller but its
owner (the API key that created it) it does not exist (404), open or ended.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from metaagent import hints
from metaagent.audit import AuditLog
from metaagent.background import held_in, logged
from metaagent.errors import (
    AtCapacity,
    Gone,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RequestRefused,
    Unavailable,
    UpstreamTimeout,
)
from metaagent.executions import Execution, ExecutionRegistry, new_execution_id
from metaagent.languages import code_fields
from metaagent.languages.container import container_spec
from metaagent.latch import Latch, first_of
from metaagent.sandbox.execute import STDOUT_CAP, prepare, session_payload, wait_ready
from metaagent.sandbox.output import OutputSink
from metaagent.sandbox.session_container import (
    MAX_LISTED,
    CallOutcome,
    Download,
    FileRefused,
    FileTooLarge,
    SessionContainer,
    SessionGone,
)
from metaagent.sandbox.wire_socket import WireListener
from metaagent.sessions.call_errors import call_error
from metaagent.sessions.models import (
    FileDeleted,
    FileInfo,
    FileList,
    FileWritten,
    ImageOut,
    SessionClosed,
    SessionCreateRequest,
    SessionEnding,
    SessionExecuteRequest,
    SessionExecuteResponse,
    SessionRecord,
)
from metaagent.sessions.paths import checked_path
from metaagent.tenancy import Caller, may_access, visible_to
from metaagent.tools.code_interpreter import CodeInterpreter, Lane, NetworkPolicy

log = logging.getLogger("metaagent.sessions")

TOMBSTONE_S = 2 * 3600  # the contract asks for "at least an hour"
MAX_TOMBSTONES = 100_000
RESULT_CAP = STDOUT_CAP
_REAP_INTERVAL_S = 1.0
_REMOVE_RETRY_S = 5.0  # between the reaper's retries of a removal the engine did not confirm
# How long a close waits for the container's removal after the kill (which has its own deadline): the
# removal's deadline and a margin.
_CLOSE_WAIT_S = 20.0
# Ends the service caused, as opposed to the process ending by itself: a call cut by one was killed.
_SERVICE_ENDS = frozenset({"closed", "idle", "lifetime", "killed", "stopped", "timeout"})


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int
    per_key: int
    queue_size: int
    max_lifetime_s: int
    max_file_bytes: int
    file_timeout_s: float = 30.0


@dataclass
class Session:
    session_id: str
    owner: str | None
    config: SessionCreateRequest
    created_at: datetime
    created_mono: float
    lifetime_s: int
    container: SessionContainer | None = None
    last_used_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    last_used_mono: float = field(default_factory=time.monotonic)
    executions: int = 0
    busy: bool = False
    waiting: int = 0
    # Not a Lock: a download holds it from the request's task to its response's.
    turn: anyio.Semaphore = field(default_factory=lambda: anyio.Semaphore(1))
    resources: AsyncExitStack = field(default_factory=AsyncExitStack)
    retired: Latch = field(default_factory=Latch)
    unremoved: Latch = field(default_factory=Latch)  # ended, and the engine did not confirm the removal
    container_path: str = "cold"
    security: dict[str, Any] = field(default_factory=dict)  # the container's, as its audit record gives it

    def expires_at(self) -> datetime:
        idle = self.last_used_at + timedelta(seconds=self.config.idle_timeout_s)
        return min(idle, self.created_at + timedelta(seconds=self.lifetime_s))

    def record(self) -> SessionRecord:
        return SessionRecord(
            session_id=self.session_id,
            language=self.config.language,
            memory_mb=self.config.memory_mb,
            packages=self.config.packages,
            network=self.config.network,
            idle_timeout_s=self.config.idle_timeout_s,
            created_at=self.created_at,
            last_used_at=self.last_used_at,
            expires_at=self.expires_at(),
            state="busy" if self.busy else "idle",
            executions=self.executions,
        )


@dataclass(frozen=True)
class Ended:
    owner: str | None
    reason: str
    at: float


def new_session_id() -> str:
    return f"ses_{secrets.token_hex(12)}"


class Sessions:
    def __init__(
        self,
        interpreter: CodeInterpreter,
        registry: ExecutionRegistry,
        audit: AuditLog,
        limits: SessionLimits,
        *,
        workspace_mb: int,
    ) -> None:
        self.fleet = registry.fleet  # the shared state: each session's lease and record, ended ones' reasons
        self.interpreter = interpreter
        self.engine = interpreter.engine
        self.registry = registry
        self.audit = audit
        self.limits = limits
        self.workspace_mb = workspace_mb
        self._open: dict[str, Session] = {}
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self._group: anyio.abc.TaskGroup | None = None
        # Ended sessions whose container the engine did not confirm removed: when the reaper retries.
        self._unremoved: dict[str, float] = {}
        self.closing = False

    # --- the service's side ---

    async def run(self) -> None:
        """Holds the sessions' own tasks (each one's life, each kill the reaper starts) until cancelled.
        Each of them logs its own failure: none ends another."""
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                await anyio.sleep_forever()
            finally:
                self._group = None

    async def reap(self) -> None:
        """Ends idle and expired sessions, and retries the removal of ended ones' containers, until cancelled."""
        while True:
            await anyio.sleep(_REAP_INTERVAL_S)
            self._reap()

    def _reap(self) -> None:
        now = time.monotonic()
        for session in list(self._open.values()):
            container = session.container
            if container is None:
                continue  # still being created
            if container.ended.is_set():
                if session.session_id in self._unremoved and now >= self._unremoved[session.session_id]:
                    self._spawn(self._finish, session, container, what=f"the removal of {session.session_id}")
                continue
            idle_s = now - session.last_used_mono
            if now - session.created_mono >= session.lifetime_s:
                self._end_soon(session, "lifetime")
            elif not session.busy and session.waiting == 0 and idle_s >= session.config.idle_timeout_s:
                self._end_soon(session, "idle")
        while self._ended and (
            len(self._ended) > MAX_TOMBSTONES or now - next(iter(self._ended.values())).at > TOMBSTONE_S
        ):
            self._ended.popitem(last=False)

    def _spawn(self, job: Callable[..., Awaitable[object]], *args: Any, what: str) -> None:
        if self._group is not None:
            self._group.start_soon(logged, what, job, *args)

    def _end_soon(self, session: Session, reason: str) -> None:
        if session.container is not None and not session.container.ended.is_set():
            self._spawn(session.container.kill, reason, what=f"the end of session {session.session_id}")

    async def _finish(self, session: Session, container: SessionContainer) -> None:
        """Retries the removal of an ended session's container; once the engine confirms it, it retires."""
        retry_at = self._unremoved.pop(session.session_id, None)
        if retry_at is None:
            return  # another tick's retry runs
        if await container.remove():
            await self._retire(session, container.end_reason or "exited")
        else:
            self._unremoved[session.session_id] = time.monotonic() + _REMOVE_RETRY_S

    def begin_close_all(self, reason: str) -> None:
        """Refuses new sessions and starts ending every open one (at a shutdown signal)."""
        self.closing = True
        for session in list(self._open.values()):
            self._end_soon(session, reason)

    async def close_all(self, reason: str) -> None:
        """Ends every session (its calls get their answers) and waits (bounded) for their containers."""
        self.closing = True
        async with anyio.create_task_group() as group:
            for session in list(self._open.values()):
                if session.container is not None:
                    group.start_soon(session.container.kill, reason)
        with anyio.move_on_after(30):
            for session in list(self._open.values()):
                await session.retired.wait()

    @property
    def open_count(self) -> int:
        return len(self._open)

    # --- lookups ---

    def check_own_values(self, session_id: str, values: dict[str, Any], caller: Caller) -> None:
        """A call into a session may repeat the session's own settings (strict-mode callers send every
        property, and models echo defaults); a different value is a 422 naming the field and the session's."""
        config = self.get(session_id, caller).config
        for name, value in values.items():
            own = getattr(config, name, None)  # stdin: a session has none (its calls read no input)
            if _comparable(value) != _comparable(own):
                raise InvalidRequest.for_field(
                    name,
                    f"session {session_id} has {name} {_shown(own)}, not {_shown(value)}; leave {name} out "
                    f"(or null) in a call into a session, or create another session with it "
                    f"({hints.hint(hints.CREATE_SESSION)})",
                )

    def get(self, session_id: str, caller: Caller) -> Session:
        """The caller's session (an operator's key: anyone's); 410 once it ended, 404 for anyone else's."""
        session = self._open.get(session_id)
        if session is not None and may_access(caller, session.owner):
            container = session.container
            if container is not None and container.ended.is_set():  # ending: retired in a moment
                reason = container.end_reason or "exited"
                raise Gone(f"Session {session_id} has ended: {reason}", reason=reason)
            return session
        ended = self._ended.get(session_id)
        if ended is not None and may_access(caller, ended.owner):
            raise Gone(f"Session {session_id} has ended: {ended.reason}", reason=ended.reason)
        raise NotFound(f"No session {session_id!r}; to create one, {hints.hint(hints.CREATE_SESSION)}")

    def list(self, caller: Caller) -> list[SessionRecord]:
        ready = [s for s in self._open.values() if s.container is not None and not s.container.ended.is_set()]
        return [s.record() for s in visible_to(caller, ready, lambda s: s.owner)]

    # --- create and close ---

    async def create(self, request: SessionCreateRequest, tenant: Caller) -> SessionRecord:
        if self.closing or self.interpreter.closing:
            raise Unavailable("The service is shutting down; retry on another instance")
        interpreter = self.interpreter
        lane = interpreter.lane(request.language, memory_mb=request.memory_mb, packages=request.packages)
        caller = tenant.key_id
        dependencies = interpreter.check_packages(request.packages)
        allowlist = interpreter.network_allowlist(request.network)
        session_id = new_session_id()
        await self._admit(session_id, tenant)
        session = Session(
            session_id,
            caller,
            request,
            datetime.now(UTC),
            time.monotonic(),
            self.limits.max_lifetime_s,
        )
        self._open[session.session_id] = session
        try:
            await self._start(session, lane, dependencies, allowlist)
        except BaseException:
            self._open.pop(session.session_id, None)
            with anyio.CancelScope(shield=True):
                await self.fleet.release("sessions", session.session_id)
                await session.resources.aclose()
            raise
        await self.fleet.publish("session", session.session_id, caller, {})
        self.audit.append(
            "session.created",
            session_id=session.session_id,
            caller=caller,
            container_id=session.container.container_id if session.container else None,
            container_path=session.container_path,
            security=session.security,
            limits={
                "memory_mb": request.memory_mb,
                "cpus": interpreter.cpus,
                "idle_timeout_s": request.idle_timeout_s,
                "lifetime_s": session.lifetime_s,
                "workspace_mb": self.workspace_mb,
            },
            packages=list(request.packages),
            network=request.network.model_dump() if request.network else None,
            language=lane.language.name,
            image_id=lane.image.image_id,
        )
        return session.record()

    async def _admit(self, session_id: str, tenant: Caller) -> None:
        """Takes a place for one more session of `tenant` (its lease, in the fleet's shared state): under the
        total, and under its key's share unless it is an operator's key. A refusal gives the caller its own
        numbers only, never how many others hold."""
        admission = await self.fleet.acquire(
            "sessions",
            session_id,
            tenant.key_id,
            per_key=None if tenant.operator else self.limits.per_key,
            total=self.limits.max_sessions,
        )
        mine = admission.mine
        who = f"Key {tenant.key_id}" if tenant.key_id is not None else "This caller"
        if admission.refused == "per_key":
            raise AtCapacity(
                f"{who} already has {mine} sessions open, its share (METAAGENT_SESSIONS_PER_KEY: "
                f"{self.limits.per_key}); close one first ({hints.hint(hints.CLOSE_SESSION)})",
                retry_after_s=5,
            )
        if admission.refused == "total":
            raise AtCapacity(
                f"At capacity: the service has as many sessions open as it may (METAAGENT_SESSION_MAX), {mine} "
                f"of them yours; close one ({hints.hint(hints.CLOSE_SESSION)}) or retry later",
                retry_after_s=5,
            )

    def _serving(self) -> anyio.abc.TaskGroup:
        """The group that holds the sessions' own tasks, which a session's start needs."""
        if self._group is None:
            raise Unavailable("Sessions are not being served yet; retry in a moment")
        return self._group

    async def _start(self, session: Session, lane: Lane, dependencies: dict[str, str], allowlist: Any) -> None:
        interpreter, language = self.interpreter, lane.language
        request = session.config
        image_ref = await lane.image.require()
        packages = await session.resources.enter_async_context(
            interpreter.provide_packages(request.packages, dependencies, session.owner)
        )
        network = None
        if interpreter.network is not None and allowlist is not None:
            # Its tunnel server's task group is left by whichever task ends the session: held in a task of its
            # own. Shielded (the engine's deadlines bound it): a hang-up between that task's start and `leave`
            # on the session's exit stack would leave the network held until the service stops.
            uses = interpreter.network.for_execution(session.session_id, allowlist)
            with anyio.CancelScope(shield=True):
                network, leave = await held_in(self._serving(), uses, f"the network of session {session.session_id}")
                session.resources.push_async_callback(leave)
        warm = await interpreter.take_warm(lane, request.memory_mb, request.packages, network, image_ref)
        if warm is not None:
            lane.pool.finished()  # a session keeps its container: the pool replaces it now
            prepared = warm.prepared
            session.container_path = "warm"
            session.security = warm.spec.security_context()
        else:
            mounts = (*(network.mounts if network else ()), *((packages.mount(),) if packages else ()))
            spec = container_spec(
                new_execution_id(), image_ref, request.memory_mb, interpreter.cpus, mounts=mounts,
                workspace_mb=self.workspace_mb, runtime=await interpreter.runtime_in_force(),
                language=language, cpu_control=self.engine.cpu_control.available,
            )  # fmt: skip
            session.security = spec.security_context()
            prepared = await prepare(self.engine, spec, start=True)
            try:
                if not await wait_ready(prepared):
                    raise Unavailable(f"The session's runner did not start: {prepared.output.stderr.text()[:300]!r}")
                await prepared.limit_cpus(self.engine)
            except BaseException:
                prepared.sock.close()
                with anyio.CancelScope(shield=True):
                    await self.engine.remove(prepared.container_id)
                raise
        try:
            group = self._serving()
            wire_listener = WireListener(await self.engine.wire_folder())  # closed by the container's run, always
        except BaseException:
            prepared.sock.close()
            with anyio.CancelScope(shield=True):
                await self.engine.remove(prepared.container_id)
            raise
        container = SessionContainer(
            self.engine,
            prepared,
            grace_s=interpreter.grace_s,
            file_timeout_s=self.limits.file_timeout_s,
            out_of_memory_message=language.out_of_memory_message,
            wire_listener=wire_listener,
        )
        header = session_payload(network.runner if network else None, wire_listener.path_in_container)
        try:
            await group.start(self._serve, session, container, header)
        except SessionGone as gone:
            raise Unavailable(f"The session's runner did not start ({gone.reason})") from None

    async def _serve(
        self, session: Session, container: SessionContainer, header: bytes, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """The session's life: its container runs (and reads its stream) until it ends; then it retires."""
        started = False

        def ready() -> None:
            nonlocal started
            started = True
            session.container = container
            task_status.started()

        try:
            await container.run(header, on_ready=ready)
        except Exception:
            if not started:
                raise  # the creation's: its caller answers
            log.exception("session %s failed; it has ended", session.session_id)
        finally:
            with anyio.CancelScope(shield=True):
                if started and container.removed.is_set():
                    await self._retire(session, container.end_reason or "exited")
                elif started:  # the engine did not confirm the removal: the reaper retries it
                    self._unremoved[session.session_id] = time.monotonic() + _REMOVE_RETRY_S
                    session.unremoved.set()

    async def _retire(self, session: Session, reason: str) -> None:
        self._open.pop(session.session_id, None)
        self._ended[session.session_id] = Ended(session.owner, reason, time.monotonic())
        try:
            await self.fleet.release("sessions", session.session_id)
            await self.fleet.withdraw("session", session.session_id)
            await self.fleet.bury(session.session_id, session.owner, reason, keep_s=TOMBSTONE_S)
            await session.resources.aclose()
        finally:
            session.retired.set()
            self.audit.append(
                "session.ended",
                session_id=session.session_id,
                caller=session.owner,
                reason=reason,
                executions=session.executions,
                exit_code=session.container.exit_code if session.container else None,
            )

    async def close(self, session_id: str, caller: Caller) -> SessionClosed:
        """Ends the session; answers once its container is gone, or, when the engine does not confirm that
        within its deadlines, `SessionEnding` (the session has ended; the reaper removes the container)."""
        session = self.get(session_id, caller)
        if session.container is not None:
            await session.container.kill("closed")
        with anyio.move_on_after(_CLOSE_WAIT_S):
            await first_of(session.retired, session.unremoved)
        if not session.retired.is_set():
            return SessionEnding(session_id=session_id)
        return SessionClosed(session_id=session_id)

    # --- calls and file requests, one at a time ---

    @asynccontextmanager
    async def _use(self, session: Session) -> AsyncIterator[SessionContainer]:
        if session.waiting >= self.limits.queue_size:
            raise AtCapacity(
                f"Session {session.session_id} has {session.waiting} calls waiting (METAAGENT_SESSION_QUEUE); "
                "retry when one is done",
                retry_after_s=2,
            )
        session.waiting += 1
        try:
            await session.turn.acquire()
        finally:
            session.waiting -= 1
        try:
            container = session.container
            if container is None or container.ended.is_set():
                raise Gone(
                    f"Session {session.session_id} has ended: {container.end_reason if container else 'exited'}",
                    reason=(container.end_reason if container else None) or "exited",
                )
            session.busy = True
            yield container
        finally:
            session.busy = False
            session.last_used_at = datetime.now(UTC)
            session.last_used_mono = time.monotonic()
            session.turn.release()

    async def execute(
        self,
        session_id: str,
        request: SessionExecuteRequest,
        tenant: Caller,
        sink: OutputSink | None = None,
    ) -> SessionExecuteResponse:
        """One call, buffered (no sink) or streamed to `sink`: the same path either way.

        Every call whose code was handed over gets its `session.call` record, whatever happened next: the
        record is written in a `finally`, from the call's outcome, before the answer is built from it, so
        no failure while answering (nor a caller who hung up) can skip it.
        """
        session = self.get(session_id, tenant)
        caller = tenant.key_id
        queued_at = time.monotonic()
        execution: Execution | None = None
        outcome: CallOutcome | None = None
        failure = ""
        try:
            async with self._use(session) as container:
                queued_ms = int((time.monotonic() - queued_at) * 1000)
                execution = Execution(
                    new_execution_id(), request.timeout_s, session.config.memory_mb, caller=caller,
                    container_id=container.container_id, session_id=session_id,
                )  # fmt: skip
                await self.registry.add(execution)
                try:
                    outcome = await container.call(request.code, request.timeout_s, execution, sink)
                finally:
                    await self.registry.discard(execution)
                session.executions += 1
            if outcome.status == "ended":  # its answer arrives once the session is gone
                with anyio.move_on_after(30):
                    await session.retired.wait()
        except BaseException as exc:
            failure = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else type(exc).__name__
            raise
        finally:
            if execution is not None:
                self._audit_call(session_id, execution, request.code, outcome, failure)
        return _response(
            session_id,
            execution.execution_id,
            outcome,
            queued_ms,
            timeout_s=request.timeout_s,
            memory_mb=session.config.memory_mb,
        )

    def _audit_call(
        self, session_id: str, execution: Execution, code: str, outcome: CallOutcome | None, failure: str
    ) -> None:
        result: dict[str, Any]
        if outcome is None:  # the caller hung up ("cancelled"), or the call failed (the exception's class)
            result = {"status": "error", "error": failure or "cancelled"}
        else:
            flags = _flags(outcome)
            result = {
                "status": "completed",
                "exit_code": flags.exit_code,
                "timed_out": flags.timed_out,
                "killed": flags.killed,
                "oom_killed": outcome.oom_killed,
                "session_ended": flags.ended,
                "duration_ms": outcome.duration_ms,
                "stdout_bytes": outcome.stdout.produced,
                "stderr_bytes": outcome.stderr.produced,
            }
        self.audit.append(
            "session.call",
            session_id=session_id,
            execution_id=execution.execution_id,
            caller=execution.caller,
            **code_fields(code),
            outcome=result,
        )

    async def put_file(self, session_id: str, path: str, chunks: AsyncIterator[bytes], tenant: Caller) -> FileWritten:
        session = self.get(session_id, tenant)
        caller = tenant.key_id
        digest = hashlib.sha256()

        async def hashed() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                digest.update(chunk)
                yield chunk

        async with self._use(session) as container:
            try:
                size = await container.put(path, hashed(), self.limits.max_file_bytes)
            except FileTooLarge:
                raise PayloadTooLarge(
                    f"The file is larger than {self.limits.max_file_bytes // (1024 * 1024)} MiB "
                    "(METAAGENT_SESSION_MAX_FILE_MB)"
                ) from None
            except (FileRefused, SessionGone) as exc:
                raise _file_error(session, path, exc) from None
        written = FileWritten(path=path, size=size, sha256=digest.hexdigest())
        self.audit.append("session.file_written", session_id=session_id, caller=caller, **written.model_dump())
        return written

    @asynccontextmanager
    async def read_file(self, session_id: str, path: str, caller: Caller) -> AsyncIterator[Download]:
        """The file's size and bytes; the session is held (no other call runs) until the block ends."""
        session = self.get(session_id, caller)
        async with self._use(session) as container:
            try:
                download = await container.get(path)
            except (FileRefused, SessionGone) as exc:
                raise _file_error(session, path, exc) from None
            try:
                yield download
            finally:
                await download.close()

    async def list_files(self, session_id: str, caller: Caller) -> FileList:
        session = self.get(session_id, caller)
        async with self._use(session) as container:
            try:
                reply = await container.list()
            except (FileRefused, SessionGone) as exc:
                raise _file_error(session, "", exc) from None
        try:
            # Up to 10,000 entries: checked, and sorted below, off the event loop.
            files = await anyio.to_thread.run_sync(_checked_sorted_listing, reply)
        except ValueError as exc:  # the supervisor never sends one: the container is not to be believed
            log.warning("session %s sent a listing that breaks the rules (%s); ending it", session_id, exc)
            await container.kill("killed")
            raise _file_error(session, "", SessionGone("killed")) from None
        return FileList(files=files)

    async def delete_file(self, session_id: str, path: str, tenant: Caller) -> FileDeleted:
        session = self.get(session_id, tenant)
        caller = tenant.key_id
        async with self._use(session) as container:
            try:
                await container.delete(path)
            except (FileRefused, SessionGone) as exc:
                raise _file_error(session, path, exc) from None
        self.audit.append("session.file_deleted", session_id=session_id, caller=caller, path=path)
        return FileDeleted(path=path)


def _file_error(session: Session, path: str, exc: FileRefused | SessionGone) -> Exception:
    if isinstance(exc, SessionGone):
        if exc.reason == "timeout":
            return UpstreamTimeout(
                f"Session {session.session_id} did not answer the file request in time (its code may block the "
                "event loop); it has been ended"
            )
        return Gone(f"Session {session.session_id} has ended: {exc.reason}", reason=exc.reason)
    if exc.kind == "not_found":
        listing = hints.hint(hints.LIST_FILES, session_id=session.session_id)
        return NotFound(f"No file {path!r} in the workspace ({exc.message}); to see its files, {listing}")
    if exc.kind == "full":
        return InsufficientStorage(
            "The session's workspace is full (METAAGENT_SESSION_WORKSPACE_MB); delete files "
            f"({hints.hint(hints.DELETE_FILE, session_id=session.session_id)}) and retry"
        )
    if exc.kind == "is_folder":
        return RequestRefused(f"{path} is a folder in the workspace; name a file")
    if exc.kind == "not_a_folder":
        return RequestRefused(f"A parent of {path} is a file in the workspace, not a folder")
    if exc.kind == "bad_path":
        return RequestRefused(f"Invalid workspace path: {path!r}")
    return Unavailable(f"The session could not do the file request: {exc.message}")


def _capped_result(result: str | None, produced: int, incomplete: bool = False) -> tuple[str | None, bool]:
    """The result as answered, and whether it is not the whole value: cut here at RESULT_CAP, or, as the
    runner says (`incomplete`), not the whole value though it fits (inspect could not show all of it)."""
    if result is None:
        return None, False
    data = result.encode()
    produced = max(produced, len(data))
    if produced <= RESULT_CAP:
        return result, incomplete
    shown = data[:RESULT_CAP].decode("utf-8", "ignore")  # the cap may cut the last character: it goes
    return f"{shown}\n[result truncated: {produced} bytes, the first {len(shown.encode())} shown]\n", True


@dataclass(frozen=True)
class _Flags:
    exit_code: int | None
    timed_out: bool
    killed: bool
    ended: bool


def _flags(outcome: CallOutcome) -> _Flags:
    """What a call's answer and its audit record both say of how it ended."""
    ended = outcome.status == "ended"
    return _Flags(
        exit_code=outcome.exit_code if ended else {"ok": 0, "threw": 1}.get(outcome.status),
        timed_out=outcome.timed_out or (ended and outcome.ended == "timeout"),
        killed=outcome.killed or (ended and outcome.ended in _SERVICE_ENDS and outcome.ended != "timeout"),
        ended=ended,
    )


def _response(
    session_id: str, execution_id: str, outcome: CallOutcome, queued_ms: int, *, timeout_s: int, memory_mb: int
) -> SessionExecuteResponse:
    flags = _flags(outcome)
    result, truncated = _capped_result(
        outcome.result if outcome.status == "ok" else None, outcome.result_bytes, outcome.result_incomplete
    )
    error = call_error(
        outcome, timed_out=flags.timed_out, killed=flags.killed, timeout_s=timeout_s, memory_mb=memory_mb
    )
    return SessionExecuteResponse(
        execution_id=execution_id,
        exit_code=flags.exit_code,
        stdout=outcome.stdout.text(),
        stderr=outcome.stderr.text(),
        stdout_truncated=outcome.stdout.truncated,
        stderr_truncated=outcome.stderr.truncated,
        timed_out=flags.timed_out,
        oom_killed=outcome.oom_killed,
        duration_ms=outcome.duration_ms,
        killed=flags.killed,
        queued_ms=queued_ms,
        session_id=session_id,
        result=result,
        result_truncated=truncated,
        error=error,
        images=[ImageOut(mime="image/png", data=data) for data in outcome.figures.images],
        images_truncated=outcome.figures.truncated,
        session_ended=flags.ended,
    )


__all__ = ["SessionLimits", "Sessions"]


def _checked_sorted_listing(reply: dict[str, Any]) -> list[FileInfo]:
    files = _checked_listing(reply)
    files.sort(key=lambda f: f.path.encode())
    return files


def _checked_listing(reply: dict[str, Any]) -> list[FileInfo]:
    """The files of a listing reply; ValueError when any part breaks the rules (types, count, paths)."""
    entries = reply.get("files")
    if not isinstance(entries, list) or len(entries) > MAX_LISTED:
        raise ValueError("files is not a list of at most 10,000 entries")
    files = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "modified_at"}:
            raise ValueError("an entry that is not {path, size, modified_at}")
        path, size = entry["path"], entry["size"]
        if not isinstance(path, str) or type(size) is not int or not 0 <= size < 1 << 53:
            raise ValueError("an entry's path or size has the wrong type")
        try:
            checked_path(path)
        except RequestRefused as exc:
            raise ValueError(f"a path that breaks the rules: {exc}") from None
        files.append(FileInfo.model_validate(entry))
    return files


def _comparable(value: Any) -> Any:
    """A session setting as compared: package lists and allowed hosts as sets (their order means nothing)."""
    if isinstance(value, NetworkPolicy):
        return ("network", frozenset(value.allow))
    if isinstance(value, list):
        return frozenset(value)
    return value


def _shown(value: Any) -> str:
    if isinstance(value, NetworkPolicy):
        return json.dumps(value.model_dump())
    return "none" if value is None else json.dumps(value)
