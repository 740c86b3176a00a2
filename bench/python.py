"""Python (issue 24): pooled one-shot runs and session calls against bare `python3 -c pass` on the host,
and what `import pandas` costs in a warm runner against a cold interpreter, per runtime, in one run.

- Contenders, in rounds of a shuffled order, each begun with the Python pool full (waited for, untimed,
  so that no contender competes with the refill another left, as in the sessions section): a pooled
  `print(1)` ("with the pool ready"); the same back to back (one run untimed, and the next timed at
  once: what a caller that sends one call after another gets, its refill under way); a call `1+1`
  into a Python session that stays open, twice: through httpx (the client the other sections use) and
  through the standard library's `http.client` on a kept-alive connection (the service's own latency:
  httpx's own work per request is about 1 ms on this machine, and a caller's client is the caller's),
  and that call back to back (one call untimed, the next timed at once: every process on the call's way,
  and the CPUs under them, still awake; a call after a pause pays for waking each, see the README);
  and `python3 -c pass` on the host. Every result is checked.
- What the service's own process spends on a session call: its CPU time (the scheduler's sum over its
  threads, `/proc/<pid>/task/*/schedstat`) across each `http.client` call, and the same call's latency and
  CPU against the framework's floor: FastAPI on uvicorn's httptools protocol and uvloop, started here,
  with one route that takes the same request model and answers a real call's answer, doing nothing else
  (`floor_app.py`), in the same interleaved rounds.
- `import pandas`: timed inside the code (perf_counter around the import) in a warm session, where the
  runner imported it before the call, and in a cold `docker run` of the same image's interpreter with
  nothing imported (`python3 -I -S`, dist-packages on the path), under the same runtime.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.cpustat import parse_schedstat
from bench.service import BenchService, free_port
from bench.stats import Summary, ratio

POOLED = "pooled print(1), pool ready"
BACK_TO_BACK = "pooled print(1), back to back"
SESSION_CALL = "session call 1+1"
SESSION_CALL_LEAN = "session call 1+1, http.client"
SESSION_CALL_LEAN_BACK_TO_BACK = "session call 1+1, http.client, back to back"
FLOOR_CALL = "framework floor: the same request to FastAPI + uvicorn (httptools) that does nothing"
BARE = "python3 -c pass (host, /usr/bin/python3)"
TIMED_IMPORT = "import time\nt = time.perf_counter()\nimport pandas\nprint((time.perf_counter() - t) * 1000)"
COLD_IMPORT = (
    "import sys, time\nsys.path.append('/usr/lib/python3/dist-packages')\n"
    "t = time.perf_counter()\nimport pandas\nprint((time.perf_counter() - t) * 1000)"
)


class PythonService:
    """A caller of a service that serves Python, for the contenders above."""

    def __init__(self, service: BenchService) -> None:
        self.service = service
        self.client = service.client

    def python_pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.client.get("/health").json()["checks"]["warm_pool"]["languages"]["python"]
        return pool

    def wait_python_pool(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            pool = self.python_pool()
            if pool["ready"] >= max(pool["size"], 1):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Python pool did not fill: {pool}\n{self.service.log_tail()}")
            time.sleep(0.01)

    def run(self, code: str) -> dict[str, Any]:
        body = {"code": code, "language": "python", "timeout_s": 30}
        response = self.client.post("/tools/code-interpreter", json=body)
        answer: dict[str, Any] = response.json()
        if response.status_code != 200 or answer.get("exit_code") != 0:
            raise RuntimeError(f"a pooled Python run failed: {response.status_code} {answer}")
        return answer

    def session(self) -> str:
        response = self.client.post("/sessions", json={"language": "python"})
        if response.status_code != 201:
            raise RuntimeError(f"POST /sessions (python) answered {response.status_code}: {response.text}")
        return str(response.json()["session_id"])

    def call(self, session_id: str, code: str) -> dict[str, Any]:
        response = self.client.post(f"/sessions/{session_id}/execute", json={"code": code, "timeout_s": 30})
        answer: dict[str, Any] = response.json()
        return _checked_call(response.status_code, answer)


def process_cpu_ns(pid: int) -> int:
    """A process's time on a CPU so far, every thread of it (the scheduler's own sums)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += parse_schedstat(stat.read())
        except OSError:  # a thread that has just ended
            continue
    return total


