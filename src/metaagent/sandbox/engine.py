"""The container engine driver: the only module that talks to Docker.

docker-py's calls block, so each runs in a worker thread; the attach stream is the exception: its socket
is taken over and read with asyncio, so a running execution costs no thread while it prints.
Every engine failure surfaces as `EngineUnavailable` (a 503 for callers) with the engine's own words.

Each call goes by a lane (`Lane`): its own threads, its own docker client (connection pool and socket
timeout) and its own deadline. Kills and removals have a lane of their own, so they never queue behind
creates, starts or inspects that a slow engine holds; a call past its lane's deadline is abandoned and
raises `EngineTimeout` (an `EngineUnavailable`) that names the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

import anyio
import anyio.to_thread
import docker
import docker.errors
import requests.exceptions
from docker.types import LogConfig, Ulimit
from docker.types import Mount as DockerMount

from metaagent import metrics
from metaagent.errors import Unavailable
from metaagent.sandbox import leftovers
from metaagent.sandbox.cgroups import CpuControl
from metaagent.sandbox.oom import OomWatch

log = logging.getLogger("metaagent.engine")

SERVICE_LABEL = "org.metaagent.service"
EXECUTION_LABEL = "org.metaagent.execution"
OWNER_PID_LABEL = "org.metaagent.owner-pid"
# Which Engine created a container or volume: one per service instance (one process may run several, as
# tests do), so that a shutdown removes exactly what its own service made.
OWNER_LABEL = "org.metaagent.owner"
SANDBOX_UID = "1001:1001"
_SANDBOX_UID_NUMBER = 1001
SANDBOX_HOSTNAME = "sandbox"
_CPU_PERIOD_US = 100_000
# cgroup cpu.shares: Docker's default weight for running executions, and an eighth of it for a container
# whose runner is still loading, so that starts (pool refills above all) yield the CPU to running
# executions when both want it, and still get every cycle nobody else wants.
RUNNING_CPU_SHARES = 1024
STARTING_CPU_SHARES = 128

P = ParamSpec("P")
T = TypeVar("T")


class EngineUnavailable(Unavailable):
    pass


class EngineTimeout(EngineUnavailable):
    """An engine call that did not answer within its lane's deadline (it was abandoned)."""


@dataclass(frozen=True)
class Lane:
    """A kind of engine call: `threads` of its own (a limiter), a docker client whose socket timeout is
    `socket_timeout_s`, and a `deadline_s` for each call (None: the call's own owner bounds it)."""

    name: str
    threads: int
    deadline_s: float | None
    socket_timeout_s: float | None


# Creates, starts, attaches, inspects, updates, lists: what a busy engine may take seconds to answer.
CALLS = Lane("calls", threads=40, deadline_s=60.0, socket_timeout_s=60.0)
# Kills and removals: what ends a container must find a thread however many other calls are blocked.
CONTROL = Lane("control", threads=32, deadline_s=15.0, socket_timeout_s=20.0)
# Waits for an exit: one per running container for its whole life (it returns when its container is
# removed, which every owner does in a `finally`), so no deadline and as many threads as containers.
WAITS = Lane("waits", threads=1024, deadline_s=None, socket_timeout_s=None)
# Archive uploads into a volume (a package set): large bodies.
BULK = Lane("bulk", threads=4, deadline_s=300.0, socket_timeout_s=120.0)
LANES = (CALLS, CONTROL, WAITS, BULK)


# Where every container has this service's wire volume (read-only): a session's wire socket is there.
WIRE_DIR = "/run/metaagent-wire"
# The wire volume's name: the prefix, then the engine's owner (the service's pid, a dash, 12 hex digits).
WIRE_VOLUME_PREFIX = "metaagent-wire-"
_WIRE_VOLUME_NAME = re.compile(rf"{WIRE_VOLUME_PREFIX}(\d+)-[0-9a-f]{{12}}")
# The longest path a Unix socket may have (sun_path holds 108 bytes, the last one the terminating NUL): the
# sockets the service makes in the engine's volume folders (egress tunnels, session wires) are checked against it.
MAX_UNIX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Mount:
    """A file tree or socket given to the sandbox. Prefer a named volume: its host path lies under the
    engine's data root, which the container already sees, so it reveals no path of the service's."""

    target: str
    source: str
    kind: Literal["volume", "bind"] = "volume"
    read_only: bool = True


