"""The contenders the service is compared with: bare `node -e`, `docker run --rm`, and epicbox.

`docker run` gets the flags the service's own containers get, read from the same `container_spec`, so
the comparison cannot drift from what the service does. epicbox needs `urllib3<2`, which the service's
environment cannot have, so it runs in a virtual environment of its own (created here on first use) as
a long-lived driver process that runs one execution per line it reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from metaagent.languages.container import container_spec
from metaagent.sandbox.engine import SANDBOX_UID
from metaagent.sandbox.runtime import RUNC, Runtime
from metaagent.tools.code_interpreter import DEFAULT_MEMORY_MB

PROGRAM = "console.log(1)"
EXPECTED_STDOUT = "1\n"
BENCH_LABEL = "org.metaagent.bench"  # on every container the benchmark creates itself, for the clean-up
HERE = Path(__file__).resolve().parent
EPICBOX_DRIVER = HERE / "epicbox_driver.py"
EPICBOX_REQUIREMENTS = HERE / "epicbox-requirements.txt"
_CACHE = Path(os.environ.get("METAAGENT_SANDBOX_CACHE_DIR") or "/var/cache/metaagent")
DEFAULT_EPICBOX_VENV = _CACHE / "bench" / "epicbox-venv"


class ContenderFailed(RuntimeError):
    """A contender did not print `1`: its timing would mean nothing."""


def node_argv(node: str) -> list[str]:
    return [node, "-e", PROGRAM]


def docker_run_argv(image: str, cpus: float, runtime: Runtime = RUNC) -> list[str]:
    """`docker run --rm` of the sandbox image with the flags `Engine.create` gives every execution under
    `runtime` (runsc: its pids cgroup room and the guest's process limit, see metaagent.sandbox.runtime)."""
    spec = container_spec("bench", image, DEFAULT_MEMORY_MB, cpus, runtime=runtime)
    memory = f"{spec.memory_mb}m"
    tmpfs = f"/tmp:rw,nosuid,nodev,noexec,size={spec.tmp_size_mb}m,nr_inodes={spec.tmp_inodes},mode=1777"
    return [
        "docker", "run", "--rm",
        "--name", f"metaagent-bench-{uuid.uuid4().hex[:16]}",
        "--label", f"{BENCH_LABEL}={os.getpid()}",
        "--network", "none",
        "--read-only",
        "--tmpfs", tmpfs,
        "--user", SANDBOX_UID,
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--memory", memory,
        "--memory-swap", memory,
        "--cpus", str(spec.cpus),
        "--pids-limit", str(spec.pids_limit),
        "--ulimit", f"nofile={spec.nofile}:{spec.nofile}",
        *(["--ulimit", f"nproc={spec.nproc}:{spec.nproc}"] if spec.nproc is not None else []),
        *(["--runtime", spec.runtime] if spec.runtime != RUNC.name else []),
        "--ipc", "none",
        "--log-driver", "none",
        "--hostname", "sandbox",
        "--workdir", "/tmp",
        "--entrypoint", spec.command[0],  # dumb-init, as PID 1
        image,
        *spec.command[1:2],  # "--"
        "/usr/bin/node", "-e", PROGRAM,
    ]  # fmt: skip


def time_process(argv: list[str]) -> float:
    """Milliseconds from spawning `argv` to its exit; raises ContenderFailed unless it printed `1`."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    elapsed_ms = (time.perf_counter() - started) * 1000
    if done.returncode != 0 or done.stdout != EXPECTED_STDOUT:
        raise ContenderFailed(f"{argv[0]} exited {done.returncode}: {done.stdout!r} {done.stderr[-500:]!r}")
    return elapsed_ms


def ensure_epicbox_venv(venv: Path) -> Path:
    """The venv's python, after creating the venv and installing epicbox into it if needed."""
    python = venv / "bin" / "python"
    if python.exists() and _epicbox_importable(python):
        return python
    print(f"bench: creating epicbox's own virtual environment in {venv} (once)", file=sys.stderr, flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
            str(EPICBOX_REQUIREMENTS),
        ],
        check=True,
        timeout=600,
    )
    if not _epicbox_importable(python):
        raise RuntimeError(f"epicbox does not import in {venv} after installing it")
    return python


def _epicbox_importable(python: Path) -> bool:
    done = subprocess.run([str(python), "-c", "import epicbox"], capture_output=True, timeout=60, check=False)
    return done.returncode == 0


class Epicbox:
    """The epicbox driver process: `run()` executes the program once and returns epicbox's own timing."""

    def __init__(self, python: Path, image: str) -> None:
        self.process = subprocess.Popen(
            [str(python), str(EPICBOX_DRIVER), image, PROGRAM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.versions: dict[str, str] = self._read()["versions"]

    def __enter__(self) -> Epicbox:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise ContenderFailed(f"the epicbox driver exited ({self.process.wait(timeout=30)})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, *, capped: bool = False) -> float:
        """One execution; `capped` adds the service's 0.5 CPU share, which epicbox itself cannot set."""
        assert self.process.stdin is not None
        self.process.stdin.write("run capped\n" if capped else "run\n")
        self.process.stdin.flush()
        reply = self._read()
        if reply.get("exit_code") != 0 or reply.get("stdout") != EXPECTED_STDOUT:
            raise ContenderFailed(f"epicbox: {reply}")
        return float(reply["ms"])

    def close(self) -> None:
        """EOF on its stdin ends the driver; it removes any container it still knows of first."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
