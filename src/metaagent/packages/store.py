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
first), are removed at shutdown, and a service that died without cleaning up has its volumes
removed by the next start. npm's own download cache (under the service's cache folder) survives
restarts, so a set installs again quickly.
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
from metaagent.errors import PackageRefused
from metaagent.packages.install import NpmInstaller, ResolvedPackage, archive
from metaagent.packages.policy import PackagePolicy, shown
from metaagent.sandbox.engine import OWNER_PID_LABEL, SERVICE_LABEL, Engine, Mount
from metaagent.settings import Settings

log = logging.getLogger("metaagent.packages")

NODE_MODULES = "/app/node_modules"
PACKAGES_LABEL = "org.metaagent.npm-packages"
# npm processes at once: each takes a CPU while it unpacks, and the machine also runs the sandboxes.
_CONCURRENT_INSTALLS = 2


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


class PackageStore:
    def __init__(
        self,
        policy: PackagePolicy,
        installer: NpmInstaller,
        engine: Engine,
        audit: AuditLog,
        *,
        max_sets: int = 32,
    ) -> None:
        self.policy = policy
        self.installer = installer
        self.engine = engine
        self.audit = audit
        self.max_sets = max_sets
        self._sets: dict[str, _CachedSet] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._installs = anyio.CapacityLimiter(_CONCURRENT_INSTALLS)

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

    @asynccontextmanager
    async def provide(
        self, requested: list[str], dependencies: dict[str, str], image: str
    ) -> AsyncIterator[PreparedPackages]:
        """The installed set for the block's duration (its volume is not evicted meanwhile)."""
        key = self.key(dependencies)
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            cached = self._sets.get(key)
            cache_hit = cached is not None
            if cached is None:
                cached = await self._install(dependencies, image)
                self._sets[key] = cached
            cached.in_use += 1
            cached.last_used = time.monotonic()
        try:
            if not cache_hit:
                await self._evict()
            yield PreparedPackages(tuple(requested), cached.resolved, cache_hit, cached.volume)
        finally:
            cached.in_use -= 1
            cached.last_used = time.monotonic()

    async def _install(self, dependencies: dict[str, str], image: str) -> _CachedSet:
        async with self._installs:
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
                await self.engine.create_volume(volume, labels)
                try:
                    await self.engine.fill_volume(volume, image, tar, labels)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self.engine.remove_volume(volume)
                    raise
        log.info(
            "installed %s into volume %s (%d packages, %.1f MB)",
            ", ".join(sorted(dependencies)),
            volume,
            len(installation.resolved),
            installation.size_bytes / 2**20,
        )
        return _CachedSet(volume, installation.resolved)

    async def _evict(self) -> None:
        """Removes the least recently used idle sets beyond `max_sets`."""
        idle = sorted((s.last_used, k) for k, s in self._sets.items() if s.in_use == 0)
        for _, key in idle[: max(0, len(self._sets) - self.max_sets)]:
            cached = self._sets.pop(key)
            if not await self.engine.remove_volume(cached.volume):
                self._sets[key] = cached  # a container still holds it; try again next time

    async def close(self) -> None:
        """Removes every volume of this service (at shutdown, after the executions have ended)."""
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
    return PackageStore(policy, installer, engine, audit, max_sets=settings.npm_cache_max_sets)
