"""`metaagent.Client` round-trips the code interpreter and the executions endpoints against the real engine."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

import metaagent
import metaagent.client
from metaagent.client import CodeInterpreterResponse, ExecutionInfo, Finished, KillResult, Output
from metaagent.errors import ServiceError
from tests.sandbox.conftest import Service
from tests.sandbox.test_streaming import running_execution

pytestmark = pytest.mark.docker


def test_client_runs_code_in_the_code_interpreter(sandbox_service: Service) -> None:
    with metaagent.Client(sandbox_service.base_url) as client:
        code = "let s = ''; process.stdin.on('data', (d) => (s += d)).on('end', () => console.log(s + 1))"
        result = client.code_interpreter(code, stdin="4", timeout_s=20, memory_mb=128)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "41\n"
    assert result.execution_id


def test_client_lists_gets_and_kills_a_running_execution(sandbox_service: Service) -> None:
    finished: list[CodeInterpreterResponse] = []

    def run_forever() -> None:
        with metaagent.Client(sandbox_service.base_url) as runner:
            finished.append(runner.code_interpreter("setInterval(() => {}, 1000)", timeout_s=120))

    thread = threading.Thread(target=run_forever, daemon=True)
    thread.start()
    with metaagent.Client(sandbox_service.base_url) as client:
        deadline = time.monotonic() + 60
        running: list[ExecutionInfo] = []
        while not running:
            assert time.monotonic() < deadline, "the execution never showed up in GET /executions"
            running = [e for e in client.executions().executions if e.timeout_s == 120]
            time.sleep(0.1)
        execution_id = running[0].execution_id
        assert client.execution(execution_id).execution_id == execution_id
        assert client.kill_execution(execution_id) == KillResult(execution_id=execution_id, killed=True)
        thread.join(60)
        assert not thread.is_alive()
        with pytest.raises(ServiceError) as gone:
            client.execution(execution_id)
    assert gone.value.status_code == 404
    assert finished[0].execution_id == execution_id
    assert (finished[0].killed, finished[0].timed_out) == (True, False)


def test_client_session_shares_state_and_files_and_closes_on_exit(sandbox_service: Service) -> None:
    with metaagent.Client(sandbox_service.base_url) as client, client.session(idle_timeout_s=60) as session:
        session.execute("const total = (rows) => rows.reduce((a, b) => a + b, 0)")
        assert session.upload("in/numbers.txt", b"1\n2\n3\n").size == 6
        result = session.execute(
            "const fs = require('fs');"
            " const n = fs.readFileSync('in/numbers.txt', 'utf8').trim().split('\\n').map(Number);"
            " fs.writeFileSync('sum.txt', String(total(n))); total(n)"
        )
        assert result.result == "6"
        assert session.download("sum.txt") == b"6"
        assert [f.path for f in session.files()] == ["in/numbers.txt", "sum.txt"]
        session.delete("sum.txt")
        with pytest.raises(ServiceError) as missing:
            session.download("sum.txt")
        assert missing.value.status_code == 404
        session_id = session.id
        assert client.session_record(session_id).executions == 2
    with metaagent.Client(sandbox_service.base_url) as client:
        with pytest.raises(ServiceError) as gone:
            client.session_execute(session_id, "total")
        with pytest.raises(ServiceError) as ended:
            client.session_record(session_id)
    assert gone.value.status_code == ended.value.status_code == 410
    assert ended.value.extra["reason"] == "closed"


def test_a_client_session_reads_its_record_downloads_text_and_closes_itself(sandbox_service: Service) -> None:
    with metaagent.Client(sandbox_service.base_url) as client, client.session() as session:
        session.upload("notes.txt", "grüße\n".encode())
        assert session.download("notes.txt", text=True) == "grüße\n"
        session.execute("1")
        assert session.record().executions == 1
        assert session.close().closed is True
        with pytest.raises(metaagent.client.SessionEnded) as ended:
            session.execute("1")
    assert ended.value.status_code == 410
    assert ended.value.reason == "closed"


async def test_async_client_session_runs_calls_and_moves_files(sandbox_service: Service) -> None:
    async with metaagent.AsyncClient(sandbox_service.base_url) as client, client.session() as session:
        await session.execute("let n = 20")
        assert (await session.execute("n + 1")).result == "21"
        await session.upload("a b/ü.txt", "grüße".encode())
        assert (await session.download("a b/ü.txt")).decode() == "grüße"
        assert await session.download("a b/ü.txt", text=True) == "grüße"
        assert [f.path for f in await session.files()] == ["a b/ü.txt"]
        assert (await session.record()).state == "idle"
        assert (await session.close()).closed is True


def test_a_session_call_streams_its_output_then_finishes_with_the_result(sandbox_service: Service) -> None:
    with metaagent.Client(sandbox_service.base_url) as client, client.session() as session:
        session.execute("let n = 40")
        events = list(session.stream("console.log('one'); console.error('two'); n + 2", timeout_s=10))
        with pytest.raises(ServiceError) as refused:
            list(client.stream_session_execute("ses_unknown", "1"))
    assert events == [Output("stdout", "one\n"), Output("stderr", "two\n"), events[-1]]
    assert isinstance(events[-1], Finished)
    assert events[-1].result.result == "42"
    assert events[-1].result.session_id == session.id
    assert refused.value.status_code == 404


async def test_leaving_a_streamed_session_call_early_interrupts_it_and_the_session_lives_on(
    sandbox_service: Service,
) -> None:
    async with metaagent.AsyncClient(sandbox_service.base_url) as client, client.session() as session:
        await session.execute("let kept = 'state'")
        endless = session.stream(
            "setInterval(() => console.log('tick'), 100); await new Promise(() => {})", timeout_s=61
        )
        async for event in endless:
            assert event == Output("stdout", "tick\n")
            running_execution(sandbox_service, 61)
            break
        await endless.aclose()  # hangs up: the service interrupts the call, long before its 61 s
        for _ in range(300):
            if not any(e.timeout_s == 61 for e in (await client.executions()).executions):
                break
            await anyio.sleep(0.05)
        else:
            raise AssertionError("the call ran on after the client hung up")
        after = await session.execute("kept")
    assert after.result == "'state'"
    assert after.session_ended is False


def test_call_tool_reaches_the_session_tools_by_their_names(sandbox_service: Service) -> None:
    with metaagent.Client(sandbox_service.base_url) as client:
        session_id = client.call_tool("session_create", {})["session_id"]
        ran = client.call_tool("code_interpreter", {"code": "let n = 2; n ** 10", "session_id": session_id})
        assert ran["result"] == "1024"
        closed = client.call_tool("session_close", {"session_id": session_id})
        assert closed == {"session_id": session_id, "closed": True}
