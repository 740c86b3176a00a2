"""MCP progress of a call's output: coalesced, counted in bytes, the last one before the result."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel

from metaagent.errors import PackageRefused
from metaagent.progress import Report, with_progress
from metaagent.sandbox.output import OutputSink

Sent = list[tuple[float, str]]


class Answer(BaseModel):
    value: str = "done"


def recorder(sent: Sent) -> Report:
    async def report(progress: float, text: str) -> None:
        sent.append((progress, text))

    return report


async def test_pieces_that_come_together_go_out_as_one_notification_before_the_result() -> None:
    sent: Sent = []

    async def call(sink: OutputSink) -> Answer:
        for piece in ["a", "é", "\n"]:
            sink.output("stdout", piece)
        sink.output("stderr", "warn\n")
        return Answer()

    assert await with_progress(call, recorder(sent)) == Answer()
    assert sent == [(9.0, "aé\nwarn\n")]  # bytes, not characters: é is two


async def test_progress_counts_every_byte_sent_so_far_and_grows_with_each_notification() -> None:
    send, receive = anyio.create_memory_object_stream[tuple[float, str]](10)
    sent: Sent = []

    async def report(progress: float, text: str) -> None:
        await send.send((progress, text))

    async def call(sink: OutputSink) -> Answer:
        for n in range(5):
            sink.output("stdout", f"{n}\n")
            with anyio.fail_after(10):  # each piece waits for its notification before the next comes
                sent.append(await receive.receive())
        return Answer()

    async with send, receive:
        await with_progress(call, report, interval_s=0.01)
    assert [text for _, text in sent] == ["0\n", "1\n", "2\n", "3\n", "4\n"]
    assert [progress for progress, _ in sent] == [2.0, 4.0, 6.0, 8.0, 10.0]


async def test_pieces_that_come_within_the_interval_wait_and_go_out_together() -> None:
    sent: Sent = []
    first_sent = anyio.Event()

    async def report(progress: float, text: str) -> None:
        sent.append((progress, text))
        first_sent.set()

    async def call(sink: OutputSink) -> Answer:
        sink.output("stdout", "first\n")
        with anyio.fail_after(10):
            await first_sent.wait()
        for n in range(50):  # all within the interval (an hour): none may go out on its own
            sink.output("stdout", f"{n}\n")
            await anyio.lowlevel.checkpoint()  # the reporter runs between the pieces
        return Answer()

    await with_progress(call, report, interval_s=3600)
    assert sent == [(6.0, "first\n"), (6.0 + 140, "".join(f"{n}\n" for n in range(50)))]


async def test_no_output_sends_no_notification() -> None:
    sent: Sent = []

    async def call(_sink: OutputSink) -> Answer:
        return Answer()

    await with_progress(call, recorder(sent))
    assert sent == []


async def test_a_failure_of_the_call_is_raised_as_itself_after_its_output_went_out() -> None:
    sent: Sent = []

    async def call(sink: OutputSink) -> Answer:
        sink.output("stderr", "about to fail\n")
        raise PackageRefused("Package not on the allow-list")

    with pytest.raises(PackageRefused, match="allow-list"):  # not an exception group: MCP says the message
        await with_progress(call, recorder(sent))
    assert sent == [(14.0, "about to fail\n")]


async def test_a_notification_that_cannot_be_sent_stops_the_reporting_not_the_call() -> None:
    attempts: list[str] = []
    tried = anyio.Event()

    async def broken(_progress: float, text: str) -> None:
        attempts.append(text)
        tried.set()
        raise ConnectionError("the client went away")

    async def call(sink: OutputSink) -> Answer:
        sink.output("stdout", "first")
        with anyio.fail_after(10):
            await tried.wait()
        sink.output("stdout", "second")
        return Answer()

    assert await with_progress(call, broken, interval_s=0.01) == Answer()
    assert attempts == ["first"]