class LeanCaller:
    """Session calls over one kept-alive `http.client` connection: no client library's work in the way.
    Each call's latency is kept in `latency_ms`, timed around the request and its answer only (not the
    reads of /proc around them), and its share of the server process's CPU (`pid`) in `cpu_ms`."""

    def __init__(self, port: int, pid: int) -> None:
        self.pid = pid
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.latency_ms: list[float] = []
        self.cpu_ms: list[float] = []

    def reconnect(self, session_id: str) -> None:
        """A fresh connection, used once (untimed): the service closes one idle past its keep-alive."""
        self.connection.close()
        self.connection.request("GET", f"/sessions/{session_id}")
        self.connection.getresponse().read()

    def call(self, session_id: str, code: str) -> dict[str, Any]:
        body = json.dumps({"code": code, "timeout_s": 30})
        before = process_cpu_ns(self.pid)
        started = time.perf_counter()
        self.connection.request("POST", f"/sessions/{session_id}/execute", body, {"content-type": "application/json"})
        response = self.connection.getresponse()
        answer = response.read()
        self.latency_ms.append((time.perf_counter() - started) * 1000)
        self.cpu_ms.append((process_cpu_ns(self.pid) - before) / 1e6)
        return _checked_call(response.status, json.loads(answer))

    def close(self) -> None:
        self.connection.close()


def _checked_call(status: int, answer: dict[str, Any]) -> dict[str, Any]:
    if status != 200 or answer.get("error") is not None:
        raise RuntimeError(f"a Python session call failed: {status} {answer}")
    return answer


class FrameworkFloor:
    """`floor_app.py` under uvicorn with the service's protocol (httptools) and no access log, on a free port."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "uvicorn", "bench.floor_app:app", "--port", str(self.port), "--http", "httptools"]
        argv += ["--loop", "uvloop", "--no-access-log", "--log-level", "warning"]
        env = {**os.environ, "METAAGENT_BENCH_FLOOR_ANSWER": json.dumps(answer)}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen(argv, cwd=root, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the framework floor's server did not start") from None
                time.sleep(0.05)
        self.caller = LeanCaller(self.port, self.process.pid)

    def close(self) -> None:
        self.caller.close()
        self.process.terminate()
        self.process.wait(timeout=30)


def host_python() -> str:
    """The host's own interpreter: Debian's, the one the sandbox image also runs, when it is there. Not
    whatever `python3` on the PATH is: a version manager's shim (pyenv's) starts a shell and costs ten
    times the interpreter's start."""
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    found = shutil.which("python3")
    return os.path.realpath(found) if found else sys.executable


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def _bare(python: str) -> None:
    # Through pipes, as `time_process` runs node: `subprocess.run` with a timeout and no pipes waits for the
    # exit by polling at 0.5, 1, 2, 4, 8, 16 ms..., so a 10 ms interpreter measured 31.5 ms (and 15.5 ms
    # on a faster machine): the baseline was the poll's step, not the interpreter's start.
    subprocess.run([python, "-c", "pass"], check=True, capture_output=True, timeout=60)


