"""What gVisor's runsc leaves on the host when the engine has forgotten a container: found in the runtime's
own state and in /proc, not in `docker ps`, and removed.

Under runsc each container is host processes of its own beside the engine's shim, and a state file:

    containerd-shim-runc-v2 -namespace moby -id <id> ...          (its working directory: the bundle)
    runsc-gofer --root=<state root> ... gofer --bundle <bundle> ...
    runsc-sandbox --root=<state root> ... boot ... --bundle=<bundle> ... <id>
    <state root>/<id>_sandbox:<id>.state                           (`runsc --root <state root> list`)

Failed runsc starts have left these running after `docker run --rm` returned and the engine had forgotten
the container (found an hour later, issue 17). So a failed start is followed by a look for its id here,
and the sweeps at start and at shutdown look for every runsc container that the engine does not know
and whose OCI spec is a sandbox's of this engine (the hostname and user every sandbox container gets,
and a root file system in the engine's data root): such a container can belong to no running container,
and it is one of ours. Another service's live containers are known to the engine and never touched, and
so are those of another engine on the same host (another data root), which this engine never knew.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("metaagent.leftovers")

_CONTAINER_ID = re.compile(r"^[0-9a-f]{64}$")
_RUNSC_NAMES = frozenset({"runsc", "runsc-gofer", "runsc-sandbox"})
_SHIM_PREFIX = "containerd-shim"
# Where Docker keeps runsc's state when runsc is registered in daemon.json: runtime-runc/moby on Docker
# 20.10 (the runc shim drives every runtime), runtime-<name>/moby elsewhere. Roots seen in the
# processes' own --root arguments are added to these.
_STATE_ROOTS = ("/run/docker/runtime-runc/moby", "/run/docker/runtime-runsc/moby")
_RUNSC_TIMEOUT_S = 20.0


@dataclass
class Leftover:
    """One runsc container's traces on the host: its processes, state root and bundle."""

    container_id: str
    pids: set[int] = field(default_factory=set)
    roots: set[str] = field(default_factory=set)
    bundles: set[str] = field(default_factory=set)
    spec: dict[str, Any] | None = None


