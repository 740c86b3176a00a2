"""A session's container, seen from the service: its supervisor's frames in, requests out.

The session's header goes on the attach stream; then the supervisor connects to the session's wire
socket (wire_socket.py), and the frames (session_wire.py) go both ways there. One reader task per
stream reads it for the session's whole life (`run`): the wire's frames, and the attach stream's
stderr, the supervisor's own raw writes to fd 2 (a byte on its stdout breaks the protocol). Output goes
to the call that runs, or, between calls (a timer of an earlier call), to the next call: an output
window runs from one call's answer to the next's, and holds at most what the caps keep (the supervisor
forwards no more, and counts the rest in the next answer), so a flood costs the service at most one
window per call. Replies wake the request that waits for them; a download's bytes go to its consumer
through a bounded stream, so a slow client slows the supervisor rather than the service's memory.

Calls and file requests are made one at a time (the session service serialises them). A call that does
not end at its deadline, or that is killed, is interrupted (an `i` frame: the supervisor sends SIGINT
to the program); if it does not answer within the grace period the container is killed and the
session ends.

A kill never waits on a caller: before the engine is asked, the session's download is cut (its bytes are
dropped as they come, and its response is ended, see `Download.cut`) and the service's side of the attach
stream and of the wire is shut, so the engine can finish the container whatever a client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from metaagent.errors import sole_error
from metaagent.executions import Execution
from metaagent.latch import Latch, first_of
from metaagent.sandbox import session_wire as wire
from metaagent.sandbox.engine import Engine, EngineUnavailable, sock_recv, sock_sendall
from metaagent.sandbox.execute import STDERR_CAP, STDOUT_CAP, Prepared
from metaagent.sandbox.figures import NO_FIGURES, Figures, checked_figures
from metaagent.sandbox.output import CappedBuffer, OutputListener, OutputSink, Stream
from metaagent.sandbox.wire_socket import WireListener, came_from

log = logging.getLogger("metaagent.session")

READY_TIMEOUT_S = 30.0
_DOWNLOAD_BUFFER_FRAMES = 2  # frames of wire.CHUNK (1 MiB) held between the runner and a download's client
MAX_LISTED = 10_000  # the most files a listing holds, as runner/supervisor.js
_WINDOW_CAP: dict[Stream, int] = {"stdout": STDOUT_CAP, "stderr": STDERR_CAP}  # as runner/supervisor.js


class SessionGone(Exception):
    """The session's process or container ended; `reason` says how (exited, oom, timeout, killed...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FileRefused(Exception):
    """The runner refused a file request: `kind` is bad_path, not_found, is_folder, not_a_folder, full."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class CallOutput:
    """A call's capped output (the same caps as a one-shot run), passed on to a listener as it comes."""

    def __init__(self) -> None:
        self.stdout = CappedBuffer(STDOUT_CAP, "stdout")
        self.stderr = CappedBuffer(STDERR_CAP, "stderr")

    def add(self, stream: Stream, data: bytes) -> None:
        (self.stdout if stream == "stdout" else self.stderr).add(data)

    def listen(self, listener: OutputListener | None) -> None:
        """From now on (after what came before: output between calls belongs to the next call)."""
        self.stdout.listen(listener)
        self.stderr.listen(listener)

    def finish(self) -> None:
        self.stdout.finish()
        self.stderr.finish()


@dataclass(frozen=True)
class CallOutcome:
    status: str  # ok, threw, interrupted, ended
    stdout: CappedBuffer
    stderr: CappedBuffer
    duration_ms: int
    result: str | None = None
    result_bytes: int = 0
    result_incomplete: bool = False  # the runner says the result is not the whole value, though it fits
    thrown: object = None  # what the call threw, as the container describes it: unchecked (the service checks it)
    figures: Figures = NO_FIGURES  # the figures the call showed (checked)
    timed_out: bool = False
    killed: bool = False
    ended: str | None = None  # the session's end reason, when the call ended it
    exit_code: int | None = None  # the process's own code, when the call ended it
    oom_killed: bool = False


@dataclass(frozen=True)
class Download:
    size: int
    modified_at: str
    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]  # stops taking the bytes (the rest are dropped as they come)
    # Set when the session ends or is being killed: whoever sends the bytes on stops now, wherever it
    # waits (a client that does not read), since nothing more will come.
    cut: anyio.Event


