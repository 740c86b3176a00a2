"""`GET /metrics` in Prometheus format, and JSON log lines."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServiceFactory
from tests.test_cli import free_port, serving

NAMES = {
    "metaagent_executions",
    "metaagent_execution_duration_seconds",
    "metaagent_executions_running",
    "metaagent_executions_queued",
    "metaagent_pool_containers",
    "metaagent_pool_target",
    "metaagent_egress_blocked",
    "metaagent_engine_errors",
    "metaagent_tunnel_operations",
    "metaagent_tunnel_waits",
    "metaagent_tunnel_refusals",
    "metaagent_tunnel_bytes",
    "metaagent_tunnel_execution_operations",
    "metaagent_tunnels_open",
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_lists_every_metric_in_prometheus_format(service: ServiceFactory) -> None:
    async with service() as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    families = {family.name for family in text_string_to_metric_families(response.text)}
    assert families >= NAMES
    assert "process_resident_memory_bytes" in response.text
    # A pool's crash-at-start count is there, at its language, before its first crash.
    assert ("metaagent_pool_start_retries_total", (("language", "javascript"),)) in samples(response.text)


async def test_blocked_egress_is_counted_by_tool(service: ServiceFactory) -> None:
    key = ("metaagent_egress_blocked_total", (("tool", "http"),))
    async with service(allow_http_hosts='["api.example.com"]') as client:
        before = samples((await client.get("/metrics")).text).get(key, 0.0)
        for url in ("https://evil.example/", "file:///etc/passwd", "https://evil.example/again"):
            assert (await client.post("/tools/http", json={"url": url})).status_code == 400
        after = samples((await client.get("/metrics")).text)[key]
    assert after - before == 3


async def test_engine_errors_are_counted(service: ServiceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{free_port()}")  # nothing listens there
    key = ("metaagent_engine_errors_total", ())
    async with service() as client:
        before = samples((await client.get("/metrics")).text)[key]
        health = (await client.get("/health")).json()
        after = samples((await client.get("/metrics")).text)[key]
    assert health["status"] == "degraded"
    assert health["checks"]["container_engine"]["ok"] is False
    assert after > before


def test_json_log_format_writes_one_json_object_per_line(tmp_path: Path) -> None:
    with serving(tmp_path, METAAGENT_LOG_FORMAT="json") as (base, process):
        assert httpx2.post(f"{base}/tools/http", json={"url": "https://evil.example/x"}).status_code == 400
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]  # every line parses
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    security = [line for line in lines if line["logger"] == "metaagent.security"]
    assert [line["message"] for line in security] == [
        "[SECURITY] Blocked HTTP request to disallowed host: evil.example (GET https://evil.example/x)"
    ]
    assert security[0]["level"] == "warning"