@dataclass(frozen=True)
class ContainerSpec:
    """Everything that differs between two executions' containers."""

    name: str
    image: str
    command: list[str]
    memory_mb: int
    cpus: float
    labels: dict[str, str]
    # CPUs and CPU weight (cgroup cpu.shares) while the trusted runner loads, before any user code exists;
    # `limit_cpus` then sets `cpus` and a running execution's weight, RUNNING_CPU_SHARES.
    start_cpus: float | None = None
    start_cpu_shares: int | None = None
    runtime: str = "runc"  # the engine's name of the isolation runtime (see metaagent.sandbox.runtime)
    pids_limit: int = 32
    nproc: int | None = None  # RLIMIT_NPROC inside the container: the process limit under runsc
    nofile: int = 256
    tmp_size_mb: int = 100
    tmp_inodes: int = 16384
    # A session's workspace (its cwd; the runner's file calls and the program's fs work inside it). Every
    # container has it, so that a warm container can serve a session or a one-shot run alike; a one-shot
    # program cannot reach it (fs is refused there).
    workspace_mb: int = 100
    mounts: tuple[Mount, ...] = ()

    def security_context(self) -> dict[str, Any]:
        """What `create` enforces for this spec, as the audit log records it."""
        return {
            "runtime": self.runtime,
            "user": SANDBOX_UID,
            "capabilities": [],
            "no_new_privileges": True,
            "read_only_root": True,
            "network_mode": "none",
            "ipc_mode": "none",
            "pids_limit": self.pids_limit,
            **({"nproc": self.nproc} if self.nproc is not None else {}),
            "nofile": self.nofile,
            "tmpfs": f"/tmp {self.tmp_size_mb}m noexec",
            "workspace": f"/workspace {self.workspace_mb}m noexec nosuid",
            "mounts": [f"{m.target} ({m.kind}, {'ro' if m.read_only else 'rw'})" for m in self.mounts],
        }


@dataclass(frozen=True)
class ContainerState:
    exit_code: int | None
    oom_killed: bool


def _engine_errors(func: Callable[P, T]) -> Callable[P, T]:
    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return func(*args, **kwargs)
        except docker.errors.NotFound:
            raise
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            metrics.engine_error()
            raise EngineUnavailable(
                f"The container engine is unavailable ({_short(exc)}); start it with scripts/ensure-docker"
            ) from exc

    return wrapper


