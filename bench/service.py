"""A real `metaagent serve` process started by the benchmark, and what it tells through /health and its audit log."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx2

START_TIMEOUT_S = 300.0  # the image may still be building on a first run
POOL_FILL_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_environment(settings: dict[str, str]) -> dict[str, str]:
    """The caller's environment minus every setting of the service, then the benchmark's own settings."""
    inherited = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("METAAGENT_")
        and key not in ("ALLOW_HTTP_HOSTS", "OPENAI_API_KEY", "SERPER_API_KEY", "OPENAI_BASE_URL")
    }
    return {**inherited, **settings}


class BenchService:
    """`metaagent serve` on a free loopback port, in a temporary directory of its own (no .env is read)."""

    def __init__(self, name: str, **settings: str) -> None:
        self.name = name
        self.workdir = Path(tempfile.mkdtemp(prefix=f"metaagent-bench-{name}-"))
        self.audit_log = self.workdir / "audit.jsonl"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.settings = {
            "METAAGENT_AUDIT_LOG": str(self.audit_log),
            "METAAGENT_SANDBOX_BUILD_ON_START": "true",
            # The benchmarks run JavaScript: a Python lane would build its image and fill a pool of its own
            # (with half the warm pool's memory budget) beside the figures measured.
            "METAAGENT_LANGUAGES": "javascript",
            **settings,
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.client = httpx2.Client(base_url=self.base_url, timeout=120)

    def __enter__(self) -> BenchService:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        with (self.workdir / "service.log").open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "metaagent", "serve", "--port", str(self.port)],
                cwd=self.workdir,
                env=_clean_environment(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} service exited at start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} service's sandbox image was not ready in {START_TIMEOUT_S:.0f} s")
            try:
                checks = self.health().get("checks")  # none while it is starting
                if checks and checks["sandbox_image"]["ok"]:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM to our own process (by pid): the service removes its containers and exits."""
        self.client.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.workdir / "service.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_lines(self, *containing: str) -> list[str]:
        """The lines of the service's log that contain any of `containing`."""
        try:
            text = (self.workdir / "service.log").read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if any(part in line for part in containing)]

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = self.client.get("/health").json()
        return body

    def warm_pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.health()["checks"]["warm_pool"]
        return pool

    def wait_pool_full(self) -> None:
        """Until every pooled container is ready: no refill in flight competes with what is measured next."""
        deadline = time.monotonic() + POOL_FILL_TIMEOUT_S
        while True:
            pool = self.warm_pool()
            if pool["ready"] >= pool["size"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} service's warm pool did not fill: {pool}\n{self.log_tail()}")
            time.sleep(0.01)

    def session_records(self) -> dict[str, dict[str, Any]]:
        """session_id -> its `session.created` audit record (container_id, container_path...)."""
        records: dict[str, dict[str, Any]] = {}
        if not self.audit_log.exists():
            return records
        for line in self.audit_log.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "session.created":
                records[str(record.get("session_id"))] = record
        return records

    def container_paths(self) -> dict[str, str]:
        """execution_id -> "warm" or "cold", from the audit log."""
        paths: dict[str, str] = {}
        if not self.audit_log.exists():  # nothing audited yet
            return paths
        for line in self.audit_log.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "execution.finished":
                paths[str(record.get("execution_id"))] = str(record.get("container_path"))
        return paths
