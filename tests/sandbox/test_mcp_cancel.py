"""MCP cancellation: a call the client abandons (it sends `notifications/cancelled`, or aborts the
request's own POST on the 2026 HTTP wire) kills its execution, one-shot or in a session, with the
official SDK's client against the real engine."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from mcp import Client
from mcp.client.stdio import stdio_client

from tests.sandbox.conftest import Service
from tests.test_mcp import stdio_server, text_of

pytestmark = pytest.mark.docker

TIMEOUT_S = 120
SPIN = "for (;;) {}"  # no await, no output: only a kill ends it


def executions(service: Service) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = service.get("/executions").json()["executions"]
    return listed


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60  # a bound on a hang, not a measure: each check is met in well under 1 s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within 60 s"
        time.sleep(0.05)


@asynccontextmanager
async def abandoned_call(client: Client, arguments: dict[str, Any], started: Callable[[], bool]) -> AsyncIterator[None]:
    """Starts `code_interpreter` with `arguments`, waits until `started()`, then abandons the call (the
    caller's scope is cancelled, as an agent loop's timeout does), and yields once it is abandoned."""
    async with anyio.create_task_group() as group:
        group.start_soon(client.call_tool, "code_interpreter", arguments)
        await anyio.to_thread.run_sync(lambda: wait_until(started, "running"))
        group.cancel_scope.cancel()
    yield


async def test_an_abandoned_one_shot_call_over_streamable_http_kills_its_execution_and_leaves_no_container(
    sandbox_service: Service, containers_of: Callable[[str], list[str]]
) -> None:
    arguments = {"code": SPIN, "timeout_s": 71}
    ids: list[str] = []

    def running() -> bool:
        ids[:] = [e["execution_id"] for e in executions(sandbox_service) if e["timeout_s"] == 71]
        return bool(ids) and bool(containers_of(ids[0]))

    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{sandbox_service.base_url}/mcp") as client, abandoned_call(client, arguments, running):
            await anyio.to_thread.run_sync(lambda: wait_until(lambda: not containers_of(ids[0]), "removed"))
            assert all(e["execution_id"] != ids[0] for e in executions(sandbox_service))
            after = await client.call_tool("code_interpreter", {"code": "console.log('still here')"})
    assert after.structured_content is not None
    assert after.structured_content["stdout"] == "still here\n"


async def test_notifications_cancelled_over_stdio_interrupts_a_session_call_and_the_session_lives_on(
    sandbox_service: Service, tmp_path: Path
) -> None:
    # sandbox_service: only so that the image is there; the stdio server is a process of its own.
    # The call is known to run once its first output comes back as progress (a progressToken).
    printed = anyio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        printed.set()

    with (tmp_path / "stderr.log").open("w") as errlog, anyio.fail_after(TIMEOUT_S):
        async with Client(stdio_client(stdio_server(tmp_path), errlog=errlog)) as client:
            created = await client.call_tool("session_create", {})
            assert created.structured_content is not None, text_of(created)
            session_id = created.structured_content["session_id"]
            await client.call_tool("code_interpreter", {"session_id": session_id, "code": "let kept = 'state'"})
            spin = {"session_id": session_id, "code": f"console.log('spinning'); {SPIN}", "timeout_s": 72}
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: client.call_tool("code_interpreter", spin, progress_callback=on_progress))
                await printed.wait()
                group.cancel_scope.cancel()  # the SDK sends notifications/cancelled for the abandoned request
            # Calls to a session run in order: this one runs only once the spinning call was interrupted.
            after = await client.call_tool("code_interpreter", {"session_id": session_id, "code": "kept"})
            closed = await client.call_tool("session_close", {"session_id": session_id})
    assert after.structured_content is not None, text_of(after)
    assert after.structured_content["result"] == "'state'"  # interrupted, not ended: the state is kept
    assert closed.structured_content == {"session_id": session_id, "closed": True}
    calls = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    outcomes = [r["outcome"] for r in calls if r.get("event") == "session.call"]
    assert outcomes[1] == {"status": "error", "error": "cancelled"}  # let kept; the spin; kept
    assert [o["status"] for o in outcomes] == ["completed", "error", "completed"]
