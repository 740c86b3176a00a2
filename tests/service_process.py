"""A real `metaagent serve` process on a free loopback port, its stderr in a file, its memory readable.

For tests that need what only a separate process shows: the log lines as the formatter writes them, and
the process's resident memory (`VmRSS`, and its high-water mark `VmHWM`, which catches a peak between
two readings).
"""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2

from tests.test_cli import METAAGENT, clean_env, free_port

START_TIMEOUT_S = 60


@dataclass
class ServiceProcess:
    base: str
    port: int
    process: subprocess.Popen[bytes]
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_bytes().decode("utf-8", "surrogateescape")

    def memory_kib(self, field: str = "VmRSS") -> int:
        """`VmRSS` (resident now) or `VmHWM` (the most it was resident), in KiB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
        assert match, status
        return int(match.group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


@contextmanager
def service_process(tmp_path: Path, open_files: int | None = None, **env: str) -> Iterator[ServiceProcess]:
    """Runs the service with these environment variables (no warm pool unless asked: these tests run no
    code), and with `open_files` as its RLIMIT_NOFILE (soft and hard) if given."""
    env = {"METAAGENT_POOL_ENABLED": "false", **env}
    port = free_port()
    stderr_path = tmp_path / "service-stderr.log"

    def limit_open_files() -> None:  # only setrlimit, which is safe between fork and exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [*METAAGENT, "serve", "--port", str(port)],
            cwd=tmp_path,
            env=clean_env(tmp_path, **env),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            preexec_fn=None if open_files is None else limit_open_files,
        )
    service = ServiceProcess(f"http://127.0.0.1:{port}", port, process, stderr_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx2.get(f"{service.base}/health", timeout=5).json().get("status") != "starting":
                    break
            except httpx2.TransportError:
                pass
            assert process.poll() is None, service.stderr()
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.1)
        yield service
    finally:
        service.stop()
