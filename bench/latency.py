"""End-to-end latency of `console.log(1)`: the service with and without its warm pool, and the baselines.

Contenders run in rounds, one execution of each per round in a shuffled order, so that a change in the
machine's load during the run falls on all of them alike and the ratios stay meaningful.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.baselines import EXPECTED_STDOUT, PROGRAM, ContenderFailed, Epicbox, docker_run_argv, node_argv, time_process
from bench.service import BenchService
from bench.stats import Summary

POOLED = "service, warm pool"
COLD = "service, pool off"
POOLED_RUNSC = "service, warm pool, runsc"
COLD_RUNSC = "service, pool off, runsc"
NODE = "node -e (host)"
DOCKER_RUN = "docker run --rm"
EPICBOX = "epicbox"
EPICBOX_CAPPED = "epicbox + 0.5 CPU cap"


@dataclass
class ServiceTimer:
    """Times `POST /tools/code-interpreter` of `console.log(1)`; keeps each execution's id and own duration."""

    service: BenchService
    wait_for_pool: bool
    execution_ids: list[str] = field(default_factory=list)
    durations_ms: list[float] = field(default_factory=list)  # the response's duration_ms: the code's run time

    def __call__(self) -> float:
        if self.wait_for_pool:
            self.service.wait_pool_full()
        started = time.perf_counter()
        response = self.service.client.post("/tools/code-interpreter", json={"code": PROGRAM})
        elapsed_ms = (time.perf_counter() - started) * 1000
        body: dict[str, Any] = response.json()
        if response.status_code != 200 or body.get("stdout") != EXPECTED_STDOUT:
            raise ContenderFailed(f"{self.service.name}: {response.status_code} {body}")
        self.execution_ids.append(str(body["execution_id"]))
        self.durations_ms.append(float(body["duration_ms"]))
        return elapsed_ms

    def forget(self) -> None:
        self.execution_ids.clear()
        self.durations_ms.clear()

    def paths(self) -> dict[str, int]:
        """How many of the measured executions the audit log says took each path ("warm", "cold")."""
        known = self.service.container_paths()
        counts: dict[str, int] = {}
        for execution_id in self.execution_ids:
            path = known.get(execution_id, "missing")
            counts[path] = counts.get(path, 0) + 1
        return counts


def measure(
    *,
    pooled: BenchService | None,
    cold: BenchService | None,
    node: str,
    image: str,
    cpus: float,
    epicbox: Epicbox | None,
    rounds: int,
    warmup: int,
    progress: Callable[[str], None],
    pooled_runsc: BenchService | None = None,
    cold_runsc: BenchService | None = None,
) -> dict[str, Any]:
    """`pooled` and `cold` run runc; `pooled_runsc` and `cold_runsc`, when given, the same under runsc."""
    timers = {
        name: ServiceTimer(service, wait_for_pool=name in (POOLED, POOLED_RUNSC))
        for name, service in ((POOLED, pooled), (COLD, cold), (POOLED_RUNSC, pooled_runsc), (COLD_RUNSC, cold_runsc))
        if service is not None
    }
    contenders: dict[str, Callable[[], float]] = {
        NODE: lambda: time_process(node_argv(node)),
        DOCKER_RUN: lambda: time_process(docker_run_argv(image, cpus)),
    }
    if epicbox is not None:
        contenders[EPICBOX] = epicbox.run
        contenders[EPICBOX_CAPPED] = lambda: epicbox.run(capped=True)
    contenders.update(timers)

    rng = random.Random(1)  # fixed: two runs shuffle alike
    order = list(contenders)
    for _ in range(warmup):
        for name in order:
            contenders[name]()
    for timer in timers.values():
        timer.forget()

    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds):
        rng.shuffle(order)
        for name in order:
            samples[name].append(contenders[name]())
        if (index + 1) % 10 == 0 or index + 1 == rounds:
            progress(f"latency: {index + 1}/{rounds} rounds")

    result: dict[str, Any] = {
        "program": PROGRAM,
        "rounds": rounds,
        "warmup_rounds": warmup,
        "summaries": {name: Summary.of(values).as_dict() for name, values in samples.items()},
        "samples_ms": samples,
    }
    keys = {POOLED: "pooled", COLD: "cold", POOLED_RUNSC: "pooled_runsc", COLD_RUNSC: "cold_runsc"}
    for name, timer in timers.items():
        key = keys[name]
        result[f"{key}_paths"] = timer.paths()
        # The response's duration_ms runs from the code's hand-over to the container's exit; the rest of
        # each request is the service's own part: HTTP, admission, (cold) the start, inspect, remove, audit.
        result[f"{key}_code_duration_ms"] = Summary.of(timer.durations_ms).as_dict()
        outside = [total - code for total, code in zip(samples[name], timer.durations_ms, strict=True)]
        result[f"{key}_outside_code_ms"] = Summary.of(outside).as_dict()
    return result
