"""A private redis-server for one test: its own socket in the test's directory, no persistence, stopped by
its pid. `stop()` and `start()` again on the same socket stand for a Redis that blinked (its memory lost,
as a server without persistence loses it)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (scripts/ensure-docker installs Debian's)")
        with (self.directory / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                 "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
                stdout=log, stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.directory / 'redis.log').read_text()}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.process = None
        self.socket.unlink(missing_ok=True)
