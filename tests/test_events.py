"""`metaagent.api.events`: the event stream of any call that takes an output sink, over real HTTP.

The calls here are small async functions standing in for an execution (or a session call): the
response, its framing, its disconnect handling and its bound are the real ones, served by uvicorn.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import httpx2
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import Response

from metaagent.api import events as events_module
from metaagent.api.errors import install_error_handlers
from metaagent.api.events import DROPPED_MESSAGE, OutputEvents, event_stream, wants_event_stream
from metaagent.errors import AtCapacity, Unavailable
from metaagent.sandbox.output import OutputSink, SinkCall
from tests.live_service import serving

SSE = {"Accept": "text/event-stream"}
WAIT_S = 30  # a bound on waiting for the other thread, never a speed check


class Answer(BaseModel):
    stdout: str
    exit_code: int | None
    note: str = "ünïcode"


@pytest.mark.parametrize(
    ("accept", "streams"),
    [
        ("text/event-stream", True),
        ("text/event-stream, */*;q=0.1", True),
        ("application/json;q=0.5, text/event-stream", True),
        ("application/json, text/event-stream", False),  # a tie goes to JSON, the default
        ("application/json", False),
        ("*/*", False),
        ("", False),
        ("text/event-stream;q=0", False),
        ("text/event-stream;q=nonsense", False),
    ],
)
def test_the_stream_is_chosen_only_when_accept_prefers_it(accept: str, streams: bool) -> None:
    assert wants_event_stream(accept) is streams


async def test_waiting_pieces_of_one_stream_go_out_as_one_event_in_order() -> None:
    events = OutputEvents()
    for stream, text in [("stdout", "a"), ("stdout", "b"), ("stderr", "c"), ("stdout", "d")]:
        events.output(stream, text)  # type: ignore[arg-type]  # literal strings of the Stream type
    events.close()
    assert [await events.next() for _ in range(4)] == [("stdout", "ab"), ("stderr", "c"), ("stdout", "d"), None]


async def test_past_the_bound_output_is_dropped_and_said_once() -> None:
    events = OutputEvents(max_pending=4)
    events.output("stdout", "abc")
    events.output("stdout", "de")  # 3 waiting, within the bound: taken
    events.output("stderr", "f")  # 5 waiting: past the bound, dropped from here on
    events.output("stdout", "g")
    assert await events.next() == ("stdout", "abcde")
    events.output("stdout", "h")  # caught up, but the stream has a gap now: output stays off
    events.close()
    assert await events.next() == (None, "")
    assert await events.next() is None
    assert events.pending == 0


@contextmanager
def app_with(call: SinkCall) -> Iterator[str]:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/run")
    async def run() -> Response:
        return event_stream(call)

    with serving(app) as url:
        yield f"{url}/run"


def read_events(response: httpx2.Response) -> list[tuple[str, object]]:
    return [(sse.event, sse.json()) for sse in httpx2.EventSource(response)]


def test_output_then_exactly_one_result_which_is_the_models_json() -> None:
    async def call(sink: OutputSink) -> Answer:
        sink.started()
        sink.output("stdout", "1\n")
        sink.output("stderr", "warn\n")
        return Answer(stdout="1\n", exit_code=0)

    with app_with(call) as url, httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = read_events(response)
    assert received == [
        ("stdout", {"text": "1\n"}),
        ("stderr", {"text": "warn\n"}),
        ("result", {"stdout": "1\n", "exit_code": 0, "note": "ünïcode"}),
    ]


@pytest.mark.parametrize(
    ("refusal", "status"),
    [(AtCapacity("At capacity; retry shortly", retry_after_s=2), 429), (Unavailable("no engine"), 503)],
)
def test_a_refusal_before_the_start_keeps_its_status_and_json_body(refusal: Exception, status: int) -> None:
    async def call(_sink: OutputSink) -> Answer:
        raise refusal

    with app_with(call) as url:
        response = httpx2.post(url, headers=SSE, timeout=WAIT_S)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"] == str(refusal)
    assert ("retry-after" in response.headers) is (status == 429)


def test_a_failure_after_the_start_is_one_error_event_that_ends_the_stream() -> None:
    async def call(sink: OutputSink) -> Answer:
        sink.started()
        sink.output("stdout", "partial")
        raise Unavailable("The container engine went away; retry shortly")

    with app_with(call) as url, httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
        assert response.status_code == 200
        received = read_events(response)
    assert received == [
        ("stdout", {"text": "partial"}),
        ("error", {"error": "The container engine went away; retry shortly", "status": 503}),
    ]


def test_an_unexpected_failure_after_the_start_says_internal_error_and_keeps_the_details_back() -> None:
    async def call(sink: OutputSink) -> Answer:
        sink.started()
        raise RuntimeError("secret internals")

    with app_with(call) as url, httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
        received = read_events(response)
    assert received == [("error", {"error": "Internal error; the service log has the details", "status": 500})]


def test_a_call_that_ends_without_starting_still_streams_its_output_and_result() -> None:
    async def call(sink: OutputSink) -> Answer:
        sink.output("stderr", "runner failed to start\n")
        return Answer(stdout="", exit_code=1)

    with app_with(call) as url, httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
        received = read_events(response)
    assert [name for name, _ in received] == ["stderr", "result"]


def test_a_silence_gets_a_keep_alive_comment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_module, "KEEPALIVE_S", 0.05)
    comment_seen = threading.Event()

    async def call(sink: OutputSink) -> Answer:
        sink.started()
        # Silent until the client has seen a keep-alive comment.
        assert await anyio.to_thread.run_sync(comment_seen.wait, WAIT_S)
        return Answer(stdout="", exit_code=0)

    lines: list[str] = []
    with app_with(call) as url, httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith(":"):
                comment_seen.set()
    assert lines[0].startswith(":")  # before any event
    assert "event: result" in lines


def test_a_client_that_disconnects_cancels_the_call() -> None:
    cancelled = threading.Event()

    async def call(sink: OutputSink) -> Answer:
        sink.started()
        try:
            while True:
                sink.output("stdout", "tick\n")
                await anyio.sleep(0.05)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise

    with app_with(call) as url:
        with httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
            first = next(iter(httpx2.EventSource(response)))
        assert (first.event, json.loads(first.data)) == ("stdout", {"text": "tick\n"})
        assert cancelled.wait(WAIT_S)


def test_a_client_that_leaves_a_silent_stream_cancels_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_module, "KEEPALIVE_S", 3600)  # no send could notice the hang-up: the watch must
    cancelled = threading.Event()

    async def call(sink: OutputSink) -> Answer:
        sink.started()
        sink.output("stdout", "then silence\n")
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    with app_with(call) as url:
        with httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
            events = iter(httpx2.EventSource(response))
            assert next(events).data == '{"text":"then silence\\n"}'
        assert cancelled.wait(WAIT_S)


def test_a_client_that_disconnects_before_the_start_cancels_the_waiting_call() -> None:
    waiting, cancelled = threading.Event(), threading.Event()

    async def call(_sink: OutputSink) -> Answer:
        waiting.set()
        try:
            await anyio.sleep_forever()  # queued, say, for a slot that never frees
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    with app_with(call) as url:
        host, port = httpx2.URL(url).host, httpx2.URL(url).port
        with socket.create_connection((host, port), timeout=WAIT_S) as sock:
            sock.sendall(
                f"POST /run HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\nContent-Length: 0\r\n\r\n".encode()
            )
            assert waiting.wait(WAIT_S)
        assert cancelled.wait(WAIT_S)


def test_the_dropped_notice_is_an_event_of_its_own_between_the_output_and_the_result() -> None:
    async def call(sink: OutputSink) -> Answer:
        sink.started()
        for _ in range(events_module.MAX_PENDING_CHARS // 1000 + 2):  # no await: the client cannot keep up
            sink.output("stdout", "x" * 1000)
        return Answer(stdout="x" * 1000, exit_code=0)

    with app_with(call) as url, httpx2.stream("POST", url, headers=SSE, timeout=WAIT_S) as response:
        received = read_events(response)
    assert [name for name, _ in received] == ["stdout", "dropped", "result"]
    assert received[1][1] == {"message": DROPPED_MESSAGE}
