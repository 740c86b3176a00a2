"""Installed package sets, cached as read-only Docker volumes and mounted at /app/node_modules.

A set is keyed by what will be installed: the registry and the sorted {name: spec} dependencies the
policy produced. The first request for a key runs npm and fills a fresh named volume
(`metaagent-npm-<random>`, so its name reveals nothing); every later request for the key mounts the
same volume and runs nothing. A lock per key makes concurrent identical requests install once.

The volume delivers the files without a bind mount: its path lies under the engine's data root
(`/var/lib/docker/volumes/...`), which the container sees anyway through Docker's own /etc/hosts,
so no path of the service or its callers shows in /proc/self/mountinfo.

Volumes carry the service label and the owning process's pid, like execution containers: they live
as long as the service process, at most `max_sets` of them (the least recently used idle set goes
first; a set is in use from the moment a request gets it until its execution ends, and eviction
checks that under the set's lock), are removed at shutdown, and a service that died without
cleaning up has its volumes removed by the next start. npm's own download cache (under the
service's cache folder) survives restarts, so a set installs again quickly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from metaagent.audit import AuditLog
from metaagent.errors import AtCapacity, MetaAgentError, PackageRefused, Unavailable
from metaagent.packages.install import NpmInstaller, ResolvedPackage, archive
from metaagent.packages.policy import PackagePolicy, shown
from metaagent.sandbox.engine import OWNER_PID_LABEL, SERVICE_LABEL, Engine, EngineUnavailable, Mount
from metaagent.settings import Settings

log = logging.getLogger("metaagent.packages")

NODE_MODULES = "/app/node_modules"
PACKAGES_LABEL = "org.metaagent.npm-packages"
# npm processes at once: each takes a CPU while it unpacks, and the machine also runs the sandboxes.
_CONCURRENT_INSTALLS = 2
# Seconds a caller refused for too many waiting installs is told to wait: an install takes seconds.
_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class PreparedPackages:
    """An installed set ready to mount, and what the audit record says about it."""

    requested: tuple[str, ...]
    resolved: tuple[ResolvedPackage, ...]
    cache_hit: bool
    volume: str

    def mount(self) -> Mount:
        return Mount(target=NODE_MODULES, source=self.volume, kind="volume", read_only=True)

    def audit_record(self) -> dict[str, Any]:
        return {
            "requested": list(self.requested),
            "resolved": [p.record() for p in self.resolved],
            "cache_hit": self.cache_hit,
        }


NO_PACKAGES: dict[str, Any] = {"requested": [], "resolved": [], "cache_hit": None}


@dataclass
class _CachedSet:
    volume: str
    resolved: tuple[ResolvedPackage, ...]
    in_use: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _KeyLock:
    """A set's lock and how many requests hold or wait for it (the entry goes when that is none)."""

    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


