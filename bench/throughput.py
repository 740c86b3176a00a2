"""Executions per second at a fixed concurrency over a fixed period: the service against a loop of
`docker run --rm` with as many loops as the service has clients.

Each client starts its next execution as soon as its last one returns. Only executions that finish
inside the period count; those still running at its end are waited for (so the next measurement starts
on a quiet engine) and reported, not counted.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx2

from bench.baselines import EXPECTED_STDOUT, PROGRAM, docker_run_argv
from metaagent.sandbox.runtime import RUNC, Runtime


@dataclass
class Tally:
    concurrency: int
    duration_s: float
    completed: int = 0
    errors: int = 0
    rejected: int = 0  # 429: the service's queue was full
    unfinished: int = 0  # still running when the period ended

    @property
    def per_second(self) -> float:
        return self.completed / self.duration_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_second": self.per_second}


async def _service_clients(base_url: str, concurrency: int, duration_s: float) -> Tally:
    tally = Tally(concurrency, duration_s)
    limits = httpx2.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx2.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        end = time.monotonic() + duration_s

        async def one_client() -> None:
            while time.monotonic() < end:
                try:
                    response = await client.post("/tools/code-interpreter", json={"code": PROGRAM})
                    ok = response.status_code == 200 and response.json().get("stdout") == EXPECTED_STDOUT
                    status = response.status_code
                except httpx2.HTTPError:
                    ok, status = False, 0
                if time.monotonic() > end:
                    tally.unfinished += 1
                elif ok:
                    tally.completed += 1
                elif status == 429:
                    tally.rejected += 1
                    await asyncio.sleep(0.05)  # a rejected client retries shortly, not in a tight loop
                else:
                    tally.errors += 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return tally


def service(base_url: str, concurrency: int, duration_s: float) -> Tally:
    return asyncio.run(_service_clients(base_url, concurrency, duration_s))


def docker_run_loop(image: str, cpus: float, concurrency: int, duration_s: float, runtime: Runtime = RUNC) -> Tally:
    tally = Tally(concurrency, duration_s)
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def one_loop() -> None:
        while time.monotonic() < end:
            done = subprocess.run(
                docker_run_argv(image, cpus, runtime), capture_output=True, text=True, timeout=300, check=False
            )
            ok = done.returncode == 0 and done.stdout == EXPECTED_STDOUT
            with lock:
                if time.monotonic() > end:
                    tally.unfinished += 1
                elif ok:
                    tally.completed += 1
                else:
                    tally.errors += 1

    threads = [threading.Thread(target=one_loop, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally
