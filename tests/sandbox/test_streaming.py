"""`POST /tools/code-interpreter` with `Accept: text/event-stream`: the real service, the real engine.

Order, not time: a test that must show an event came early kills the program after that event, and
the result then proves the program had not printed its last line yet.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from metaagent.client import AsyncClient, Client, Finished, Output
from metaagent.errors import ServiceError
from tests.sandbox.conftest import Service, audit_record, audit_records, running_service
from tests.sandbox.test_code_interpreter import _rss_kib
from tests.test_cli import serving

pytestmark = pytest.mark.docker

SSE = {"Accept": "text/event-stream"}
PATH = "/tools/code-interpreter"
Event = tuple[str, dict[str, Any]]
# Every execution's own fields: they differ between two runs of one program.
PER_RUN = {"execution_id", "duration_ms", "queued_ms"}


@contextmanager
def open_stream(service: Service, body: dict[str, Any], timeout: float = 120) -> Iterator[Iterator[Event]]:
    """The events of one streamed execution, as they come."""
    with httpx2.stream("POST", f"{service.base_url}{PATH}", json=body, headers=SSE, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield ((sse.event, sse.json()) for sse in httpx2.EventSource(response))


def stream(service: Service, body: dict[str, Any]) -> list[Event]:
    with open_stream(service, body) as events:
        return list(events)


def result_of(events: list[Event]) -> dict[str, Any]:
    """The one result event, which must be the last one."""
    assert [name for name, _ in events].count("result") == 1, events
    name, data = events[-1]
    assert name == "result", events
    return data


def text_of(events: list[Event], stream_name: str) -> str:
    return "".join(data["text"] for name, data in events if name == stream_name)


def running_execution(service: Service, timeout_s: int) -> str:
    """The id of this service's running execution with that (test-unique) timeout."""
    for _ in range(300):
        for execution in service.get("/executions").json()["executions"]:
            if execution["timeout_s"] == timeout_s:
                return str(execution["execution_id"])
        time.sleep(0.05)
    raise AssertionError(f"no running execution with timeout_s={timeout_s}")


def test_the_first_output_event_arrives_before_the_program_prints_its_last_line(sandbox_service: Service) -> None:
    code = """
    let i = 0;
    const timer = setInterval(() => {
      i += 1;
      console.log(i < 100 ? `tick ${i}` : 'LAST LINE');
      if (i === 100) clearInterval(timer);
    }, 300);
    """
    with open_stream(sandbox_service, {"code": code, "timeout_s": 61}) as events:
        first = next(events)
        # Killed once the first event is here: had that event waited for the end, the program would have
        # printed its last line, and the kill would find nothing to kill.
        execution_id = running_execution(sandbox_service, 61)
        killed = httpx2.delete(f"{sandbox_service.base_url}/executions/{execution_id}", timeout=30)
        rest = list(events)
    assert first == ("stdout", {"text": "tick 1\n"})
    assert killed.status_code == 200
    result = result_of([first, *rest])
    assert result["killed"] is True
    assert "LAST LINE" not in result["stdout"]
    assert result["stdout"] == text_of([first, *rest], "stdout")


def test_stdout_and_stderr_each_keep_their_order(sandbox_service: Service) -> None:
    code = """
    const wait = (ms) => new Promise((r) => setTimeout(r, ms));
    (async () => {
      for (let i = 0; i < 6; i++) {
        console.log(`out ${i}`); await wait(20); console.error(`err ${i}`); await wait(20);
      }
    })();
    """
    events = stream(sandbox_service, {"code": code, "timeout_s": 10})
    result = result_of(events)
    assert text_of(events, "stdout") == "".join(f"out {i}\n" for i in range(6)) == result["stdout"]
    assert text_of(events, "stderr") == "".join(f"err {i}\n" for i in range(6)) == result["stderr"]
    assert {name for name, _ in events} == {"stdout", "stderr", "result"}