class PackageStore:
    def __init__(
        self,
        policy: PackagePolicy,
        installer: NpmInstaller,
        engine: Engine,
        audit: AuditLog,
        *,
        max_sets: int = 32,
        max_waiting_installs: int = 32,
    ) -> None:
        self.policy = policy
        self.installer = installer
        self.engine = engine
        self.audit = audit
        self.max_sets = max_sets
        self.max_waiting_installs = max_waiting_installs
        self.stopped = False
        self._sets: dict[str, _CachedSet] = {}
        self._locks: dict[str, _KeyLock] = {}
        self._installs = anyio.CapacityLimiter(_CONCURRENT_INSTALLS)
        self._pending = 0  # requests that do not have their set yet (waiting, or running npm)
        self._evicting = anyio.Lock()

    def check(self, requested: list[str]) -> dict[str, str]:
        """The dependencies to install ({name: npm spec}), or PackageRefused before anything runs."""
        try:
            return self.policy.check(requested)
        except PackageRefused as exc:
            spec, rule = str(exc.extra.get("package", "")), str(exc.extra.get("rule", ""))
            log.warning("[SECURITY] Blocked npm package: %s (%s)", shown(spec), rule)
            self.audit.append("package.refused", package=spec, rule=rule, requested=requested)
            raise

    def key(self, dependencies: dict[str, str]) -> str:
        text = json.dumps({"registry": self.installer.registry, "dependencies": dependencies}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def stop_installing(self) -> None:
        """No npm starts from now on (at a shutdown signal); cached sets are still served."""
        self.stopped = True

    @property
    def pending(self) -> int:
        return self._pending

    @asynccontextmanager
    async def provide(
        self, requested: list[str], dependencies: dict[str, str], image: str, caller: str | None = None
    ) -> AsyncIterator[PreparedPackages]:
        """The installed set for the block's duration (its volume is not evicted meanwhile).

        Raises AtCapacity when `max_waiting_installs` requests already wait for the npm slots: each holds
        its request body, so their number is bounded like the execution queue's."""
        key = self.key(dependencies)
        if key not in self._sets and self._pending >= _CONCURRENT_INSTALLS + self.max_waiting_installs:
            raise AtCapacity(
                "At capacity: the service's package installs are running and as many wait as may; retry shortly",
                retry_after_s=_RETRY_AFTER_S,
            )
        self._pending += 1
        try:
            async with self._locked(key):
                cached = self._sets.get(key)
                cache_hit = cached is not None
                if cached is None:
                    cached = await self._install_audited(requested, dependencies, image, caller)
                    self._sets[key] = cached
                cached.in_use += 1
                cached.last_used = time.monotonic()
        finally:
            self._pending -= 1
        try:
            if not cache_hit:
                await self._evict()
            yield PreparedPackages(tuple(requested), cached.resolved, cache_hit, cached.volume)
        finally:
            cached.in_use -= 1
            cached.last_used = time.monotonic()

    @asynccontextmanager
    async def _locked(self, key: str) -> AsyncIterator[None]:
        """The set's lock, held for the block; its entry is dropped when no one holds or waits for it."""
        entry = self._locks.setdefault(key, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[key]

    async def _install_audited(
        self, requested: list[str], dependencies: dict[str, str], image: str, caller: str | None
    ) -> _CachedSet:
        try:
            return await self._install(dependencies, image)
        except BaseException as exc:
            if isinstance(exc, MetaAgentError):
                error = exc.message
            elif isinstance(exc, anyio.get_cancelled_exc_class()):
                error = "cancelled (the caller hung up or the service stopped)"
            else:
                error = f"internal error ({type(exc).__name__})"
            self.audit.append(
                "package.install_failed",
                caller=caller,
                requested=requested,
                dependencies=dependencies,
                registry=self.installer.registry,
                error=error,
            )
            raise

    async def _install(self, dependencies: dict[str, str], image: str) -> _CachedSet:
        async with self._installs:
            if self.stopped:  # the service began to stop while this request waited for npm
                raise Unavailable("The service is shutting down; retry on another instance")
            with tempfile.TemporaryDirectory(prefix="metaagent-npm-") as folder:
                workdir = Path(folder)
                installation = await self.installer.install(dependencies, workdir / "project")
                tar = await anyio.to_thread.run_sync(archive, installation.node_modules, workdir / "tree.tar")
                volume = f"metaagent-npm-{secrets.token_hex(8)}"
                labels = {
                    SERVICE_LABEL: "metaagent",
                    OWNER_PID_LABEL: str(os.getpid()),
                    PACKAGES_LABEL: " ".join(f"{n}@{s}" for n, s in sorted(dependencies.items()))[:1000],
                }
                # Shielded: a caller hanging up must not abandon the engine's calls half way (a volume
                # nobody tracks, or one a helper container still holds). The cancel lands after, when
                # the set is cached and the store owns the volume.
                with anyio.CancelScope(shield=True):
                    await self.engine.create_volume(volume, labels)
                    try:
                        await self.engine.fill_volume(volume, image, tar, labels)
                    except BaseException:
                        await self._discard(volume)
                        raise
        log.info(
            "installed %s into volume %s (%d packages, %.1f MB)",
            ", ".join(sorted(dependencies)),
            volume,
            len(installation.resolved),
            installation.size_bytes / 2**20,
        )
        return _CachedSet(volume, installation.resolved)

    async def _discard(self, volume: str) -> None:
        """Removes a volume whose fill failed, and first the fill's helper container if it is left."""
        try:
            await self.engine.remove(f"{volume}-fill")
            if not await self.engine.remove_volume(volume):
                log.warning("volume %s is still in use; the next start removes it", volume)
        except EngineUnavailable as exc:
            log.warning("volume %s was not removed (the next start removes it): %s", volume, exc.message)

    async def _evict(self) -> None:
        """Removes the least recently used idle sets beyond `max_sets`, one eviction at a time."""
        async with self._evicting:
            tried: set[str] = set()
            while len(self._sets) > self.max_sets:
                idle = [(s.last_used, k) for k, s in self._sets.items() if s.in_use == 0 and k not in tried]
                if not idle:
                    return
                _, key = min(idle)
                tried.add(key)
                async with self._locked(key):
                    cached = self._sets.get(key)
                    if cached is None or cached.in_use:  # a request got it while this one waited
                        continue
                    # Shielded: a removal abandoned half way would leave the set cached without its volume.
                    with anyio.CancelScope(shield=True):
                        try:
                            removed = await self.engine.remove_volume(cached.volume)
                        except EngineUnavailable as exc:
                            log.warning("package volume %s was not evicted: %s", cached.volume, exc.message)
                            return
                    if removed:
                        del self._sets[key]

    async def close(self) -> None:
        """Removes every volume of this service (at shutdown, after the executions have ended)."""
        self.stop_installing()
        for key, cached in list(self._sets.items()):
            if await self.engine.remove_volume(cached.volume):
                del self._sets[key]


def package_store(settings: Settings, policy: PackagePolicy, engine: Engine, audit: AuditLog) -> PackageStore:
    """The store the settings describe (the policy is parsed before, when the app is created)."""
    installer = NpmInstaller(
        settings.npm_registry,
        settings.sandbox_cache_dir,
        timeout_s=settings.npm_install_timeout_s,
        max_bytes=settings.npm_max_install_mb * 2**20,
    )
    return PackageStore(
        policy,
        installer,
        engine,
        audit,
        max_sets=settings.npm_cache_max_sets,
        max_waiting_installs=settings.execution_queue_size,
    )