def _cold_import_ms(image: str, runtime: str) -> float:
    argv = ["docker", "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "--user", "1001:1001"]
    argv += ["--runtime", runtime, "--entrypoint", "/usr/bin/python3.11", image, "-I", "-S", "-c", COLD_IMPORT]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return float(done.stdout.strip())


def measure(
    service: BenchService, *, image: str, runtime: str, rounds: int, warmup: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    python = host_python()
    caller = PythonService(service)
    assert service.process is not None
    lean = LeanCaller(service.port, service.process.pid)
    lean_back_to_back = LeanCaller(service.port, service.process.pid)
    caller.wait_python_pool()
    session_id = caller.session()
    answer = caller.call(session_id, "1+1")
    if answer["result"] != "2":
        raise RuntimeError("the Python session does not add")
    floor = FrameworkFloor(answer)

    # The callers' connections and the floor's server close, whatever happens.
    with contextlib.closing(floor), contextlib.closing(lean), contextlib.closing(lean_back_to_back):
        timed_calls: dict[str, Callable[[], object]] = {
            POOLED: lambda: caller.run("print(1)"),
            BACK_TO_BACK: lambda: caller.run("print(1)"),
            SESSION_CALL: lambda: caller.call(session_id, "1+1"),
            BARE: lambda: _bare(python),
        }
        lean_callers = {
            SESSION_CALL_LEAN: lean,
            SESSION_CALL_LEAN_BACK_TO_BACK: lean_back_to_back,
            FLOOR_CALL: floor.caller,
        }

        def contender(name: str) -> float:
            caller.wait_python_pool()
            if name == BACK_TO_BACK:
                caller.run("print(1)")  # untimed: the timed one follows it at once
            if name in lean_callers:
                # A fresh connection, as the pool's wait just used httpx's (the floor answers its 404).
                lean_callers[name].reconnect(session_id)
                if name == SESSION_CALL_LEAN_BACK_TO_BACK:
                    lean_callers[name].call(session_id, "1+1")  # untimed: the timed one follows it at once
                lean_callers[name].call(session_id, "1+1")
                return lean_callers[name].latency_ms[-1]
            return _timed(timed_calls[name])

        contenders = {name: functools.partial(contender, name) for name in [*timed_calls, *lean_callers]}
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for round_number in range(warmup + rounds):
            order = list(contenders)
            random.shuffle(order)
            for name in order:
                elapsed = contenders[name]()
                if round_number >= warmup:
                    samples[name].append(elapsed)
        warm_imports = [float(caller.call(session_id, TIMED_IMPORT)["stdout"]) for _ in range(3)]
        cold_imports = [_cold_import_ms(image, runtime) for _ in range(3)]
    service.client.delete(f"/sessions/{session_id}")
    summaries = {name: Summary.of(values).as_dict() for name, values in samples.items()}
    bare = summaries[BARE]["p50"]
    found = {
        "runtime": runtime,
        "summaries": summaries,
        "samples": samples,
        "ratios": {name: ratio(summaries[name]["p50"], bare) for name in summaries if name != BARE},
        "import_pandas_ms": {"warm": warm_imports, "cold": cold_imports},
        # The server process's CPU per call, over the timed rounds only (the warm-up's calls come first).
        "server_cpu_ms": {
            SESSION_CALL_LEAN: Summary.of(lean.cpu_ms[-rounds:]).as_dict(),
            FLOOR_CALL: Summary.of(floor.caller.cpu_ms[-rounds:]).as_dict(),
        },
    }
    progress(f"python ({runtime}): " + json.dumps(found["ratios"]))
    return found


def lines(results: dict[str, Any]) -> list[str]:
    """The section as text: one block per runtime."""
    out = []
    for runtime, found in results.items():
        out.append(f"Python under {runtime}:")
        for name, summary in found["summaries"].items():
            shown = f"  {name}: p50 {summary['p50']:.1f} ms, p95 {summary['p95']:.1f} ms"
            if name in found["ratios"]:
                shown += f" ({found['ratios'][name]:.2f} x {BARE} p50)"
            out.append(shown)
        for name, cpu in found.get("server_cpu_ms", {}).items():
            out.append(f"  server CPU per call, {name}: mean {cpu['mean']:.2f} ms, p50 {cpu['p50']:.2f} ms")
        imports = found["import_pandas_ms"]
        warm, cold = min(imports["warm"]), min(imports["cold"])
        out.append(f"  import pandas: warm runner {warm:.3f} ms, cold interpreter {cold:.0f} ms")
    return out