class _Pending:
    def __init__(self) -> None:
        self.done = Latch()
        self.message: dict[str, Any] = {}
        self.listed: list[Any] = []  # the pieces of a listing that came so far (`more: true`)

    def settle(self, message: dict[str, Any]) -> None:
        self.message = message
        self.done.set()


class _DownloadStream:
    def __init__(self, request_id: int) -> None:
        self.id = request_id
        self.begun = Latch()
        self.size = 0
        self.modified_at = ""
        self.received = 0
        self.send: MemoryObjectSendStream[bytes | None]
        self.receive: MemoryObjectReceiveStream[bytes | None]
        self.send, self.receive = anyio.create_memory_object_stream[bytes | None](_DOWNLOAD_BUFFER_FRAMES)
        self.abandoned = False
        self.cut = anyio.Event()
        self.finished = Latch()  # the file's last frame came: the wire carries no more of it

    def end(self) -> None:
        """No more bytes: the reader drops what comes (a send it waits in returns at once) and the
        consumer's response is ended."""
        self.abandoned = True
        self.send.close()
        self.cut.set()
        self.finished.set()


class SessionContainer:
    def __init__(
        self,
        engine: Engine,
        prepared: Prepared,
        *,
        grace_s: float,
        file_timeout_s: float,
        out_of_memory_message: str | None = None,
        wire_listener: WireListener | None = None,
    ) -> None:
        """`out_of_memory_message`: the language's heap-exhausted line (`Language.out_of_memory_message`);
        a process that ends after writing it on stderr ended out of memory. `wire_listener`: the socket the
        supervisor connects to once it has its header (wire_socket.py); without one, the frames go on the
        attach stream both ways."""
        self.engine = engine
        self.prepared = prepared
        self._listener = wire_listener
        self._wire = prepared.sock  # where the frames go both ways: the attach stream until `_take_wire`
        self.grace_s = grace_s
        self.out_of_memory_message = out_of_memory_message
        # A file request the runner does not begin to answer in this time (its event loop is blocked by
        # the program) ends the session.
        self.file_timeout_s = file_timeout_s
        self.container_id = prepared.container_id
        self.ended = Latch()
        self.end_reason: str | None = None
        self.exit_code: int | None = None
        self.oom_killed = False
        self._decoder = wire.FrameDecoder()
        self._output = CallOutput()  # between calls: kept for the next call
        self._window = {"stdout": 0, "stderr": 0}  # the framed output bytes of this output window
        self._pending: dict[int, _Pending] = {}
        self._call_id: int | None = None  # the call whose output comes now
        self._download: _DownloadStream | None = None
        self._last_download: _DownloadStream | None = None  # its response may still be sending what it has
        self._next_id = 1
        self._exited = anyio.Event()
        self._drained = anyio.Event()  # the reader took the last bytes of the stream
        self._raw_stderr = _RawStderr(self)
        self._killed: anyio.Event | None = None  # set once a kill has done all it can (see `kill`)
        self.removed = anyio.Event()  # the engine confirmed the container's removal
        prepared.output.redirect(self._decoder, self._raw_stderr)

    # --- the session's life ---

    async def run(self, header: bytes, *, on_ready: Callable[[], None]) -> None:
        """Sends the session header, waits for the runner's ready reply (then calls `on_ready`), and reads
        the stream until the session ends. Raises SessionGone if the runner does not become ready."""
        ready = self._expect(0)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_exit)
                group.start_soon(self._read)
                await self._send(header)
                with anyio.move_on_after(READY_TIMEOUT_S):
                    if self._listener is not None and await self._take_wire():
                        group.start_soon(self._read_wire)
                    await first_of(ready.done, self.ended)
                if not ready.message:  # `_end` settles every request, this one too: only the runner's reply is ready
                    if not self.ended.is_set():
                        await self.kill("exited")
                    raise SessionGone(self.end_reason or "exited")
                on_ready()
                await self.ended.wait()
                group.cancel_scope.cancel()
        except BaseExceptionGroup as group_error:
            raise sole_error(group_error) from None
        finally:
            if not self.ended.is_set():  # a failure in the reader or the exit watch: the session ends too
                self._end("killed")
            if self._listener is not None:
                self._listener.close()
            for sock in {self.prepared.sock, self._wire}:
                _forget_descriptor(sock)
                sock.close()
            with anyio.CancelScope(shield=True):
                await self.remove()

    async def remove(self) -> bool:
        """Removes the container (once the session ended); False when the engine did not confirm it (the
        session service retries)."""
        try:
            await self.engine.remove(self.container_id)
        except EngineUnavailable as exc:
            log.warning("session container %s was not removed: %s", self.container_id[:12], exc.message)
            return False
        self.removed.set()
        return True

    async def kill(self, reason: str) -> None:
        """Ends the session now: its download is cut, the container killed (and removed once the reader
        stops). One kill at a time: a second caller waits for the first one's. If the engine does not
        confirm the kill within its deadline the session still ends here; `run`'s removal (`force`) and
        the session service's retries of it finish the container."""
        if self.end_reason is None:
            self.end_reason = reason
        self._cut_download()
        with anyio.CancelScope(shield=True):
            if self._killed is not None:
                await self._killed.wait()
                return
            self._killed = anyio.Event()
            # Our side of the attach stream and of the wire's socket closes first: nothing more is read
            # (the readers see their end at once, instead of parsing what the runner still sends), and the
            # engine, whose copy to us now fails, finishes the container without waiting for anyone to read it.
            for sock in {self.prepared.sock, self._wire}:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            try:
                await self.engine.kill(self.container_id, "SIGKILL")
            except EngineUnavailable as exc:
                log.warning("session container %s: the kill was not confirmed: %s", self.container_id[:12], exc.message)
            else:
                with anyio.move_on_after(30):
                    await self._exited.wait()
            finally:
                self._end(reason)
                self._killed.set()

    def _cut_download(self) -> None:
        if self._download is not None:
            self._download.end()
        if self._last_download is not None:
            self._last_download.cut.set()

    def _end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        self._cut_download()
        for pending in self._pending.values():
            pending.done.set()
        self.ended.set()

    async def _watch_exit(self) -> None:
        status = await self.engine.wait(self.container_id)
        state = await self.engine.state(self.container_id)
        self.exit_code = status
        with anyio.move_on_after(5):  # what the process wrote last (V8's heap message) is still in flight
            await self._drained.wait()
        message = self.out_of_memory_message
        heap = message is not None and message in self._output.stderr.text()
        self.oom_killed = state.oom_killed or heap
        self._exited.set()
        self._end("oom" if self.oom_killed else "exited")

    async def _take_wire(self) -> bool:
        """Takes the supervisor's connection to the wire's socket (or none, if the session ends first): from
        then on the frames go both ways on it, and the attach stream carries the supervisor's fd 2 alone."""
        listener = self._listener
        if listener is None:
            return False
        taken: socket.socket | None = None
        try:
            async with anyio.create_task_group() as group:

                async def stop_at_the_end() -> None:
                    await self.ended.wait()
                    group.cancel_scope.cancel()

                group.start_soon(stop_at_the_end)
                taken = await listener.accept()
                group.cancel_scope.cancel()
        except BaseException:  # the ready deadline, just after the connection was taken
            if taken is not None:
                taken.close()
            raise
        if taken is None:
            return False
        if not came_from(taken, self.prepared.container_id):
            taken.close()
            log.warning(
                "session container %s: its wire's one connection came from outside it; the session is ended",
                self.prepared.container_id[:12],
            )
            await self.kill("exited")
            return False
        self.prepared.output.redirect(_NoFrames(), self._raw_stderr)
        self._wire = taken
        return True

    async def _read(self) -> None:
        """Reads the attach stream: the frames too, until (and unless) the wire's socket carries them."""
        await self._reading(self.prepared.read_some)
        self._drained.set()  # the end itself is _watch_exit's to tell (exited or oom)

    async def _read_wire(self) -> None:
        async def read_some() -> bool:
            await anyio.lowlevel.checkpoint()  # as Prepared.read_some: a flood never holds the event loop
            try:
                chunk = await sock_recv(self._wire, 65536)
            except OSError:
                return False
            self._decoder.add(chunk)
            return bool(chunk)

        await self._reading(read_some)

    async def _reading(self, read_some: Callable[[], Awaitable[bool]]) -> None:
        try:
            while await read_some():
                await self._dispatch(self._decoder.take())
        except wire.WireError as exc:
            log.warning("session container %s broke the protocol (%s); ending it", self.container_id[:12], exc)
            self.end_reason = "killed"
            await self.engine.kill(self.container_id, "SIGKILL")

    async def _dispatch(self, frames: list[wire.Frame]) -> None:
        for frame in frames:
            if frame.deferred:
                frame = wire.Frame(
                    frame.kind, frame.payload, await anyio.to_thread.run_sync(wire.message_of, frame.payload)
                )
            if frame.kind in (wire.STDOUT, wire.STDERR):
                stream: Stream = "stdout" if frame.kind == wire.STDOUT else "stderr"
                self._window[stream] += len(frame.payload)
                if self._window[stream] > _WINDOW_CAP[stream]:
                    raise wire.WireError(f"more {stream} in one output window than its cap")
                self._output.add(stream, frame.payload)
            elif frame.kind == wire.REPLY:
                if frame.id == self._call_id:  # what comes after the call's answer belongs to the next call
                    self._count_skipped(frame.message or {})
                    self._call_id = None
                    self._output = CallOutput()
                    self._window = {"stdout": 0, "stderr": 0}
                message = frame.message or {}
                pending = self._pending.get(frame.id or 0)
                if pending is not None and message.get("more") is True:  # a piece of a listing
                    files = message.get("files")
                    if not isinstance(files, list) or len(pending.listed) + len(files) > MAX_LISTED:
                        raise wire.WireError("a listing's pieces that are not lists of at most 10,000 files")
                    pending.listed.extend(files)
                    continue
                self._pending.pop(frame.id or 0, None)
                if pending is not None:
                    if pending.listed and isinstance(message.get("files"), list):
                        message = {**message, "files": pending.listed + message["files"]}
                    pending.settle(message)
            else:
                await self._to_download(frame)

    def _count_skipped(self, message: dict[str, Any]) -> None:
        for stream in ("stdout", "stderr"):
            count = message.get(f"{stream}_skipped")
            if type(count) is int and 0 < count < 1 << 62:
                (self._output.stdout if stream == "stdout" else self._output.stderr).skipped(count)

    async def _to_download(self, frame: wire.Frame) -> None:
        download = self._download
        if download is None:
            raise wire.WireError(f"file data ({frame.kind!r}) with no download requested")
        if frame.kind == wire.FILE:
            message = frame.message or {}
            size, modified = message.get("size"), message.get("modified_at")
            if frame.id != download.id or type(size) is not int or size < 0 or not isinstance(modified, str):
                raise wire.WireError("a file header that does not match the request")
            download.size, download.modified_at = size, modified[:64]
            download.begun.set()
        elif frame.kind == wire.DATA:
            download.received += len(frame.payload)
            if not download.begun.is_set() or download.received > download.size:
                raise wire.WireError("more file bytes than the file's size")
            if not download.abandoned:
                try:
                    await download.send.send(frame.payload)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    download.abandoned = True
        else:  # END
            self._download = None
            if download.received < download.size:  # the file shrank while it was sent: cut the response
                download.end()
                return
            if not download.abandoned:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await download.send.send(None)
            download.send.close()
            download.finished.set()

    # --- requests ---

    def _expect(self, request_id: int) -> _Pending:
        pending = _Pending()
        self._pending[request_id] = pending
        return pending

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def _send(self, data: bytes, within_s: float | None = None) -> None:
        """Writes to the container's stdin, within the file deadline and never past the session's end: a
        stopped container stops reading, and a send left waiting on its socket would keep a writer
        registered on a descriptor that is closed, and then reused by another caller's connection."""
        if self.ended.is_set():
            raise SessionGone(self.end_reason or "exited")
        # What the socket takes at once needs no guard (nothing waits, so nothing is left registered):
        # a request nearly always fits, and the guard costs more than the container's whole answer. No
        # checkpoint after it either: a cancellation there would leave sent code unaccounted for.
        try:
            taken = self._wire.send(data)
        except (BlockingIOError, InterruptedError):
            taken = 0
        except OSError:
            await self.kill("exited")
            raise SessionGone(self.end_reason or "exited") from None
        if taken == len(data):
            return
        data = data[taken:]
        sent = False
        async with anyio.create_task_group() as group:

            async def stop_at_the_end() -> None:
                await self.ended.wait()
                group.cancel_scope.cancel()

            group.start_soon(stop_at_the_end)
            try:
                with anyio.move_on_after(self.file_timeout_s if within_s is None else within_s):
                    await sock_sendall(self._wire, data)
                    sent = True
            except OSError:
                group.cancel_scope.cancel()
                await self.kill("exited")
                raise SessionGone(self.end_reason or "exited") from None
            group.cancel_scope.cancel()
        if not sent:
            if not self.ended.is_set():  # the container took nothing for the whole deadline
                await self.kill("timeout")
            raise SessionGone(self.end_reason or "timeout")

    async def call(
        self, code: str, timeout_s: float, execution: Execution, sink: OutputSink | None = None
    ) -> CallOutcome:
        """Runs one call's code; interrupts it at its deadline or when the execution is killed."""
        if self.ended.is_set():
            raise SessionGone(self.end_reason or "exited")
        request_id = self._new_id()
        pending = self._expect(request_id)
        output = self._output
        self._call_id = request_id
        if sink is not None:
            sink.started()
            output.listen(sink.output)
        started = time.monotonic()
        execution.state = "running"
        timed_out = killed = False
        try:
            # Within the call's own deadline: a container that does not take its code ends the session.
            await self._send(wire.request(wire.EXECUTE, id=request_id, code=code), within_s=timeout_s)
        except SessionGone:
            timed_out = self.end_reason == "timeout"  # the ended outcome below answers the call
        try:
            with anyio.move_on_after(timeout_s):
                await first_of(pending.done, self.ended, execution.kill_requested)
        except anyio.get_cancelled_exc_class():  # the caller hung up: the call is interrupted, as a kill
            with anyio.CancelScope(shield=True):
                await self._interrupt(pending, request_id, "killed")
            raise
        if not pending.done.is_set() and not self.ended.is_set():
            killed = execution.kill_requested.is_set()
            timed_out = not killed
            execution.state = "stopping"
            await self._interrupt(pending, request_id, "killed" if killed else "timeout")
        duration_ms = int((time.monotonic() - started) * 1000)
        if self._call_id == request_id:  # no answer came (interrupted without one, or the session ended)
            self._call_id = None
            self._output = CallOutput()
        output.listen(None)
        output.finish()
        message = pending.message
        if self.ended.is_set() and not message:
            with anyio.move_on_after(5):
                await self._exited.wait()
            return CallOutcome(
                "ended", output.stdout, output.stderr, duration_ms, timed_out=timed_out, killed=killed,
                ended=self.end_reason, exit_code=self.exit_code, oom_killed=self.oom_killed,
            )  # fmt: skip
        status = message.get("status")
        result = message.get("result")
        result_bytes = message.get("result_bytes")
        return CallOutcome(
            status if status in ("ok", "threw", "interrupted") else "threw",
            output.stdout,
            output.stderr,
            duration_ms,
            result=result if isinstance(result, str) else None,
            result_bytes=result_bytes if type(result_bytes) is int and result_bytes >= 0 else 0,
            result_incomplete=message.get("result_incomplete") is True,
            thrown=message.get("error") if status == "threw" else None,
            figures=checked_figures(message.get("images"), message.get("images_truncated")),
            # What the service did, not what the program says: code that catches its interrupt and
            # answers ok (or raises something else) still ran past its deadline, or was killed.
            timed_out=timed_out,
            killed=killed,
        )

    async def _interrupt(self, pending: _Pending, request_id: int, reason: str) -> None:
        """Asks the supervisor to interrupt the call; if the call does not answer within the grace period,
        the session ends. No engine call: an interrupt never waits on the engine."""
        try:
            await self._send(wire.request(wire.INTERRUPT, id=request_id))
        except SessionGone:
            return
        with anyio.move_on_after(self.grace_s):
            await first_of(pending.done, self.ended)
        if not pending.done.is_set() and not self.ended.is_set():
            await self.kill(reason)

    async def _reply(self, request_id: int, pending: _Pending) -> dict[str, Any]:
        with anyio.move_on_after(self.file_timeout_s):
            await first_of(pending.done, self.ended)
        if not pending.done.is_set() or not pending.message:
            if not self.ended.is_set():
                await self.kill("timeout")
            raise SessionGone(self.end_reason or "exited")
        message = pending.message
        if message.get("status") == "error":
            raise FileRefused(str(message.get("error", "failed"))[:32], str(message.get("message", ""))[:300])
        return message

    async def put(self, path: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Streams a file's bytes into the workspace; returns the size. Raises FileRefused, or
        `FileTooLarge` past `max_bytes` (the runner then drops what it had)."""
        request_id = self._new_id()
        pending = self._expect(request_id)
        await self._send(wire.request(wire.PUT, id=request_id, path=path))
        size = 0
        held = bytearray()  # the body's pieces, sent in frames of wire.CHUNK (fewer hops per byte)
        try:
            async for chunk in chunks:
                if pending.done.is_set():
                    break  # refused at once (a folder, a bad path): the rest is not sent
                size += len(chunk)
                if size > max_bytes:
                    raise FileTooLarge(max_bytes)
                held += chunk
                if len(held) >= wire.CHUNK:
                    await self._send(b"".join(wire.data_frames(held)))
                    held.clear()
            if held and not pending.done.is_set():
                await self._send(b"".join(wire.data_frames(held)))
        except BaseException:
            self._pending.pop(request_id, None)
            if not self.ended.is_set():
                with anyio.CancelScope(shield=True):
                    await self._send(wire.request(wire.ABORT, id=request_id))
            raise
        if not pending.done.is_set():
            await self._send(wire.request(wire.END, id=request_id))
        await self._reply(request_id, pending)
        return size

    async def get(self, path: str) -> Download:
        request_id = self._new_id()
        pending = self._expect(request_id)
        download = _DownloadStream(request_id)
        self._download = self._last_download = download
        await self._send(wire.request(wire.GET, id=request_id, path=path))
        with anyio.move_on_after(self.file_timeout_s):
            await first_of(download.begun, pending.done, self.ended)
        if not download.begun.is_set():
            self._download = None
            await self._reply(request_id, pending)  # raises: refused, or the session ended
        self._pending.pop(request_id, None)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    chunk: bytes | None = None
                    # Each piece within the file deadline: a container that stops sending ends its session.
                    with anyio.move_on_after(self.file_timeout_s) as waiting:
                        chunk = await download.receive.receive()
                    if waiting.cancelled_caught:
                        if not self.ended.is_set():
                            await self.kill("timeout")
                        raise SessionGone(self.end_reason or "timeout")
                    if chunk is None:
                        return
                    yield chunk
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if download.cut.is_set():  # the response is being cut (see Download.cut): it cancels this wait
                    await anyio.sleep(self.file_timeout_s)
                raise SessionGone(self.end_reason or "exited") from None  # the stream closed before the end
            finally:
                download.abandoned = True
                download.receive.close()

        async def close() -> None:
            """Stops taking the bytes, and returns once the rest of the file has gone by on the wire
            (dropped as it comes): until then the session is not free for its next request, whose
            frames would otherwise meet the tail of this one."""
            download.abandoned = True
            download.receive.close()
            with anyio.move_on_after(self.file_timeout_s):
                await first_of(download.finished, self.ended)
            if not download.finished.is_set() and not self.ended.is_set():
                await self.kill("timeout")  # a container that stops sending the file ends its session

        return Download(download.size, download.modified_at, chunks(), close, download.cut)

    async def list(self) -> dict[str, Any]:
        request_id = self._new_id()
        pending = self._expect(request_id)
        await self._send(wire.request(wire.LIST, id=request_id))
        return await self._reply(request_id, pending)

    async def delete(self, path: str) -> None:
        request_id = self._new_id()
        pending = self._expect(request_id)
        await self._send(wire.request(wire.DELETE, id=request_id, path=path))
        await self._reply(request_id, pending)


def _forget_descriptor(sock: socket.socket) -> None:
    """Drops what the event loop still watches on the socket's descriptor before it is closed (a send or
    a read that a cancelled caller left registered), so a later socket with the same number is not
    confused with it."""
    try:
        fd = sock.fileno()
    except (OSError, ValueError, AttributeError):
        return
    if fd < 0:
        return
    loop = asyncio.get_running_loop()
    loop.remove_writer(fd)
    loop.remove_reader(fd)


class FileTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


class _NoFrames:
    """The attach stream's stdout once the frames go on the wire's socket: the supervisor writes nothing
    there, so any byte is a broken protocol."""

    def add(self, data: bytes) -> None:
        raise wire.WireError("output on the attach stream's stdout, where the supervisor writes nothing")


class _RawStderr:
    """fd 2 written around the program's streams (process._rawDebug, node's own fatal messages)."""

    def __init__(self, session: SessionContainer) -> None:
        self._session = session

    def add(self, data: bytes) -> None:
        self._session._output.add("stderr", data)


__all__ = ["MAX_LISTED", "CallOutcome", "Download", "FileRefused", "FileTooLarge", "SessionContainer", "SessionGone"]
