"""A private Docker engine for fault tests: its own dockerd that a test may stop and start at will.

The shared engine serves every other test (and other xdist workers) at the same time, so it is never
stopped. This one has its own socket, data root, exec root (hence its own managed containerd), pid file
and cgroup parent, no bridge and no iptables rules: nothing it does touches the shared engine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker

START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 60
# Where `load_image` keeps its image exports, so that every private engine of a test run loads one file.
# tests/sandbox/conftest.py points it at the run's own temporary directory, which pytest prunes. None (the
# bench): each load exports the image for itself and removes the file after.
IMAGE_EXPORTS: Path | None = None


def in_netns(namespace: str) -> list[str]:
    """The argv prefix that runs a command in a named network namespace and nothing else: `ip netns exec`
    would also give it a /sys of its own, without the cgroup mounts that dockerd needs."""
    return ["nsenter", f"--net=/run/netns/{namespace}", "--"]


class PrivateEngine:
    """`netns`: the network namespace it runs in (a fleet node's); `config`: its daemon.json (none: `{}`,
    so the host's /etc/docker/daemon.json is ignored)."""

    def __init__(self, root: Path, netns: str | None = None, config: dict[str, object] | None = None) -> None:
        self.root = root  # short: unix socket paths are limited to 107 bytes
        self.socket = root / "d.sock"
        self.url = f"unix://{self.socket}"
        self.netns = netns
        self.process: subprocess.Popen[bytes] | None = None
        (root / "daemon.json").write_text(json.dumps(config or {}))

    def start(self) -> None:
        dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        argv = [
            *(in_netns(self.netns) if self.netns else []),
            dockerd,
            f"--config-file={self.root / 'daemon.json'}",
            f"--host={self.url}",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'x'}",
            f"--pidfile={self.root / 'd.pid'}",
            f"--cgroup-parent=metaagent-private-{self.root.name}",
            "--bridge=none",
            "--iptables=false",
            "--ip-forward=false",
            "--ip-masq=false",
            "--userland-proxy=false",
        ]
        with (self.root / "dockerd.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            assert self.process.poll() is None, (self.root / "dockerd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the private dockerd did not answer"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # dockerd stops its containerd and unmounts its layers
            self.process.wait(timeout=STOP_TIMEOUT_S)
        self.process = None

    @contextmanager
    def hung(self) -> Iterator[None]:
        """The engine stopped (SIGSTOP) for the block: it accepts connections and answers none. Entered only
        once every thread of it has stopped: `kill` only queues the signal, and the stop begins when one
        thread takes it, so on a busy machine the other threads could still answer a request sent at once."""
        assert self.process is not None
        pid = self.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while not _every_thread_stopped(pid):
                assert time.monotonic() < deadline, "the private dockerd did not stop"
                time.sleep(0.01)
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def answers(self) -> bool:
        # A plain connect first: docker-py leaks the socket of a unix connect that fails.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            try:
                probe.connect(str(self.socket))
            except OSError:
                return False
        try:
            client = docker.DockerClient(base_url=self.url, version="1.41", timeout=5)
        except docker.errors.DockerException:
            return False
        try:
            client.ping()
            return True
        except (docker.errors.DockerException, OSError):
            return False
        finally:
            client.close()

    def load_image(self, source: docker.DockerClient, tag: str) -> None:
        """Copies `tag` from the shared engine (docker save | docker load, through the API). In a test run
        the export is kept in a file per image id in `IMAGE_EXPORTS` and reused: every private engine of
        the run (the fleet tests start several at once) loads that file, and the shared engine, which
        every other test uses at the same time, exports each image once."""
        if IMAGE_EXPORTS is None:
            with tempfile.TemporaryDirectory(prefix="metaagent-test-image-") as scratch:
                archive = Path(scratch) / "image.tar"
                _export(source, tag, archive)
                self._load(archive)
            return
        image_id = str(source.images.get(tag).id).removeprefix("sha256:")
        archive = IMAGE_EXPORTS / f"metaagent-test-image-{image_id[:32]}.tar"
        if not archive.exists():
            partial = archive.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.part")
            _export(source, tag, partial)
            partial.replace(archive)  # whole or not at all, whichever worker wrote it first
        self._load(archive)

    def _load(self, archive: Path) -> None:
        client = docker.DockerClient(base_url=self.url, version="1.41", timeout=120)
        try:
            with archive.open("rb") as data:
                client.api.load_image(data)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def containers(self) -> list[str]:
        client = docker.DockerClient(base_url=self.url, version="1.41", timeout=30)
        try:
            return [str(c.id) for c in client.containers.list(all=True, sparse=True)]
        finally:
            client.close()


def _export(source: docker.DockerClient, tag: str, path: Path) -> None:
    with path.open("wb") as out:
        for chunk in source.api.get_image(tag, chunk_size=1024 * 1024):
            out.write(chunk)


@contextmanager
def private_engine() -> Iterator[PrivateEngine]:
    root = Path(tempfile.mkdtemp(prefix="mad-", dir="/tmp"))
    engine = PrivateEngine(root)
    try:
        engine.start()
        yield engine
    finally:
        try:
            if engine.process is None:
                engine.start()  # remove what the test left, with the engine's own tools
            client = docker.DockerClient(base_url=engine.url, version="1.41", timeout=30)
            for container in client.containers.list(all=True, sparse=True):
                container.remove(force=True)
            client.close()
        finally:
            engine.stop()
            shutil.rmtree(root, ignore_errors=True)


def _every_thread_stopped(pid: int) -> bool:
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # a thread that ended
            continue
        if state not in ("T", "t"):
            return False
    return True
