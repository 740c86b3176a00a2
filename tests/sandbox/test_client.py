"""`metaagent.Client` round-trips the code interpreter and the executions endpoints against the real engine."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import metaagent
from metaagent.errors import ServiceError
from tests.sandbox.conftest import Service

pytestmark = pytest.mark.docker


def test_client_runs_code_in_the_code_interpreter(sandbox_service: Service) -> None:
    with metaagent.Client(sandbox_service.base_url) as client:
        code = "let s = ''; process.stdin.on('data', (d) => (s += d)).on('end', () => console.log(s + 1))"
        result = client.code_interpreter(code, stdin="4", timeout_s=20, memory_mb=128)
    assert result["exit_code"] == 0, result["stderr"]
    assert result["stdout"] == "41\n"
    assert result["execution_id"]


def test_client_lists_gets_and_kills_a_running_execution(sandbox_service: Service) -> None:
    finished: dict[str, Any] = {}

    def run_forever() -> None:
        with metaagent.Client(sandbox_service.base_url) as runner:
            finished.update(runner.code_interpreter("setInterval(() => {}, 1000)", timeout_s=120))

    thread = threading.Thread(target=run_forever, daemon=True)
    thread.start()
    with metaagent.Client(sandbox_service.base_url) as client:
        deadline = time.monotonic() + 60
        running: list[dict[str, Any]] = []
        while not running:
            assert time.monotonic() < deadline, "the execution never showed up in GET /executions"
            running = [e for e in client.executions()["executions"] if e["timeout_s"] == 120]
            time.sleep(0.1)
        execution_id = running[0]["execution_id"]
        assert client.execution(execution_id)["execution_id"] == execution_id
        assert client.kill_execution(execution_id) == {"execution_id": execution_id, "killed": True}
        thread.join(60)
        assert not thread.is_alive()
        with pytest.raises(ServiceError) as gone:
            client.execution(execution_id)
    assert gone.value.status_code == 404
    assert finished["execution_id"] == execution_id
    assert finished["timed_out"] is False
