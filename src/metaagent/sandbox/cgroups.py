"""A container's cgroups (v1), where the service reads and sets what the engine cannot do well itself.

Two things go to the kernel directly, because the engine's way is slow or missing: a container's OOM
notifications (`metaagent.sandbox.oom`) and a running container's CPU quota and weight (`CpuControl`).

Both need cgroup v1 and a service that may write the engine's cgroups (root on the engine's host, not in
a container of its own), and find a container's cgroup: where Docker puts it by default (`/docker/<id>`
with the cgroupfs driver, `system.slice/docker-<id>.scope` with systemd), or under the engine's own
`--cgroup-parent`, searched for once. Elsewhere (cgroup v2, not root, an engine on another host) each is
off, logs why once, and the service uses the engine alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("metaagent.engine")

MOUNTINFO = Path("/proc/self/mountinfo")
# Containers in a row found without a cgroup before `CpuControl` turns itself off (see `limit`).
MISSES_BEFORE_OFF = 3


def v1_hierarchy(mountinfo: str, controller: str) -> Path | None:
    """Where the cgroup v1 hierarchy of `controller` is mounted, from /proc/self/mountinfo's text."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) >= 3 and after[0] == "cgroup" and controller in after[2].split(","):
            return Path(fields[4])
    return None


def mounted_hierarchy(controller: str) -> Path | None:
    """The hierarchy of `controller` this process sees mounted; None if none (or mountinfo cannot be read)."""
    try:
        return v1_hierarchy(MOUNTINFO.read_text(), controller)
    except OSError:
        return None


def cgroup_candidates(hierarchy: Path, container_id: str) -> tuple[Path, ...]:
    """The cgroups Docker makes for a container by default: cgroupfs's, then systemd's."""
    return hierarchy / "docker" / container_id, hierarchy / "system.slice" / f"docker-{container_id}.scope"


# Where containers' cgroups were found besides the defaults (an engine started with another
# `--cgroup-parent`), per hierarchy: looked in first, so that the search below runs once per parent.
_learned_parents: dict[Path, list[Path]] = {}


def container_cgroup(hierarchy: Path, container_id: str) -> Path | None:
    """The container's cgroup: where Docker puts it by default, else under a parent found before, else
    searched for one and two levels down (another `--cgroup-parent`), and that parent remembered."""
    learned = _learned_parents.setdefault(hierarchy, [])
    for path in (*cgroup_candidates(hierarchy, container_id), *(parent / container_id for parent in learned)):
        if path.is_dir():
            return path
    for pattern in (f"*/{container_id}", f"*/*/{container_id}"):
        found = next((path for path in hierarchy.glob(pattern) if path.is_dir()), None)
        if found is not None:
            learned.append(found.parent)
            return found
    return None


class CpuControl:
    """Sets a running container's CPU quota and weight in its cgroup.

    The engine's `update` costs a round trip through dockerd, containerd, the shim and the runtime (about
    20 ms of CPU and 30 ms of wall time under runc), and runsc has no `update` at all, so under gVisor a
    container used to start at its execution's quota and weight: its runner loaded at 0.5 CPU, and a start
    for the warm pool competed with running executions as their equal. The kernel applies the same
    numbers from two small writes, at once, to every process in the cgroup: under runsc that is gVisor's
    sandbox, its gofer and their stubs, so the limit holds for the whole sandbox, as the engine's would.

    The engine's record of the container (`docker inspect`) keeps the values it was created with; the
    cgroup is what the kernel enforces.
    """

    @classmethod
    def of_this_host(cls) -> CpuControl:
        return cls(mounted_hierarchy("cpu"), mounted_hierarchy("cpuacct"))

    def __init__(self, hierarchy: Path | None, accounting: Path | None = None) -> None:
        self.hierarchy = hierarchy
        self.accounting = accounting  # cpuacct, for `used_s` (read only)
        self.failure: str | None = None
        self._misses = 0  # containers in a row whose cgroup was not found
        if hierarchy is None:
            self._fail("no cgroup v1 cpu hierarchy is mounted")
        elif not os.access(hierarchy, os.W_OK):
            self._fail(f"{hierarchy} is not writable by this process")

    @property
    def available(self) -> bool:
        return self.failure is None

    def limit(self, container_id: str, cpus: float, shares: int) -> bool:
        """Holds the container to `cpus` at weight `shares`; False (nothing changed) when it cannot."""
        if not self.available or self.hierarchy is None:
            return False
        cgroup = container_cgroup(self.hierarchy, container_id)
        if cgroup is None:
            # One container may have ended since it was ready (its cgroup is gone); several in a row without
            # a write that worked mean the engine's cgroups are out of reach (another host).
            self._misses += 1
            if self._misses >= MISSES_BEFORE_OFF:
                self._fail(f"{self._misses} containers in a row had no cgroup that this process can see")
            return False
        self._misses = 0
        try:
            period_us = int((cgroup / "cpu.cfs_period_us").read_text())
            (cgroup / "cpu.cfs_quota_us").write_text(str(int(cpus * period_us)))
            (cgroup / "cpu.shares").write_text(str(shares))
        except (OSError, ValueError) as exc:
            if isinstance(exc, PermissionError):
                self._fail(f"the cpu cgroup cannot be written ({exc})")
            return False
        return True

    def used_s(self, container_id: str) -> float | None:
        """The CPU time every process of the container has used so far (None where it cannot be read)."""
        cgroup = None if self.accounting is None else container_cgroup(self.accounting, container_id)
        if cgroup is None:
            return None
        try:
            return int((cgroup / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.warning("a running container's CPU limits are set by the engine alone: %s", reason)
