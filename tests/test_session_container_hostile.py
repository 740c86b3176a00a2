"""The service against a hostile session container: a stand-in for a subverted supervisor writes each
kind of bad or costly frame into a real socket, and the session's reader must end only that session,
at a bounded cost, while the event loop stays free for every other caller (issue 22, item 1)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest

from metaagent.executions import Execution
from metaagent.sandbox import session_container
from metaagent.sandbox import session_wire as wire
from metaagent.sandbox.engine import ContainerState, Engine
from metaagent.sandbox.execute import STDOUT_CAP, Prepared
from metaagent.sandbox.output import Demultiplexer
from metaagent.sandbox.session_container import SessionContainer
from metaagent.sandbox.wire_socket import WireListener
from metaagent.sessions.service import _checked_listing

pytestmark = [pytest.mark.security]


class FakeEngine:
    """The engine calls a session container makes, for a 'container' that is a socket's other end."""

    def __init__(self) -> None:
        self.killed = anyio.Event()
        self.signals: list[str] = []

    async def wait(self, container_id: str) -> int:
        await self.killed.wait()
        return 137

    async def state(self, container_id: str) -> ContainerState:
        return ContainerState(137, False)

    async def kill(self, container_id: str, signal: str) -> None:
        self.signals.append(signal)
        if signal == "SIGKILL":
            self.killed.set()

    async def remove(self, container_id: str) -> None:
        return None


def muxed(payload: bytes) -> bytes:
    """Bytes as the engine's attach stream carries the container's stdout."""
    return struct.pack(">BxxxI", 1, len(payload)) + payload


def frame(kind: bytes, payload: bytes) -> bytes:
    return wire.HEADER.pack(kind, len(payload)) + payload


READY = frame(wire.REPLY, b'{"id": 0, "status": "ready"}')


def hostile_writer(container_end: socket.socket, chunks: Callable[[], Iterator[bytes]]) -> threading.Thread:
    def write() -> None:
        try:
            container_end.sendall(muxed(READY))
            for chunk in chunks():
                container_end.sendall(muxed(chunk))
        except OSError:
            return  # the service hung up: the session is over

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


class CountedPrepared(Prepared):
    """Counts the reads of the stream, each at most 64 KiB."""

    reads = 0

    async def read_some(self) -> bool:
        self.reads += 1
        return await super().read_some()


@dataclass
class Turns:
    reads: int  # the reader's reads of the stream
    ticks: int  # the turns another task got meanwhile


async def run_against(
    service_end: socket.socket, engine: FakeEngine, during: Callable[[SessionContainer], Any] | None = None
) -> tuple[SessionContainer, Turns]:
    """Runs a session on the socket until it ends; returns it, and how many turns another task of the
    event loop got against the reads of the hostile stream (no clock involved)."""
    prepared = CountedPrepared("c0ffee", service_end, Demultiplexer(STDOUT_CAP, 25 * 1024), True, 0.5, True)
    container = SessionContainer(cast(Engine, engine), prepared, grace_s=1, file_timeout_s=5)
    ticks = 0
    ready = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.lowlevel.checkpoint()
            ticks += 1

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(ticker)
            group.start_soon(run_until_it_ends, container, ready)
            if during is not None:
                await ready.wait()
                await during(container)
            await container.ended.wait()
            group.cancel_scope.cancel()
    return container, Turns(prepared.reads, ticks)


async def run_until_it_ends(container: SessionContainer, ready: anyio.Event) -> None:
    """`run`, which raises SessionGone when the stream broke before the runner's ready reply was read
    (the writer's ready and its garbage can come in one read): ended either way."""
    with contextlib.suppress(session_container.SessionGone):
        await container.run(b"", on_ready=ready.set)