def test_a_character_written_a_byte_at_a_time_arrives_whole(sandbox_service: Service) -> None:
    # One write per byte, apart in time: each byte is a frame of its own on the attach stream.
    code = """
    const bytes = Buffer.from('€🚀é');
    (async () => {
      for (const b of bytes) { process.stdout.write(Buffer.from([b])); await new Promise((r) => setTimeout(r, 30)); }
    })();
    """
    events = stream(sandbox_service, {"code": code, "timeout_s": 10})
    pieces = [data["text"] for name, data in events if name == "stdout"]
    assert "".join(pieces) == "€🚀é" == result_of(events)["stdout"]
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_flood_stops_at_the_caps_and_only_the_result_says_truncated(sandbox_service: Service) -> None:
    code = """
    const line = 'x'.repeat(1 << 20);
    for (let i = 0; i < 20; i++) process.stdout.write(line);
    for (let i = 0; i < 5; i++) process._rawDebug(line);
    """
    events = stream(sandbox_service, {"code": code, "timeout_s": 30})
    result = result_of(events)
    assert text_of(events, "stdout") == "x" * 51200
    assert text_of(events, "stderr") == "x" * 25600
    assert result["stdout_truncated"] is True
    assert result["stderr_truncated"] is True
    assert result["stdout"] == "x" * 51200 + "\n[output truncated: 20971520 bytes produced, the first 51200 shown]\n"
    assert "truncated" not in text_of(events, "stdout") + text_of(events, "stderr")


def test_the_result_event_is_the_buffered_body_field_by_field(sandbox_service: Service) -> None:
    body = {"code": "console.log('out é'); console.error('err'); process.exitCode = 3", "timeout_s": 10}
    events = stream(sandbox_service, body)
    streamed = result_of(events)
    buffered = sandbox_service.post(PATH, body).json()
    assert streamed.keys() == buffered.keys()
    for field in streamed.keys() - PER_RUN:
        assert streamed[field] == buffered[field], field
    assert streamed["stdout"] == "out é\n" == text_of(events, "stdout")
    assert streamed["stderr"] == "err\n" == text_of(events, "stderr")
    # The per-run fields are this execution's own: the audit record of the same execution agrees.
    outcome = audit_record(sandbox_service, streamed["execution_id"])["outcome"]
    assert (streamed["duration_ms"], streamed["exit_code"]) == (outcome["duration_ms"], outcome["exit_code"])


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"code": ""}, 422),
        ({"code": "1", "timeout_s": 0}, 422),
        ({"code": "1", "packages": ["not-on-the-list"]}, 400),
        ({"code": "1", "network": {"allow": ["elsewhere.example"]}}, 400),
    ],
)
def test_a_refusal_is_plain_json_with_its_usual_status(
    sandbox_service: Service, body: dict[str, Any], status: int
) -> None:
    streamed = httpx2.post(f"{sandbox_service.base_url}{PATH}", json=body, headers=SSE, timeout=60)
    buffered = sandbox_service.post(PATH, body)
    assert streamed.status_code == buffered.status_code == status
    assert streamed.headers["content-type"] == "application/json"
    assert streamed.json() == buffered.json()
    assert streamed.json()["error"]


def test_at_capacity_is_a_plain_429_with_retry_after(docker_client: object, tmp_path: Path) -> None:
    settings = {"METAAGENT_MAX_CONCURRENT_EXECUTIONS": "1", "METAAGENT_EXECUTION_QUEUE_SIZE": "0"}
    with running_service(tmp_path, METAAGENT_POOL_ENABLED="false", **settings) as service:
        body = {"code": "console.log('holding the only slot'); setInterval(() => {}, 1000)", "timeout_s": 60}
        with open_stream(service, body) as events:
            assert next(events) == ("stdout", {"text": "holding the only slot\n"})
            refused = httpx2.post(f"{service.base_url}{PATH}", json={"code": "1"}, headers=SSE, timeout=60)
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/json"
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"].startswith("At capacity")


@pytest.mark.security
def test_a_client_that_disconnects_mid_stream_leaves_no_container(
    sandbox_service: Service, containers_of: Callable[[str], list[str]]
) -> None:
    body = {"code": "for (;;) { console.log('again'); for (let i = 0; i < 1e6; i++); }", "timeout_s": 62}
    with open_stream(sandbox_service, body) as events:
        assert next(events)[0] == "stdout"
        execution_id = running_execution(sandbox_service, 62)
        assert containers_of(execution_id)  # running while the stream is open
    for _ in range(300):  # the service notices the hang-up, kills and removes
        if not containers_of(execution_id):
            break
        time.sleep(0.05)
    assert containers_of(execution_id) == []
    for _ in range(200):  # the record is written once the container is removed, a moment later
        if any(r.get("execution_id") == execution_id for r in audit_records(sandbox_service)):
            break
        time.sleep(0.05)
    assert audit_record(sandbox_service, execution_id)["outcome"] == {"status": "error", "error": "cancelled"}


