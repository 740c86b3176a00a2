"""The kernel's own word on a container's OOM kills, for when the engine's report misses one.

The engine learns of an OOM kill from the runtime shim, whose event races the sandbox's teardown: under
runsc the engine answered `OOMKilled: false` for about one kill in five at the memory limit, and by the
time the container's exit is known its memory cgroup is gone, so nothing is left to ask.

So the service asks the kernel while the container lives. At a container's start, `OomWatch.watch`
registers an eventfd for its memory cgroup's OOM notifications (cgroup v1: `cgroup.event_control` with
`memory.oom_control`), and one thread of the watch's own waits on every such eventfd with epoll. The
kernel signals an eventfd when the cgroup enters OOM (before the OOM killer has picked its victim, so
while the cgroup is still there) and once more when the cgroup is removed, when its files already answer
ENODEV. So a signal after which `memory.oom_control` still reads is an OOM, and so is a count of two or
more: what the thread sees is recorded at once, and `saw_oom` answers from the record at the exit.

What it does not cover: cgroup v2 hosts and a service that cannot write the engine's cgroups (not root,
or in a container of its own) watch nothing, and `oom_killed` is then the engine's report alone (the
start logs which). A cgroup is found where Docker puts it by default (`/docker/<id>` with the cgroupfs
driver, `system.slice/docker-<id>.scope` with systemd); an engine with another `cgroup-parent` is not
watched either.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import threading
from dataclasses import dataclass, field
from pathlib import Path

from metaagent.sandbox.cgroups import container_cgroup, mounted_hierarchy

log = logging.getLogger("metaagent.engine")

# Records of containers whose cgroup is gone and that nobody forgot (removed by another hand): past this
# many watches, those are dropped first.
MAX_WATCHED = 4096


@dataclass
class _Watch:
    eventfd: int
    control: int  # memory.oom_control, open: read after each signal to tell an OOM from the removal
    signals: int = 0
    oom: bool = False
    gone: bool = False
    closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.eventfd)
            os.close(self.control)


class OomWatch:
    """Records the OOM notifications of each watched container's memory cgroup (see the module's text)."""

    @classmethod
    def of_this_host(cls) -> OomWatch:
        """A watch of the memory hierarchy this process sees mounted (none: a watch that is off)."""
        return cls(mounted_hierarchy("memory"))

    def __init__(self, hierarchy: Path | None) -> None:
        self.hierarchy = hierarchy
        self._watches: dict[str, _Watch] = {}
        self._by_fd: dict[int, _Watch] = {}
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None
        self._wake: int | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None
        if hierarchy is None:
            self._fail("no cgroup v1 memory hierarchy is mounted")

    @property
    def available(self) -> bool:
        return self.failure is None

    def watch(self, container_id: str) -> bool:
        """Starts recording the container's OOM notifications; False if it cannot be watched (the engine's
        report then stands alone). Blocking file calls: run it where the engine's calls run."""
        if not self.available or self.hierarchy is None or container_id in self._watches:
            return container_id in self._watches
        cgroup = container_cgroup(self.hierarchy, container_id)
        if cgroup is None:
            return False
        try:
            control = os.open(cgroup / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            eventfd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError:  # out of descriptors: this container goes unwatched
            os.close(control)
            return False
        watch = _Watch(eventfd, control)
        try:
            (cgroup / "cgroup.event_control").write_text(f"{eventfd} {control}")
        except OSError as exc:
            watch.close()
            if exc.errno not in (errno.ENOENT, errno.ENODEV):  # not just a container that has ended already
                self._fail(f"the memory cgroup's OOM notifications cannot be registered ({exc})")
            return False
        with self._lock:
            if self._stopping:
                watch.close()
                return False
            epoll = self._started()
            if len(self._watches) >= MAX_WATCHED:
                self._drop_gone()
            self._watches[container_id] = watch
            self._by_fd[eventfd] = watch
            epoll.register(eventfd, select.EPOLLIN)
        return True

    def saw_oom(self, container_id: str) -> bool:
        """Whether the container's cgroup notified an OOM while it was watched."""
        watch = self._watches.get(container_id)
        if watch is None:
            return False
        with self._lock:
            if not watch.closed:
                self._take(watch)  # a signal the thread has not read yet
            return watch.oom

    def forget(self, container_id: str) -> None:
        with self._lock:
            watch = self._watches.pop(container_id, None)
            if watch is not None:
                self._close(watch)

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            for watch in self._watches.values():
                self._close(watch)
            self._watches.clear()
            if self._wake is not None:
                os.eventfd_write(self._wake, 1)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # --- the thread ---

    def _started(self) -> select.epoll:
        """The thread's epoll, the thread started first if it is not running yet."""
        if self._epoll is not None:
            return self._epoll
        self._epoll = epoll = select.epoll()
        self._wake = wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        epoll.register(wake, select.EPOLLIN)
        self._thread = threading.Thread(target=self._loop, args=(epoll, wake), name="metaagent-oom-watch", daemon=True)
        self._thread.start()
        return epoll

    def _loop(self, epoll: select.epoll, wake: int) -> None:
        while True:
            events = epoll.poll()
            with self._lock:
                if self._stopping:
                    break
                for fd, _ in events:
                    watch = self._by_fd.get(fd)
                    if watch is not None and not watch.closed:
                        self._take(watch)
        epoll.close()
        os.close(wake)

    def _take(self, watch: _Watch) -> None:
        """Reads the signals the eventfd holds and tells what they were (called with the lock held)."""
        try:
            count = os.eventfd_read(watch.eventfd)
        except BlockingIOError:
            return
        watch.signals += count
        if not watch.gone:
            try:
                os.pread(watch.control, 256, 0)
            except OSError:  # ENODEV: the cgroup is gone, and one of the signals may be its removal
                watch.gone = True
            else:
                watch.oom = True
        if watch.signals >= 2:
            watch.oom = True  # the removal signals once; any other signal was an OOM

    def _close(self, watch: _Watch) -> None:
        if watch.closed:
            return
        self._by_fd.pop(watch.eventfd, None)
        if self._epoll is not None:
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(watch.eventfd)
        watch.close()

    def _drop_gone(self) -> None:
        for container_id, watch in list(self._watches.items()):
            if watch.gone:
                del self._watches[container_id]
                self._close(watch)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.warning("OOM kills are known from the engine's report alone: %s", reason)
