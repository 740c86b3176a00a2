"""An agent loop's pattern: back-to-back calls of `console.log(1)` with no pause between them.

The latency section waits for a full pool before each pooled call, which is the pool's best case. Here
one client sends its next request the moment the last answer arrives, as an agent loop does, so the pool
must refill faster than that client drains it, or calls take the cold path. Bare `node -e` is timed
just before each service's run, the same number of times, as the baseline of the ratios.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.baselines import node_argv, time_process
from bench.latency import ServiceTimer
from bench.service import BenchService
from bench.stats import Summary


def measure(
    services: dict[str, BenchService], *, node: str, calls: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """For each service (by runtime name): `calls` back-to-back calls after a full pool, and node's."""
    result: dict[str, Any] = {"calls": calls, "runtimes": {}}
    for runtime, service in services.items():
        node_ms = [time_process(node_argv(node)) for _ in range(calls)]
        timer = ServiceTimer(service, wait_for_pool=False)
        service.wait_pool_full()  # the start of an agent's loop: the pool has had time to fill
        timer()  # one warm-up call, as the latency section's warm-up rounds
        timer.forget()
        samples = [timer() for _ in range(calls)]
        service_summary, node_summary = Summary.of(samples), Summary.of(node_ms)
        result["runtimes"][runtime] = {
            "service": service_summary.as_dict(),
            "node": node_summary.as_dict(),
            "paths": timer.paths(),
            "p50_ratio": service_summary.p50 / node_summary.p50,
            "p95_ratio": service_summary.p95 / node_summary.p50,
            "samples_ms": samples,
        }
        progress(f"sequential: {calls} back-to-back calls under {runtime}")
    return result
