"""The HTTP tool's added latency: `POST /tools/http` to a local server against a direct request to it.

Both go over kept-alive connections from the benchmark (the service's own connection to the upstream
is whatever the tool does), alternating one of each, so that what differs is the tool: the service's
HTTP handling, validation, the egress guard and its own request to the upstream.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx2

from bench.machine import REPO
from bench.service import BenchService
from bench.stats import Summary
from bench.upstream import BODY


class Upstream:
    """`python -m bench.upstream` on a free 127.0.0.1 port."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.upstream"], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port.isdigit():
            self.stop()
            raise RuntimeError("the local upstream server did not start")
        self.url = f"http://127.0.0.1:{port}/"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def measure(service: BenchService, *, iterations: int, warmup: int, progress: Callable[[str], None]) -> dict[str, Any]:
    upstream = Upstream()
    try:
        with httpx2.Client(timeout=30) as direct_client:

            def direct() -> float:
                started = time.perf_counter()
                response = direct_client.get(upstream.url)
                elapsed_ms = (time.perf_counter() - started) * 1000
                if response.status_code != 200 or response.content != BODY:
                    raise RuntimeError(f"direct request failed: {response.status_code}")
                return elapsed_ms

            def through_tool() -> float:
                started = time.perf_counter()
                response = service.client.post("/tools/http", json={"url": upstream.url, "method": "GET"})
                elapsed_ms = (time.perf_counter() - started) * 1000
                body = response.json()
                if response.status_code != 200 or body.get("status") != 200 or body.get("body") != BODY.decode():
                    raise RuntimeError(f"the HTTP tool failed: {response.status_code} {body}")
                return elapsed_ms

            for _ in range(warmup):
                direct()
                through_tool()
            direct_ms: list[float] = []
            tool_ms: list[float] = []
            for index in range(iterations):
                # Alternate which goes first, so neither always follows the other's warm caches.
                if index % 2:
                    direct_ms.append(direct())
                    tool_ms.append(through_tool())
                else:
                    tool_ms.append(through_tool())
                    direct_ms.append(direct())
            progress(f"http tool: {iterations} requests each")
    finally:
        upstream.stop()
    direct_summary, tool_summary = Summary.of(direct_ms), Summary.of(tool_ms)
    return {
        "iterations": iterations,
        "direct_ms": direct_summary.as_dict(),
        "tool_ms": tool_summary.as_dict(),
        "added_p50_ms": tool_summary.p50 - direct_summary.p50,
        "added_p95_ms": tool_summary.p95 - direct_summary.p95,
    }
