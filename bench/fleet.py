"""Issue 25's figures: what a forwarded call adds, and what two nodes do next to one, in one run.

Nodes as the tests make them (`tests/fleet_nodes.py`): each a network namespace with its own dockerd and
replica, one Redis for all, all on this one machine, so two nodes share its cores.

- **Forwarded call**: a session lives on node a; in shuffled rounds, `1+1` into it through a (direct)
  and through b (b forwards it to a over the nodes' veths). Each caller keeps its connection.
- **Throughput at concurrency 8**: one-shot `console.log(1)` calls for `duration_s`, first with every
  caller on node a (one node alone; b runs, idle), then with the callers spread over a and b. Twice each,
  interleaved, summed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import docker
import httpx2

from bench.stats import Summary, percentile
from tests.fleet_nodes import Node, fleet_nodes

KEY = "bench-fleet-0123456789abcdef0123"
KEYS = f"bench:{KEY}"


def _timed(client: httpx2.Client, path: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    response = client.post(path, json=body)
    elapsed = (time.perf_counter() - started) * 1000
    response.raise_for_status()
    return elapsed


def forwarded_call(a: Node, b: Node, rounds: int, warmup: int) -> dict[str, Any]:
    with a.client(KEY) as on_a, b.client(KEY) as on_b:
        session_id = on_a.post("/sessions", json={}).json()["session_id"]
        path, body = f"/sessions/{session_id}/execute", {"code": "1+1"}
        for _ in range(warmup):
            _timed(on_a, path, body)
            _timed(on_b, path, body)
        samples: dict[str, list[float]] = {"direct": [], "forwarded": []}
        for _ in range(rounds):
            order = [("direct", on_a), ("forwarded", on_b)]
            random.shuffle(order)
            for name, client in order:
                samples[name].append(_timed(client, path, body))
        on_a.delete(f"/sessions/{session_id}")
    direct, forwarded = (Summary.of(samples[name]) for name in ("direct", "forwarded"))
    return {
        "rounds": rounds,
        "direct": direct.as_dict(),
        "forwarded": forwarded.as_dict(),
        "added_p50_ms": percentile(samples["forwarded"], 0.5) - percentile(samples["direct"], 0.5),
        "samples_ms": samples,
    }


def _calls_per_second(nodes: list[Node], concurrency: int, duration_s: float) -> dict[str, Any]:
    """`concurrency` callers, caller i on nodes[i % len(nodes)], one-shot calls back to back."""
    done: list[int] = [0] * concurrency
    failed: list[int] = [0] * concurrency
    stop_at = time.monotonic() + duration_s

    def caller(i: int) -> None:
        with nodes[i % len(nodes)].client(KEY) as client:
            while time.monotonic() < stop_at:
                answer = client.post("/tools/code-interpreter", json={"code": "console.log(1)"})
                ok = answer.status_code == 200 and answer.json()["stdout"] == "1\n"
                done[i] += ok
                failed[i] += not ok

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    return {"calls": sum(done), "failed": sum(failed), "wall_s": wall}


def throughput(a: Node, b: Node, concurrency: int, duration_s: float, repeats: int) -> dict[str, Any]:
    phases: dict[str, list[dict[str, Any]]] = {"one_node": [], "two_nodes": []}
    for _ in range(repeats):
        phases["one_node"].append(_calls_per_second([a], concurrency, duration_s))
        phases["two_nodes"].append(_calls_per_second([a, b], concurrency, duration_s))
    rate = {
        name: sum(run["calls"] for run in runs) / sum(run["wall_s"] for run in runs) for name, runs in phases.items()
    }
    return {
        "concurrency": concurrency,
        "duration_s": duration_s,
        "one_node_per_second": rate["one_node"],
        "two_nodes_per_second": rate["two_nodes"],
        "ratio": rate["two_nodes"] / rate["one_node"] if rate["one_node"] else None,
        "runs": phases,
    }


def measure(
    client: docker.DockerClient,
    runtimes: list[str],
    rounds: int,
    warmup: int,
    duration_s: float,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    measured: dict[str, Any] = {}
    for runtime in runtimes:
        progress(f"fleet: starting two nodes ({runtime})")
        with fleet_nodes(client, 2, KEYS, METAAGENT_SANDBOX_RUNTIME=runtime) as fleet:
            a, b = fleet.nodes
            call = forwarded_call(a, b, rounds, warmup)
            progress(
                f"fleet ({runtime}): session 1+1 p50 direct {call['direct']['p50']:.2f} ms, "
                f"forwarded {call['forwarded']['p50']:.2f} ms (+{call['added_p50_ms']:.2f} ms)"
            )
            rates = throughput(a, b, 8, duration_s, repeats)
            progress(
                f"fleet ({runtime}): at 8 callers, one node {rates['one_node_per_second']:.2f}/s, "
                f"two nodes {rates['two_nodes_per_second']:.2f}/s ({rates['ratio']:.2f}x)"
            )
            measured[runtime] = {"forwarded_call": call, "throughput": rates}
    return measured
