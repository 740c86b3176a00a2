"""Load: a few hundred concurrent executions against a real service with a small queue.

Each is served correctly (200 with its own output) or refused with 429 and Retry-After; none hangs (the
client's timeout), none is lost (every request has an answer), no container is left, the counters agree,
and the service's memory stays bounded.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import docker
import httpx2
import pytest

from tests.sandbox.conftest import owned_containers
from tests.test_cli import serving

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REQUESTS = 300
CLIENT_TIMEOUT_S = 120
RSS_GROWTH_BOUND_KB = 200 * 1024  # generous: the service itself is about 100 MB


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def counter(text: str, outcome: str) -> float:
    prefix = f'metaagent_executions_total{{outcome="{outcome}"}} '
    return next((float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def fire(base: str) -> list[tuple[int, int, dict[str, str], dict[str, object]]]:
    answers: list[tuple[int, int, dict[str, str], dict[str, object]]] = []
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:

        async def one(n: int) -> None:
            # Every other request at the pool's memory size, so the warm and the cold path are both loaded.
            body = {"code": f"console.log({n} * 2)", "timeout_s": 10, "memory_mb": 256 if n % 2 else 128}
            response = await client.post("/tools/code-interpreter", json=body)
            answers.append((n, response.status_code, dict(response.headers), response.json()))

        async with anyio.create_task_group() as group:
            for n in range(REQUESTS):
                group.start_soon(one, n)
    return answers


def test_hundreds_of_concurrent_executions_are_each_served_or_refused_and_nothing_is_left(
    docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    # The queue is what this test fills, not the one caller's share (METAAGENT_MAX_EXECUTIONS_PER_KEY, 16).
    env = {
        "METAAGENT_MAX_CONCURRENT_EXECUTIONS": "4",
        "METAAGENT_EXECUTION_QUEUE_SIZE": "16",
        "METAAGENT_MAX_EXECUTIONS_PER_KEY": "64",
    }
    with serving(tmp_path, **env) as (base, process):
        warm = httpx2.post(f"{base}/tools/code-interpreter", json={"code": "console.log(1)"}, timeout=60)
        assert warm.status_code == 200, warm.text
        rss_before = rss_kb(process.pid)
        metrics_before = httpx2.get(f"{base}/metrics", timeout=30).text

        answers = anyio.run(fire, base)

        rss_after = rss_kb(process.pid)
        metrics_after = httpx2.get(f"{base}/metrics", timeout=30).text
        assert httpx2.get(f"{base}/executions", timeout=30).json()["executions"] == []
    # After the service's clean stop: not one container of its executions or of its warm pool is left.
    left = owned_containers(docker_client, process.pid)
    assert process.returncode == 0

    assert sorted(n for n, *_ in answers) == list(range(REQUESTS))  # every request got an answer
    served = [(n, body) for n, status, _, body in answers if status == 200]
    refused = [(headers, body) for _, status, headers, body in answers if status == 429]
    assert len(served) + len(refused) == REQUESTS, {status for _, status, _, _ in answers}
    assert served, "no execution was served"
    for n, body in served:
        assert body["stdout"] == f"{n * 2}\n"
        assert body["exit_code"] == 0
    for headers, body in refused:
        assert int(headers["retry-after"]) > 0
        assert str(body["error"]).startswith("At capacity")
    assert counter(metrics_after, "completed") - counter(metrics_before, "completed") == len(served)
    assert counter(metrics_after, "rejected") - counter(metrics_before, "rejected") == len(refused)
    assert left == []
    assert rss_after - rss_before < RSS_GROWTH_BOUND_KB, (rss_before, rss_after)
