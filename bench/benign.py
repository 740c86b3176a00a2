"""The test suite's benign programs (the code interpreter's and the module gate's) under each isolation
runtime: their total time end to end, through a pooled service of each runtime, in the same run.

A round runs every program once on each runtime, the runtimes' order alternating from round to round.
Before each program the benchmark waits, untimed, until the service's pool is full, as the latency rows
do; each program's output is checked, and a wrong one is counted, not timed. A crash at start in a
warm container never reaches a program: the pool starts another, and /metrics counts it, which is
reported too. `--only benign --benign-runtimes runsc --benign-rounds 50` is the start-up crash count.

The programs come from the tests (`tests/sandbox/test_code_interpreter.py`, `tests/sandbox/test_gate.py`),
so the benchmark needs the dev environment (`scripts/bootstrap --dev`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.service import BenchService
from bench.stats import Summary

# The warm pool's log lines of a runner that died before it was handed code (sandbox/pool.py).
_RETRY_LOG = ("the runner did not start", "the runner ended while it waited")


@dataclass(frozen=True)
class Program:
    name: str
    code: str
    stdin: str | None
    stdout: str


def unavailable() -> str | None:
    """Why the programs cannot be loaded here (None when they can): they need the dev environment."""
    if importlib.util.find_spec("pytest") is None:
        return "the benign programs come from the tests, which need the dev environment (scripts/bootstrap --dev)"
    return None


def programs() -> list[Program]:
    # The tests' modules, imported on use (they need the dev environment's pytest) and by name, so that
    # the type check of bench/ does not reach into the tests.
    interpreter = importlib.import_module("tests.sandbox.test_code_interpreter")
    gate = importlib.import_module("tests.sandbox.test_gate")
    return [Program(f"interpreter:{name}", code, None, out) for name, (code, out) in interpreter.BENIGN.items()] + [
        Program(f"gate:{case.id}", case.code, case.stdin or None, case.stdout) for case in gate.BENIGN
    ]


def _run(service: BenchService, program: Program) -> tuple[float, float] | str:
    """(end-to-end ms, the response's duration_ms), or what was wrong with the program's answer."""
    service.wait_pool_full()
    body: dict[str, Any] = {"code": program.code, "timeout_s": 10}
    if program.stdin is not None:
        body["stdin"] = program.stdin
    started = time.perf_counter()
    response = service.client.post("/tools/code-interpreter", json=body)
    elapsed_ms = (time.perf_counter() - started) * 1000
    result: dict[str, Any] = response.json()
    if response.status_code != 200 or result.get("stdout") != program.stdout or result.get("exit_code") != 0:
        fields = ("exit_code", "timed_out", "oom_killed", "container_path")
        answer = {key: result.get(key) for key in fields} | {"stderr": str(result.get("stderr", ""))[:300]}
        return f"{program.name}: HTTP {response.status_code} {json.dumps(answer)}"
    return elapsed_ms, float(result["duration_ms"])


def start_retries(service: BenchService) -> float:
    """The service's count of warm containers whose runner died before any code was handed over, every
    language's pool together."""
    return sum(
        float(line.split()[1])
        for line in service.client.get("/metrics").text.splitlines()
        if line.startswith("metaagent_pool_start_retries_total{")
    )


def measure(services: dict[str, BenchService], *, rounds: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Per runtime (`services`' keys): the programs' total time per round, their code's own time, the
    programs whose answer was wrong (each with what it was), and the crashes at start the pool retried."""
    chosen = programs()
    totals: dict[str, list[float]] = {name: [] for name in services}
    code_totals: dict[str, list[float]] = {name: [] for name in services}
    failures: dict[str, list[str]] = {name: [] for name in services}
    retries_before = {name: start_retries(service) for name, service in services.items()}
    for index in range(rounds):
        order = list(services) if index % 2 == 0 else list(reversed(services))
        for runtime in order:
            total = code = 0.0
            for program in chosen:
                answer = _run(services[runtime], program)
                if isinstance(answer, str):
                    failures[runtime].append(answer)
                    progress(f"benign program failed under {runtime}: {answer}")
                    continue
                elapsed_ms, code_ms = answer
                total += elapsed_ms
                code += code_ms
            totals[runtime].append(total)
            code_totals[runtime].append(code)
        progress(f"benign programs: round {index + 1}/{rounds}")
    return {
        "programs": len(chosen),
        "rounds": rounds,
        "total_ms": {name: Summary.of(values).as_dict() for name, values in totals.items()},
        "code_total_ms": {name: Summary.of(values).as_dict() for name, values in code_totals.items()},
        "failures": failures,
        # Crashes at start that the pool absorbed (no program saw them): /metrics' counter over the run.
        "start_retries": {name: start_retries(service) - retries_before[name] for name, service in services.items()},
        # What the pool logged of each (how the runner ended, its stderr).
        "start_retry_log": {name: service.log_lines(*_RETRY_LOG) for name, service in services.items()},
    }