@pytest.mark.slow
@pytest.mark.security
def test_a_client_that_reads_nothing_for_10_s_while_the_program_floods_costs_the_service_no_memory(
    sandbox_service: Service,
) -> None:
    sandbox_service.post(PATH, {"code": "console.log('warm-up')"})
    before = _rss_kib(sandbox_service.pid)
    code = "const chunk = 'x'.repeat(1 << 16); for (;;) { process.stdout.write(chunk); process._rawDebug(chunk); }"
    peak = before
    with open_stream(sandbox_service, {"code": code, "timeout_s": 10}, timeout=300) as events:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # reading nothing, while the program floods until its timeout
            peak = max(peak, _rss_kib(sandbox_service.pid))
            time.sleep(0.5)
        received = list(events)
    assert peak - before < 64 * 1024  # KiB: a generous bound; unbounded buffering would pass it within seconds
    result = result_of(received)
    assert result["timed_out"] is True
    assert result["stdout_truncated"] is True
    assert result["stderr_truncated"] is True
    names = [name for name, _ in received]
    if "dropped" not in names:  # the socket's buffers held every event: all the capped output is there
        assert text_of(received, "stdout") == "x" * 51200
        assert text_of(received, "stderr") == "x" * 25600


def test_the_python_client_streams_typed_events_and_ends_with_the_result(sandbox_service: Service) -> None:
    code = "console.log('one'); console.error('two'); console.log('three')"
    with Client(sandbox_service.base_url) as client:
        events = list(client.stream_code(code, timeout_s=10))
        with pytest.raises(ServiceError) as refused:
            list(client.stream_code("1", packages=["not-on-the-list"]))
    assert isinstance(events[-1], Finished)
    outputs = [e for e in events if isinstance(e, Output)]
    assert "".join(e.text for e in outputs if e.stream == "stdout") == "one\nthree\n" == events[-1].result.stdout
    assert "".join(e.text for e in outputs if e.stream == "stderr") == "two\n" == events[-1].result.stderr
    assert len(outputs) + 1 == len(events)
    assert refused.value.status_code == 400


async def test_the_async_python_client_streams_and_leaving_early_kills_the_execution(
    sandbox_service: Service, containers_of: Callable[[str], list[str]]
) -> None:
    async with AsyncClient(sandbox_service.base_url) as client:
        events = [event async for event in client.stream_code("console.log(6 * 7)", timeout_s=10)]
        assert events == [Output("stdout", "42\n"), events[-1]]
        assert isinstance(events[-1], Finished)
        assert events[-1].result.exit_code == 0
        endless = client.stream_code("setInterval(() => console.log('tick'), 100)", timeout_s=63)
        async for event in endless:
            assert isinstance(event, Output)  # one tick, or several the stream carried in one piece
            assert (event.stream, set(event.text.splitlines(keepends=True))) == ("stdout", {"tick\n"})
            execution_id = running_execution(sandbox_service, 63)
            break
        await endless.aclose()  # what leaving an `async for` does once the generator is collected
    for _ in range(300):
        if not containers_of(execution_id):
            break
        await anyio.sleep(0.05)
    assert containers_of(execution_id) == []


def test_a_shutdown_signal_ends_a_stream_with_its_killed_result(sandbox_service: Service, tmp_path: Path) -> None:
    # sandbox_service: only so that the image is there; this test needs a service of its own to stop.
    with serving(tmp_path) as (base, process):
        body = {"code": "console.log('running'); setInterval(() => {}, 1000)", "timeout_s": 120}
        with httpx2.stream("POST", f"{base}{PATH}", json=body, headers=SSE, timeout=120) as response:
            events = ((sse.event, sse.json()) for sse in httpx2.EventSource(response))
            assert next(events) == ("stdout", {"text": "running\n"})
            process.send_signal(signal.SIGTERM)
            rest = list(events)
        assert process.wait(timeout=60) == 0
    assert len(rest) == 1
    assert result_of(rest)["killed"] is True
