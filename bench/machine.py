"""What the figures were measured on: they only mean something next to the machine and its load."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker

REPO = Path(__file__).resolve().parent.parent


def _output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _memory_mb() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def node_path() -> str:
    found = shutil.which("node")
    if found is None:
        raise SystemExit("bench: no `node` on PATH for the bare `node -e` baseline (apt-get install nodejs)")
    return found


def describe(client: docker.DockerClient) -> dict[str, Any]:
    engine = client.version()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_mb": _memory_mb(),
        "kernel": platform.release(),
        "os": _output(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "python": platform.python_version(),
        "docker_engine": engine.get("Version"),
        "docker_api": engine.get("ApiVersion"),
        "node_host": _output([node_path(), "--version"]),
        "commit": _output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "load_average_start": load_average(),
    }
