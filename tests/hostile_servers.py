"""Upstreams that misbehave, on 127.0.0.1: one that accepts connections and never answers, and one that
answers each request with exactly the bytes a test gives it (any header, any encoding, any body)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field


@dataclass
class SilentServer:
    url: str
    accepted: int = 0
    connections: list[socket.socket] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close_all(self) -> None:
        """Closes every connection it holds: the clients see the upstream hang up."""
        with self.lock:
            for conn in self.connections:
                with suppress(OSError):
                    conn.close()
            self.connections.clear()


@contextmanager
def silent_server() -> Iterator[SilentServer]:
    """Accepts every connection, reads nothing, answers nothing; counts the connections."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    server = SilentServer(f"http://127.0.0.1:{listener.getsockname()[1]}")

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with server.lock:
                server.connections.append(conn)
                server.accepted += 1

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        listener.close()
        server.close_all()
        thread.join(timeout=5)


@dataclass
class RawServer:
    url: str
    answers: list[bytes] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)
    default: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, *raw: bytes) -> None:
        """The next requests get these bytes, in order, then the connection is closed."""
        with self.lock:
            self.answers.extend(raw)


def response(status: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """An HTTP/1.1 answer with these raw header lines (Content-Length and Connection added)."""
    lines = [f"HTTP/1.1 {status}".encode(), *(name + b": " + value for name, value in headers)]
    lines += [b"Content-Length: " + str(len(body)).encode(), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@contextmanager
def raw_server() -> Iterator[RawServer]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    server = RawServer(f"http://127.0.0.1:{listener.getsockname()[1]}")

    def serve(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            while len(rest) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                rest += chunk
            with server.lock:
                server.requests.append(head)
                answer = server.answers.pop(0) if server.answers else server.default
            with suppress(OSError):
                conn.sendall(answer)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        listener.close()
        thread.join(timeout=5)