def repeated(piece: bytes, total: int) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        block = piece * max(1, 65536 // len(piece))
        for _ in range(max(1, total // len(block))):
            yield block

    return chunks


@pytest.mark.parametrize(
    ("name", "chunks"),
    [
        ("millions of empty output frames", repeated(frame(wire.STDOUT, b""), 50_000_000)),
        ("output past the window's cap in one-byte frames", repeated(frame(wire.STDOUT, b"x"), 50_000_000)),
        ("stderr past the window's cap", repeated(frame(wire.STDERR, b"y" * 1000), 50_000_000)),
        ("a frame of 4 GiB", lambda: iter([wire.HEADER.pack(wire.STDOUT, 0xFFFFFFFF)])),
        ("a frame of an unknown type", lambda: iter([frame(b"Q", b"{}")])),
        ("a reply that is not JSON", lambda: iter([frame(wire.REPLY, b"{not json")])),
        ("file bytes with no download", lambda: iter([frame(wire.DATA, b"data")])),
    ],
)
async def test_a_hostile_stream_ends_its_own_session_and_never_holds_the_event_loop(
    pair: tuple[socket.socket, socket.socket], name: str, chunks: Callable[[], Iterator[bytes]]
) -> None:
    service_end, container_end = pair
    engine = FakeEngine()
    writer = hostile_writer(container_end, chunks)
    container, turns = await run_against(service_end, engine)
    assert engine.signals == ["SIGKILL"], name  # the container is killed: its session ends
    assert container.end_reason == "killed"
    # The loop is never held: another task gets a turn between any two reads (each at most 64 KiB, so a
    # bounded slice of work), and the session ends after a bounded number of them (a window's caps of
    # one-byte frames at most: 75 KiB of 6-byte frames is about 7 reads).
    assert turns.ticks >= turns.reads - 1, (name, turns)
    assert turns.reads <= 16, (name, turns)
    container_end.close()
    writer.join(timeout=10)


async def test_output_within_the_caps_is_kept_and_a_flood_past_them_ends_only_that_session(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    service_end, container_end = pair
    engine = FakeEngine()
    within = frame(wire.STDOUT, b"a" * 1024) * (STDOUT_CAP // 1024)
    writer = hostile_writer(container_end, lambda: iter([within, frame(wire.STDOUT, b"b")]))
    container, _turns = await run_against(service_end, engine)
    assert container.end_reason == "killed"
    writer.join(timeout=10)


async def test_skipped_counts_in_an_answer_reach_the_calls_truncation_marker(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    service_end, container_end = pair
    engine = FakeEngine()
    answered = threading.Event()

    def chunks() -> Iterator[bytes]:
        request = b""
        while wire.EXECUTE not in request:  # wait for the call's request before answering it
            request += container_end.recv(65536)
        yield frame(wire.STDOUT, b"z" * 100)
        yield frame(wire.REPLY, b'{"id": 2, "status": "ok", "stdout_skipped": 999900, "stderr_skipped": 0}')
        answered.set()

    writer = hostile_writer(container_end, chunks)

    async def call(container: SessionContainer) -> None:
        outcome = await container.call("1", 5, Execution("exe_1", 5, 256))
        assert outcome.status == "ok"
        assert outcome.stdout.produced == 1_000_000
        assert outcome.stdout.truncated is True  # 100 kept, the rest counted where it was dropped
        assert "[output truncated: 1000000 bytes produced, the first 100 shown]" in outcome.stdout.text()
        engine.killed.set()

    await run_against(service_end, engine, during=call)
    assert answered.is_set()
    writer.join(timeout=10)


@pytest.mark.parametrize(
    "entry",
    [
        {"path": "../../etc/passwd", "size": 1, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "/etc/passwd", "size": 1, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "a/./b", "size": 1, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "a\x01b", "size": 1, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "\ud800", "size": 1, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "ok.txt", "size": -1, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "ok.txt", "size": True, "modified_at": "2026-01-01T00:00:00Z"},
        {"path": "ok.txt", "size": 1, "modified_at": "yesterday"},
        {"path": "ok.txt", "size": 1, "modified_at": "2026-01-01T00:00:00Z", "extra": 1},
        "ok.txt",
    ],
)
def test_a_listing_entry_that_breaks_the_rules_is_refused_whole(entry: Any) -> None:
    good = {"path": "fine.txt", "size": 1, "modified_at": "2026-01-01T00:00:00Z"}
    with pytest.raises(ValueError, match=r"."):
        _checked_listing({"files": [good, entry]})


def test_a_listing_of_well_formed_entries_is_believed() -> None:
    entries = [{"path": f"d/{n}.txt", "size": n, "modified_at": "2026-01-01T00:00:00Z"} for n in range(3)]
    assert [f.path for f in _checked_listing({"files": entries})] == ["d/0.txt", "d/1.txt", "d/2.txt"]
    with pytest.raises(ValueError, match="10,000"):
        _checked_listing({"files": entries * 4000})


def with_a_wire_socket(service_end: socket.socket, folder: Path) -> tuple[FakeEngine, SessionContainer, Path]:
    """A session of container c0ffee on `service_end` whose wire socket is made in `folder` (its path)."""
    engine = FakeEngine()
    listener = WireListener(folder)
    prepared = Prepared("c0ffee", service_end, Demultiplexer(STDOUT_CAP, 25 * 1024), True, 0.5, True)
    container = SessionContainer(cast(Engine, engine), prepared, grace_s=1, file_timeout_s=5, wire_listener=listener)
    return engine, container, folder / listener.path_in_container.rsplit("/", 1)[1]


def connect_once_the_header_came(container_end: socket.socket, path: Path) -> tuple[socket.socket, threading.Thread]:
    """A thread of this process that, once the session's header came on the attach stream, connects to the
    wire socket by its name and says ready there: the stand-in supervisor, or an intruder that knows the name.
    Returns its connection and the thread, started."""
    connection = socket.socket(socket.AF_UNIX)

    def connect() -> None:
        container_end.recv(65536)  # the header, on the attach stream
        connection.connect(str(path))
        connection.sendall(READY)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    return connection, thread


async def test_frames_on_the_attach_stream_once_the_wire_socket_carries_them_end_the_session(
    pair: tuple[socket.socket, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the supervisor is connected to its wire socket, nothing writes the container's stdout: a byte
    there is a broken protocol, not a frame."""
    # The stand-in supervisor is a thread of this process: taken for the container's own (a real container's
    # connection is checked in tests/sandbox/test_container.py).
    monkeypatch.setattr(session_container, "came_from", lambda _connection, _container_id: True)
    service_end, container_end = pair
    engine, container, path = with_a_wire_socket(service_end, tmp_path)
    wire_end, thread = connect_once_the_header_came(container_end, path)
    ready = anyio.Event()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: container.run(b"{}\n", on_ready=ready.set))
            await ready.wait()
            container_end.sendall(muxed(frame(wire.REPLY, b'{"id": 0, "status": "ready"}')))
            await container.ended.wait()
    assert engine.signals == ["SIGKILL"]
    assert container.end_reason == "killed"
    assert not path.exists()
    thread.join(10)
    wire_end.close()


async def test_a_wire_connection_from_outside_the_container_ends_the_session_unserved(
    pair: tuple[socket.socket, socket.socket], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever connects to a session's wire socket first, with its name, and is not in the session's
    container (here: this process, not in container c0ffee), gets nothing: not one request is sent to it,
    the session ends before it is ready, and the service's log says so."""
    service_end, container_end = pair
    engine, container, path = with_a_wire_socket(service_end, tmp_path)
    intruder, thread = connect_once_the_header_came(container_end, path)
    ready = anyio.Event()
    with anyio.fail_after(60), pytest.raises(session_container.SessionGone):
        await container.run(b"{}\n", on_ready=ready.set)
    assert not ready.is_set()
    assert engine.signals == ["SIGKILL"]
    assert container.end_reason == "exited"
    assert not path.exists()
    assert "came from outside it" in caplog.text
    thread.join(10)
    intruder.settimeout(5)
    try:
        sent = intruder.recv(65536)
    except ConnectionResetError:  # closed with its frame unread
        sent = b""
    assert sent == b""  # nothing was sent to it
    intruder.close()


async def test_a_runner_that_exits_before_its_ready_reply_fails_the_open_rather_than_opening(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The container ends before its runner said ready: the session's end settles every request waiting
    for a reply, the ready one too, and that must not read as ready (a 201 answered, then a 410)."""
    service_end, container_end = pair
    engine = FakeEngine()
    prepared = Prepared("c0ffee", service_end, Demultiplexer(STDOUT_CAP, 25 * 1024), True, 0.5, True)
    container = SessionContainer(cast(Engine, engine), prepared, grace_s=1, file_timeout_s=5)
    ready = anyio.Event()

    async def exit_once_the_header_came() -> None:
        await anyio.to_thread.run_sync(container_end.recv, 65536)
        container_end.close()  # the container exits by itself: its stream ends, the engine's wait returns
        engine.killed.set()

    failed: list[session_container.SessionGone] = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(exit_once_the_header_came)
            try:
                await container.run(b"{}\n", on_ready=ready.set)
            except session_container.SessionGone as exc:
                failed.append(exc)
    assert failed, "the open did not fail"
    assert not ready.is_set()
    assert container.end_reason == "exited"
