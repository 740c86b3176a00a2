"""The running service's parts: built once when the service starts, shared by HTTP routes and MCP.

`running_services(config)` builds them, starts the background work (orphan sweep and images, a warm
pool per served language, sessions and their reaper, each one supervised: restarted if it fails, and
named by /health while it is not running), and on the way out stops every execution and releases what
the parts hold.

Every language in `METAAGENT_LANGUAGES` is served in a lane of the code interpreter, with its image
(checked, or built in the background, at start-up) and its warm pool. JavaScript's image is made sure of
first and never waits for another's: its executions run as soon as it is there, while a language whose
image is missing or still building answers 503 with the reason. `METAAGENT_SANDBOX_IMAGE` names
JavaScript's image only; every other language's tag is its recipe's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import anyio

from metaagent import metrics
from metaagent.access import ExecutionQuota
from metaagent.audit import AuditLog
from metaagent.background import BackgroundTasks
from metaagent.egress.allowlist import AllowList, empty_items_warning
from metaagent.egress.guard import EgressGuard
from metaagent.egress.pool import ConnectionLimits
from metaagent.executions import ExecutionRegistry
from metaagent.fleet.replica import FleetConfig, keep_beating, shared_state
from metaagent.fleet.routing import Forwarder, Peers
from metaagent.fleet.state import RedisState, SharedState, SharedStateUnavailable
from metaagent.languages import JAVASCRIPT, Language, served
from metaagent.packages.policy import SETTING as NPM_SETTING
from metaagent.packages.policy import PackagePolicy
from metaagent.packages.store import PackageStore, package_store
from metaagent.sandbox.engine import Engine, EngineUnavailable
from metaagent.sandbox.network import NetworkLimits, SandboxNetwork
from metaagent.sandbox.provision import SandboxImage
from metaagent.sandbox.runtime import RuntimeChoice, settle
from metaagent.sandbox.sizing import PoolLimits
from metaagent.sessions.service import SessionLimits, Sessions
from metaagent.settings import MIB, Settings
from metaagent.tools.code_interpreter import CodeInterpreter, Lane, probe_spec
from metaagent.tools.embeddings import EmbeddingsTool
from metaagent.tools.http import HttpTool
from metaagent.tools.search import SearchTool

log = logging.getLogger("metaagent")

EMPTY_ALLOWLIST_WARNING = (
    "ALLOW_HTTP_HOSTS is empty: every outbound request is blocked. "
    'Set it to a JSON array of hosts, e.g. ALLOW_HTTP_HOSTS=\'["api.openai.com", "*.example.com"]\''
)


@dataclass(frozen=True)
class Configuration:
    """What `create_app` read and validated before anything starts (a ConfigError stops start-up there)."""

    settings: Settings
    allowlist: AllowList
    package_policy: PackagePolicy
    extra_ca_pem: bytes
    runtime: RuntimeChoice
    pool_limits: dict[str, PoolLimits]  # each served language's warm pool (the memory budget split among them)
    key_count: int = 0  # API keys configured (0: none, one local caller)
    fleet: FleetConfig | None = None  # with Redis: more than one machine (metaagent.fleet)


@dataclass
class Services:
    settings: Settings
    allowlist: AllowList
    audit: AuditLog
    guard: EgressGuard
    http: HttpTool
    engine: Engine
    executions: ExecutionRegistry
    interpreter: CodeInterpreter
    search: SearchTool
    embeddings: EmbeddingsTool
    execution_quota: ExecutionQuota
    packages: PackageStore
    sessions: Sessions
    background_tasks: BackgroundTasks
    fleet: SharedState  # in memory on one machine; in Redis for a fleet
    peers: Peers | None = None  # the other replicas (a fleet only)

    def begin_stop(self) -> None:
        """Refuses new work, empties the warm pool, asks every running execution to be killed and ends
        every session (reason `stopped`)."""
        self.interpreter.close()
        self.executions.kill_all()
        self.sessions.begin_close_all("stopped")

    async def stop(self) -> None:
        """Stops new work, kills every execution and session, and waits (bounded) for their containers."""
        self.begin_stop()
        await self.sessions.close_all("stopped")
        with anyio.move_on_after(30):
            await self.executions.wait_empty()


async def settle_runtime(config: Configuration, engine: Engine | None = None) -> None:
    """With METAAGENT_SANDBOX_RUNTIME=runsc, tests runsc before anything serves (building the image
    first if it must): ConfigError, and no service, when it cannot work. Nothing to do for runc and auto,
    whose choice is made in the background and never refuses to start."""
    if config.runtime.setting != "runsc" or config.runtime.runtime is not None:
        return
    settings = config.settings
    own_engine = engine is None
    engine = engine or Engine()
    try:
        image = sandbox_image(engine, settings, JAVASCRIPT)
        await settle(
            config.runtime, engine, image, probe_spec(settings.sandbox_cpus), build=settings.sandbox_build_on_start
        )
    finally:
        if own_engine:
            engine.close()


def sandbox_image(engine: Engine, settings: Settings, language: Language) -> SandboxImage:
    """A served language's image: its recipe's tag, or for JavaScript METAAGENT_SANDBOX_IMAGE if set."""
    tag = settings.sandbox_image if language is JAVASCRIPT else None
    return SandboxImage(engine, tag=tag, cache_dir=settings.sandbox_cache_dir, language=language)


@asynccontextmanager
async def running_services(config: Configuration) -> AsyncIterator[Services]:
    settings = config.settings
    if config.allowlist.empty_items:
        log.warning(empty_items_warning("ALLOW_HTTP_HOSTS", config.allowlist.empty_items))
    if config.package_policy.empty_items:
        log.warning(empty_items_warning(NPM_SETTING, config.package_policy.empty_items))
    if not config.allowlist:
        log.warning(EMPTY_ALLOWLIST_WARNING)
    audit = AuditLog(settings.audit_log)
    guard = EgressGuard(
        config.allowlist,
        allow_private_networks=settings.allow_private_networks,
        audit=audit,
        limits=ConnectionLimits(
            per_host=settings.egress_connections_per_host,
            total=settings.egress_max_connections,
            max_wait_s=settings.egress_pool_wait_s,
        ),
    )
    http = HttpTool(
        guard,
        max_response_bytes=settings.http_max_response_bytes,
        max_redirects=settings.http_max_redirects,
    )
    engine = Engine()
    await settle_runtime(config, engine)
    images = [sandbox_image(engine, settings, language) for language in served(settings.languages).values()]
    fleet = shared_state(config.fleet)
    try:
        await fleet.start()
    except SharedStateUnavailable as exc:  # it serves what it can; its heartbeat keeps trying
        log.warning("fleet: %s", exc.message)
    forwarder = Forwarder(config.fleet.token) if config.fleet else None
    executions = ExecutionRegistry(fleet)
    for entry in config.package_policy.blocked_entries:
        log.warning("METAAGENT_NPM_ALLOWED_PACKAGES lists %s, which is on the block list: it stays refused", entry)
    packages = package_store(settings, config.package_policy, engine, audit)
    cpu_count = os.cpu_count() or 1
    interpreter = CodeInterpreter(
        engine,
        images,
        executions,
        audit,
        capacity=settings.effective_concurrency(cpu_count),
        queue_size=settings.execution_queue_size,
        cpus=settings.sandbox_cpus,
        grace_s=settings.kill_grace_s,
        runtime=config.runtime,
        pool_limits=config.pool_limits,
        packages=packages,
        network=SandboxNetwork(
            engine,
            guard,
            NetworkLimits(
                settings.sandbox_max_tunnels,
                settings.sandbox_max_tunnel_bytes,
                tunnel_rate=settings.sandbox_tunnel_rate,
            ),
            config.extra_ca_pem,
        ),
        workspace_mb=settings.session_workspace_mb,
    )
    session_max = settings.effective_session_max(cpu_count)
    sessions = Sessions(
        interpreter,
        executions,
        audit,
        SessionLimits(
            max_sessions=session_max,
            per_key=settings.effective_sessions_per_key(cpu_count, config.key_count),
            queue_size=settings.session_queue,
            max_lifetime_s=settings.session_max_lifetime_s,
            max_file_bytes=settings.session_max_file_mb * MIB,
            file_timeout_s=settings.session_file_timeout_s,
        ),
        workspace_mb=settings.session_workspace_mb,
    )
    if isinstance(fleet, RedisState):  # what this replica runs, for the others to hand work to the least busy
        fleet.load = partial(_load, interpreter, sessions)
    search, embeddings = SearchTool(guard, settings), EmbeddingsTool(guard, settings)
    metrics.watch_admission(interpreter.admission)
    for name, lane in interpreter.lanes.items():
        metrics.watch_pool(lane.pool, name)
    services = Services(
        settings,
        config.allowlist,
        audit,
        guard,
        http,
        engine,
        executions,
        interpreter,
        search,
        embeddings,
        ExecutionQuota(fleet, settings.max_executions_per_key),
        packages,
        sessions,
        BackgroundTasks(),
        fleet,
        Peers(fleet, forwarder) if forwarder else None,
    )
    prepared = anyio.Event()

    async def prepare() -> None:
        try:
            await _prepare_sandbox(interpreter, settings.sandbox_build_on_start)
        finally:
            prepared.set()  # the pools start whatever the preparation found (they retry starts themselves)

    def keep_pool(lane: Lane) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await prepared.wait()
            await lane.pool.run()

        return run

    async with anyio.create_task_group() as background:
        tasks = services.background_tasks
        tasks.start(background, "sandbox_setup", prepare)
        for name, lane in interpreter.lanes.items():
            task = "warm_pool" if lane.language is JAVASCRIPT else f"warm_pool_{name}"  # JavaScript's as before lanes
            tasks.start(background, task, keep_pool(lane))
        tasks.start(background, "sessions", sessions.run)
        tasks.start(background, "session_reaper", sessions.reap)
        tasks.start(background, "fleet_heartbeat", partial(keep_beating, fleet))
        try:
            yield services
        finally:
            await services.stop()
            with anyio.move_on_after(30):
                for lane in interpreter.lanes.values():
                    await lane.pool.stopped.wait()
            await _remove_package_volumes(packages)
            await _remove_what_is_still_owned(engine)
            with anyio.move_on_after(30):  # what failed runsc starts may have left, which the engine forgot
                await engine.remove_runtime_leftovers()
            await http.aclose()
            await search.aclose()
            await embeddings.aclose()
            await guard.aclose()
            if forwarder is not None:
                await forwarder.aclose()
            await fleet.close()
            engine.close()
            # Last: cancelling this task group's scope also cancels every await above in this task.
            background.cancel_scope.cancel()


def _load(interpreter: CodeInterpreter, sessions: Sessions) -> dict[str, int]:
    admission = interpreter.admission
    return {
        "running": admission.running,
        "waiting": admission.waiting,
        "capacity": admission.capacity,
        "queue": admission.queue_size,
        "sessions": sessions.open_count,
    }


async def _prepare_sandbox(interpreter: CodeInterpreter, build: bool) -> None:
    """Removes what a dead service left, makes sure of every served language's image and chooses the
    runtime (its self-test, in JavaScript's image).

    Each check runs (or finds the engine down) whatever the one before found, so that afterwards /health
    can report each (it says "starting" until every image and the runtime have been looked at). The other
    languages' images are looked for (and built) beside JavaScript's, never before it: a build of theirs
    does not hold up JavaScript, nor the runtime's choice."""
    async with anyio.create_task_group() as group:
        for lane in interpreter.lanes.values():
            if lane.language is not JAVASCRIPT:
                group.start_soon(partial(lane.image.refresh, build=build))  # never raises
        await _prepare_javascript(interpreter, build)


async def _prepare_javascript(interpreter: CodeInterpreter, build: bool) -> None:
    engine, image, runtime = interpreter.engine, interpreter.javascript.image, interpreter.runtime
    try:
        removed = await engine.remove_orphans()
    except EngineUnavailable as exc:
        log.warning("%s", exc.message)
    else:
        if removed:
            log.warning("removed %d container(s) or volume(s) of a service that stopped without cleaning up", removed)
    try:
        await runtime.check_registration(engine)  # runc at once when runsc cannot work
    except EngineUnavailable as exc:
        log.warning("%s", exc.message)
    await image.refresh(build=build)  # never raises: an engine that is down is its error
    if image.image_id is None:
        runtime.defer(image.error or "the sandbox image is not ready")
        return
    try:
        await interpreter.runtime_in_force()
    except EngineUnavailable as exc:  # chosen on the next execution instead
        log.warning("%s", exc.message)
        runtime.defer(exc.message)


async def _remove_what_is_still_owned(engine: Engine) -> None:
    """Whatever a removal on the way out left (it failed, or the engine was slow past its deadline)."""
    try:
        found = await engine.remove_owned(within_s=20)
    except EngineUnavailable as exc:
        log.warning("containers of this service may be left for its next start to remove: %s", exc.message)
    else:
        if found:
            log.warning("removed %d container(s) or volume(s) that the shutdown's own removals left", found)


async def _remove_package_volumes(packages: PackageStore) -> None:
    with anyio.move_on_after(30):
        try:
            await packages.close()
        except EngineUnavailable as exc:
            log.warning("package volumes were not removed: %s", exc.message)