def _arguments(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def _option(args: list[str], name: str) -> str | None:
    """The value of `--name=value`, `-name=value`, `--name value` or `-name value` in `args`."""
    for index, arg in enumerate(args):
        for dash in ("--", "-"):
            flag = dash + name
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
            if arg == flag and index + 1 < len(args):
                return args[index + 1]
    return None


def _process_container(pid: int, args: list[str]) -> tuple[str, str | None, str | None] | None:
    """(container id, state root, bundle) of a runsc or shim process; None for any other process."""
    name = os.path.basename(args[0]) if args else ""
    if name.startswith(_SHIM_PREFIX):
        container_id = _option(args, "id")
        if container_id is None or not _CONTAINER_ID.match(container_id):
            return None
        with contextlib.suppress(OSError):
            return container_id, None, os.readlink(f"/proc/{pid}/cwd")
        return container_id, None, None
    if name not in _RUNSC_NAMES:
        return None
    bundle = _option(args, "bundle")
    candidates = [os.path.basename(bundle.rstrip("/"))] if bundle else []
    candidates += [arg for arg in reversed(args) if _CONTAINER_ID.match(arg)]
    container_id = next((c for c in candidates if _CONTAINER_ID.match(c)), None)
    if container_id is None:
        return None
    return container_id, _option(args, "root"), bundle


def _state_files(root: str) -> dict[str, Path]:
    """Container id -> its state file under one runsc state root."""
    found: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for entry in Path(root).iterdir():
            if entry.suffix == ".state" and "_sandbox:" in entry.name:
                container_id = entry.name.rsplit(":", 1)[-1].removesuffix(".state")
                if _CONTAINER_ID.match(container_id):
                    found[container_id] = entry
    return found


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def scan(extra_roots: Iterable[str] = ()) -> dict[str, Leftover]:
    """Every runsc container on this host, from /proc and the state roots, by container id (blocking)."""
    found: dict[str, Leftover] = {}
    roots = {os.path.realpath(root) for root in (*_STATE_ROOTS, *extra_roots)}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        described = _process_container(pid, _arguments(pid))
        if described is None or _zombie(pid):
            continue
        container_id, root, bundle = described
        leftover = found.setdefault(container_id, Leftover(container_id))
        leftover.pids.add(pid)
        if root:
            root = os.path.realpath(root)
            leftover.roots.add(root)
            roots.add(root)
        if bundle:
            leftover.bundles.add(bundle)
    for root in roots:
        for container_id, state_file in _state_files(root).items():
            leftover = found.setdefault(container_id, Leftover(container_id))
            leftover.roots.add(root)
            state = _read_json(state_file)
            if state and isinstance(state.get("spec"), dict):
                leftover.spec = state["spec"]
    for leftover in found.values():
        for bundle in leftover.bundles:
            if leftover.spec is None:
                leftover.spec = _read_json(Path(bundle) / "config.json")
    # A shim alone is runc's as often as runsc's: only containers runsc knows of, or whose processes
    # include runsc's, are this module's business.
    return {
        container_id: leftover
        for container_id, leftover in found.items()
        if leftover.roots or any(_is_runsc(pid) for pid in leftover.pids)
    }


def _is_runsc(pid: int) -> bool:
    args = _arguments(pid)
    return bool(args) and os.path.basename(args[0]) in _RUNSC_NAMES


def is_sandbox_spec(spec: dict[str, Any] | None, hostname: str, uid: int, data_root: str) -> bool:
    """Whether an OCI spec is one of the service's sandbox containers (its hostname and user) of the
    engine whose data root is `data_root`: its root file system lies there. Several engines can run on
    one host, and a container another engine runs is forgotten only by the engine that never knew it."""
    if spec is None:
        return False
    user = (spec.get("process") or {}).get("user") or {}
    root = str((spec.get("root") or {}).get("path") or "")
    return spec.get("hostname") == hostname and user.get("uid") == uid and root.startswith(data_root.rstrip("/") + "/")


def remove(leftover: Leftover) -> None:
    """Ends a runsc container's processes and state: `runsc delete -force` in each of its state roots
    (which ends the sandbox and the gofer and releases their cgroups), then SIGKILL for what remains
    (the shim, or everything when runsc cannot be run). Blocking."""
    runsc = shutil.which("runsc")
    for root in sorted(leftover.roots):
        if runsc is None:
            break
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(  # a fixed binary with arguments of our own, no shell
                [runsc, "--root", root, "delete", "-force", leftover.container_id],
                capture_output=True,
                timeout=_RUNSC_TIMEOUT_S,
                check=False,
            )
        with contextlib.suppress(OSError):  # runsc delete leaves the container's lock file
            (Path(root) / f"{leftover.container_id}_sandbox:{leftover.container_id}.lock").unlink()
    for pid in leftover.pids:
        if (described := _process_container(pid, _arguments(pid))) and described[0] == leftover.container_id:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sweep(
    forgotten: Callable[[str], bool],
    hostname: str,
    uid: int,
    data_root: str,
    *,
    ids: Iterable[str] | None = None,
) -> list[str]:
    """Removes the runsc containers the engine (data root `data_root`) has forgotten (`forgotten(id)`)
    that are its sandboxes, or, with `ids`, those of these ids whatever their spec says. Returns the ids
    removed. Blocking."""
    wanted = set(ids) if ids is not None else None
    removed = []
    for container_id, leftover in scan().items():
        if wanted is not None and container_id not in wanted:
            continue
        if wanted is None and not is_sandbox_spec(leftover.spec, hostname, uid, data_root):
            continue
        if not forgotten(container_id):
            continue
        remove(leftover)
        removed.append(container_id)
    return removed