def _short(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."


class Engine:
    """Blocking docker-py calls behind async methods. Construct in the lifespan, never at import time.

    `lanes` replaces lanes by name (tests give a lane a short deadline)."""

    def __init__(self, base_url: str | None = None, *, lanes: tuple[Lane, ...] = ()) -> None:
        self._base_url = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        chosen = {lane.name: lane for lane in (*LANES, *lanes)}
        self.call_lane, self.control_lane, self.wait_lane, self.bulk_lane = (chosen[lane.name] for lane in LANES)
        self._clients: dict[str, docker.DockerClient] = {}
        self._clients_lock = threading.Lock()
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        self.owner = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.wire_volume = f"{WIRE_VOLUME_PREFIX}{self.owner}"
        self._wire_folder: Path | None = None
        self._closed = False
        # The kernel's record of OOM kills beside the engine's report, which under runsc misses some.
        self.oom_watch = OomWatch.of_this_host()
        # A running container's CPU limits set in its cgroup: faster than the engine's update, and the only
        # way under runsc, which has none.
        self.cpu_control = CpuControl.of_this_host()

    @_engine_errors
    def _docker(self, lane: Lane | None = None) -> docker.DockerClient:
        lane = lane or self.call_lane
        client = self._clients.get(lane.name)
        if client is None:
            with self._clients_lock:  # the calls of a lane's threads may be the first to ask for it
                client = self._clients.get(lane.name)
                if client is None:
                    # Version 1.41 (Docker 20.10) is what Debian ships and every later engine still speaks.
                    client = docker.DockerClient(
                        base_url=self._base_url,
                        version="1.41",
                        timeout=lane.socket_timeout_s,  # type: ignore[arg-type]  # None (no timeout) works; the stubs say int
                        max_pool_size=min(lane.threads, 64),
                    )
                    self._clients[lane.name] = client
        return client

    @property
    def api(self) -> docker.APIClient:
        return self._docker().api

    def _api(self, lane: Lane) -> docker.APIClient:
        return self._docker(lane).api

    async def _run(self, func: Callable[..., T], *args: Any, lane: Lane | None = None, **kwargs: Any) -> T:
        """`func` in a thread of `lane` (default: CALLS), abandoned at the lane's deadline (EngineTimeout)."""
        lane = lane or self.call_lane
        call = functools.partial(_engine_errors(func), *args, **kwargs)
        limiter = self._limiters.get(lane.name)
        if limiter is None:
            limiter = self._limiters[lane.name] = anyio.CapacityLimiter(lane.threads)
        if lane.deadline_s is None:
            return await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=limiter)
        with anyio.move_on_after(lane.deadline_s):
            return await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=limiter)
        metrics.engine_error()
        what = getattr(func, "__name__", "call").strip("_<>") or "call"
        log.warning("the container engine did not answer %s within %g s (lane %s)", what, lane.deadline_s, lane.name)
        raise EngineTimeout(
            f"The container engine did not answer ({what}) within {lane.deadline_s:g} s; it is overloaded or "
            "hung (check `docker info`); retry later"
        )

    @property
    def client(self) -> docker.DockerClient:
        return self._docker()

    async def ping(self) -> None:
        await self._run(self.api.ping)

    async def runtimes(self) -> dict[str, list[str]]:
        """The isolation runtimes the engine has registered (runc, and runsc once registered), each with
        the arguments the engine passes it."""
        info = await self._run(self.api.info)
        return {
            name: [str(arg) for arg in (entry or {}).get("runtimeArgs") or []]
            for name, entry in (info.get("Runtimes") or {}).items()
        }

    async def image_id(self, tag: str) -> str | None:
        def find() -> str | None:
            try:
                return str(self.api.inspect_image(tag)["Id"])  # type: ignore[no-untyped-call]  # untyped in stubs
            except docker.errors.ImageNotFound:
                return None

        return await self._run(find)

    async def wire_folder(self) -> Path:
        """This service's wire volume's folder (created at the first call): where a session's supervisor
        finds the Unix socket of its wire (metaagent.sandbox.wire_socket). Every container has the volume,
        read-only at WIRE_DIR, so that a warm container can serve a session or a one-shot run alike."""
        if self._wire_folder is None:
            labels = {SERVICE_LABEL: "metaagent", OWNER_PID_LABEL: str(os.getpid())}
            with anyio.CancelScope(shield=True):  # abandoned halfway, it would be made twice: harmless, but kept
                folder = Path(await self.create_volume(self.wire_volume, labels))
            try:  # traversable by the sandbox's user, not listable: a socket is reached only by its secret name
                await anyio.to_thread.run_sync(os.chmod, folder, 0o711)
            except OSError as exc:
                raise EngineUnavailable(
                    f"The engine's volume folder {folder} is not reachable from the service ({exc.strerror}): "
                    "run the service on the engine's machine"
                ) from None
            self._wire_folder = folder
        return self._wire_folder

    async def create(self, spec: ContainerSpec) -> str:
        self._refuse_when_closed()
        await self.wire_folder()
        # no_copy: the engine would otherwise copy an image's own folder there (its mode too, 0755 say) into
        # the volume while it is empty, and the folder could then be listed.
        wire = DockerMount(target=WIRE_DIR, source=self.wire_volume, type="volume", read_only=True, no_copy=True)

        def create() -> str:
            ulimits = [Ulimit(name="nofile", soft=spec.nofile, hard=spec.nofile)]
            if spec.nproc is not None:
                ulimits.append(Ulimit(name="nproc", soft=spec.nproc, hard=spec.nproc))
            host_config = self.api.create_host_config(
                runtime=spec.runtime,
                network_mode="none",
                read_only=True,
                # noexec: nothing written at run time can be executed; nr_inodes: an inode flood is an
                # ENOSPC, not an OOM kill; tmpfs pages count against the memory limit.
                tmpfs={
                    "/tmp": f"rw,nosuid,nodev,noexec,size={spec.tmp_size_mb}m,nr_inodes={spec.tmp_inodes},mode=1777",
                    "/workspace": f"rw,nosuid,nodev,noexec,size={spec.workspace_mb}m,nr_inodes={spec.tmp_inodes},"
                    f"uid={SANDBOX_UID.split(':')[0]},gid={SANDBOX_UID.split(':')[1]},mode=0700",
                },
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                mem_limit=f"{spec.memory_mb}m",
                memswap_limit=f"{spec.memory_mb}m",  # equal to the memory limit: no swap
                cpu_period=_CPU_PERIOD_US,
                cpu_quota=int((spec.start_cpus or spec.cpus) * _CPU_PERIOD_US),
                cpu_shares=spec.start_cpu_shares or RUNNING_CPU_SHARES,
                pids_limit=spec.pids_limit,
                ulimits=ulimits,
                ipc_mode="none",  # no /dev/shm: --read-only does not cover it
                log_config=LogConfig(type=LogConfig.types.NONE),  # output is read from the stream, never stored
                mounts=[
                    wire,
                    *(
                        DockerMount(target=m.target, source=m.source, type=m.kind, read_only=m.read_only)
                        for m in spec.mounts
                    ),
                ],
            )
            try:
                container = self._create_container(spec, host_config)
            except docker.errors.ImageNotFound:
                raise EngineUnavailable(
                    f"The sandbox image {spec.image} is missing; build it with `metaagent sandbox build`"
                ) from None
            if self._closed:
                self._undo_create_after_close(str(container["Id"]))
            return str(container["Id"])

        return await self._run(create)

    def _refuse_when_closed(self) -> None:
        if self._closed:
            raise EngineUnavailable("The service is shutting down: it starts no more containers")

    def _undo_create_after_close(self, container_id: str) -> None:
        """A create that `close` overtook: the engine made the wire volume again for its mount (a volume a
        mount names is created when missing, with no labels, so no orphan sweep would know it). The
        container and that volume go, here and now, and the create fails as any after `close` does."""
        with contextlib.suppress(docker.errors.APIError, requests.exceptions.RequestException):
            self.api.remove_container(container_id, force=True)
        with contextlib.suppress(docker.errors.APIError, requests.exceptions.RequestException):
            self.api.remove_volume(self.wire_volume)  # 409 while another such create holds it: its undo removes it
        self._refuse_when_closed()

    def _create_container(self, spec: ContainerSpec, host_config: dict[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = self.api.create_container(
            image=spec.image,
            command=spec.command,
            name=spec.name,
            user=SANDBOX_UID,
            working_dir="/tmp",
            hostname=SANDBOX_HOSTNAME,
            environment={},
            labels=self._owned(spec.labels),
            stdin_open=True,  # with detach left false, docker-py also sets StdinOnce: EOF reaches node
            tty=False,
            network_disabled=True,
            host_config=host_config,
        )
        return created

    async def attach(self, container_id: str) -> socket.socket:
        """The container's stdin/stdout/stderr as one non-blocking socket (attach before start)."""

        def attach() -> socket.socket:
            stream = self.api.attach_socket(
                container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1, "logs": 0}
            )
            raw = getattr(stream, "_sock", stream)
            if not isinstance(raw, socket.socket):
                raise EngineUnavailable("The engine's attach stream is not a socket; use a local unix socket engine")
            # Our own descriptor for the connection, so docker-py's wrappers can be closed at once and
            # nothing else ever reads from or closes the stream under us.
            sock = socket.socket(fileno=os.dup(raw.fileno()))
            response = getattr(stream, "_response", None)
            if response is not None:
                response.close()
            stream.close()
            raw.close()
            sock.setblocking(False)
            return sock

        return await self._run(attach)

    async def start(self, container_id: str) -> None:
        def start() -> None:
            self.api.start(container_id)
            # Its cgroup exists from now on, and no code has run yet. A watch that fails leaves the
            # engine's report alone; it never fails the start.
            with contextlib.suppress(OSError):
                self.oom_watch.watch(container_id)

        await self._run(start)

    async def wait(self, container_id: str) -> int:
        """Blocks (in a thread of the WAITS lane) until the container exits; returns its exit status."""
        result = await self._run(self._api(self.wait_lane).wait, container_id, timeout=None, lane=self.wait_lane)
        return int(result.get("StatusCode", -1))

    async def state(self, container_id: str) -> ContainerState:
        info = await self._run(self.api.inspect_container, container_id)
        state = info["State"]
        running = state.get("Running", False)
        reported = bool(state.get("OOMKilled"))
        oom_killed = reported or self.oom_watch.saw_oom(container_id)
        if oom_killed and not reported:
            metrics.oom_unreported()
            log.info("container %s: its memory cgroup saw an OOM kill the engine did not report", container_id[:12])
        return ContainerState(None if running else int(state.get("ExitCode", -1)), oom_killed)

    async def limit_cpus(self, container_id: str, cpus: float) -> None:
        """Holds a container to `cpus` with a running execution's CPU weight: in its cgroup where the
        service can (`CpuControl`), otherwise with the engine's update (which runsc does not have)."""
        if self.cpu_control.limit(container_id, cpus, RUNNING_CPU_SHARES):
            return
        await self._run(
            self.api.update_container,
            container_id,
            cpu_period=_CPU_PERIOD_US,
            cpu_quota=int(cpus * _CPU_PERIOD_US),
            cpu_shares=RUNNING_CPU_SHARES,
        )

    def saw_oom(self, container_id: str) -> bool:
        """Whether the container's memory cgroup saw an OOM kill (the watch's record, while it is kept)."""
        return self.oom_watch.saw_oom(container_id)

    async def kill(self, container_id: str, signal: str) -> None:
        def kill() -> None:
            try:
                self._api(self.control_lane).kill(container_id, signal=signal)
            except docker.errors.APIError as exc:
                # 404: already removed; 409: not running any more. Either way the kill is done.
                if exc.status_code not in (404, 409):
                    raise

        await self._run(kill, lane=self.control_lane)

    async def remove(self, container_id: str) -> None:
        def remove() -> None:
            try:
                self._api(self.control_lane).remove_container(container_id, force=True, v=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: removal already in progress
                    raise
            self.oom_watch.forget(container_id)

        await self._run(remove, lane=self.control_lane)

    async def remove_failed(self, container_id: str) -> None:
        """Removes a container whose start failed, and whatever its runtime left of it on the host
        (runsc's processes and state, which the engine may forget while they run on)."""
        await self.remove(container_id)
        await self.remove_runtime_leftovers([container_id])

    async def remove_runtime_leftovers(self, ids: list[str] | None = None) -> int:
        """Removes runsc containers the engine no longer knows: those of `ids`, or (None) every one
        that is a sandbox of this service. Returns how many; 0 when the engine does not answer."""

        def forgotten(container_id: str) -> bool:
            try:
                self.api.inspect_container(container_id)
            except docker.errors.NotFound:
                return True
            except (docker.errors.DockerException, requests.exceptions.RequestException, OSError):
                return False  # no answer: nothing can be said to be forgotten
            return False

        def sweep() -> int:
            try:
                data_root = str(self.api.info()["DockerRootDir"])
            except (docker.errors.DockerException, requests.exceptions.RequestException, OSError, KeyError):
                return 0  # no answer: nothing can be said to be this engine's
            removed = leftovers.sweep(forgotten, SANDBOX_HOSTNAME, _SANDBOX_UID_NUMBER, data_root, ids=ids)
            for container_id in removed:
                log.warning("removed the runtime's leftovers of container %s (processes or state)", container_id[:12])
            return len(removed)

        return await self._run(sweep)

    async def create_volume(self, name: str, labels: dict[str, str]) -> str:
        """Creates a named local volume; returns its folder on this machine (the engine's Mountpoint)."""
        created = await self._run(self.api.create_volume, name=name, driver="local", labels=self._owned(labels))
        return str(created["Mountpoint"])

    async def list_service_containers(self) -> list[dict[str, Any]]:
        found = await self._run(self.api.containers, all=True, filters={"label": SERVICE_LABEL})
        return list(found)

    async def remove_orphans(self) -> int:
        """Removes containers and volumes of service processes that no longer exist (a crash, a SIGKILL)."""
        removed = await self._remove_service_objects(lambda labels: not _owner_alive(labels))
        return len(removed) + await self._remove_unlabelled_wire_volumes() + await self.remove_runtime_leftovers()

    async def _remove_unlabelled_wire_volumes(self) -> int:
        """Wire volumes with no labels whose owner, named in the volume's name, is gone: what a create that
        a shutdown overtook left before `create` undid its own (the engine makes a missing volume that a
        mount names, without labels), which the label sweep cannot see."""
        found = await self._run(self.api.volumes, filters={"name": WIRE_VOLUME_PREFIX})
        removed = 0
        for volume in found.get("Volumes") or []:
            owner = _WIRE_VOLUME_NAME.fullmatch(volume["Name"])
            if owner and not volume.get("Labels") and not _process_alive(int(owner[1])):
                removed += await self.remove_volume(volume["Name"])
        return removed

    async def remove_owned(self, within_s: float) -> int:
        """Removes every container and volume this process still owns, and waits (up to `within_s`) until
        the engine no longer lists them: the last step of a shutdown, so that a removal that failed or was
        abandoned on the way out (a busy engine past its lane's deadline) leaves nothing behind. Returns how
        many it found; what is left at the deadline, the next start removes as an orphan's."""
        found: set[str] = set()
        with anyio.move_on_after(within_s):
            while removed := await self._remove_service_objects(self._made_here):
                found |= removed
                await anyio.sleep(0.2)  # a removal in progress (409) answers at once; its end is waited for
        return len(found)

    async def _remove_service_objects(self, doomed: Callable[[dict[str, str] | None], bool]) -> set[str]:
        """Removes this service's containers, then volumes, whose labels are `doomed`; returns their ids
        and names (a container whose removal is already in progress among them)."""
        removed: set[str] = set()
        for container in await self.list_service_containers():
            if doomed(container.get("Labels")):
                await self.remove(container["Id"])
                removed.add(container["Id"])
        # Volumes last: one still used by a container cannot be removed.
        found = await self._run(self.api.volumes, filters={"label": SERVICE_LABEL})
        for volume in found.get("Volumes") or []:
            if doomed(volume.get("Labels")) and await self.remove_volume(volume["Name"]):
                removed.add(volume["Name"])
        return removed

    async def fill_volume(self, volume: str, image: str, archive: Path, labels: dict[str, str]) -> None:
        """Extracts a tar into a volume, through a helper container that is created but never started
        (nothing runs; the engine writes the files itself). The volume ends up holding exactly the tar's
        entries, with their owners and modes."""

        def fill() -> None:
            api = self._api(self.bulk_lane)
            host_config = api.create_host_config(
                network_mode="none", mounts=[DockerMount(target="/fill", source=volume, type="volume")]
            )
            helper = api.create_container(
                image=image,
                command=["/usr/bin/node"],
                name=f"{volume}-fill",
                labels=self._owned(labels),
                network_disabled=True,
                host_config=host_config,
            )
            try:
                with archive.open("rb") as data:
                    if not api.put_archive(helper["Id"], "/fill", data):
                        raise EngineUnavailable(f"The engine refused to fill the volume {volume}")
            finally:
                try:
                    api.remove_container(helper["Id"], force=True)
                except docker.errors.NotFound:
                    pass
                except docker.errors.APIError as exc:
                    if exc.status_code != 409:  # 409: another hand's removal is already in progress
                        raise

        await self._run(fill, lane=self.bulk_lane)

    async def remove_volume(self, name: str) -> bool:
        """Removes a volume; False (and kept) while a container still uses it."""

        def remove() -> bool:
            try:
                self.api.remove_volume(name)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                if exc.status_code == 409:  # in use
                    return False
                raise
            return True

        return await self._run(remove)

    def _owned(self, labels: dict[str, str]) -> dict[str, str]:
        return {**labels, OWNER_LABEL: self.owner}

    def _made_here(self, labels: dict[str, str] | None) -> bool:
        return (labels or {}).get(OWNER_LABEL) == self.owner

    def close(self) -> None:
        self._closed = True  # first: a create that runs on sees it, after its engine call (see create)
        self.oom_watch.close()
        if self._wire_folder is not None:  # kept while a container still has it: the next start's orphan
            with contextlib.suppress(EngineUnavailable, docker.errors.APIError, requests.exceptions.RequestException):
                self.api.remove_volume(self.wire_volume)
            self._wire_folder = None
        clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()


def _owner_alive(labels: dict[str, str] | None) -> bool:
    owner = (labels or {}).get(OWNER_PID_LABEL, "")
    return owner.isdigit() and _process_alive(int(owner))


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def sock_recv(sock: socket.socket, size: int) -> bytes:
    return await asyncio.get_running_loop().sock_recv(sock, size)


async def sock_sendall(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)
