"""A session's wire on a Unix socket of its own, rather than on the engine's attach stream.

On the attach stream, each frame passes two processes on its way (the engine, and the runtime's shim),
each way: measured here, a round trip through it took 0.3 ms more than one through a Unix socket, under
runc and under runsc alike, and a session call is one round trip. So once a session's supervisor has its
header (which still comes on the attach stream), it connects to a socket the service made for it, and
its frames go both ways there; the attach stream keeps only what the supervisor writes to fd 2.

How only that supervisor reaches the socket:

- it is made in this service's wire volume (`Engine.wire_folder`), which every container has read-only
  at `WIRE_DIR`, and whose folder the sandbox's user may traverse but not list;
- under a name of 128 random bits, which reaches the container only in the session's header: the runner
  reads that before any user code exists;
- the service takes the first connection, then closes the listener and unlinks the name, before it
  sends anything that could run code. No one connects after that, and no one could name it before;
- and that connection must come from the session's own container (`came_from`): the kernel's record of
  the connecting process (SO_PEERCRED) names a process in the container's cgroups (the supervisor under
  runc, runsc's gofer under runsc). So even a name that leaked would give no one the wire.

The container's isolation stays the boundary: this is the service's own end of the wire, as the attach
stream was, and everything that comes on it is checked the same way (session_wire.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import socket
import struct
from pathlib import Path

from metaagent.errors import Unavailable
from metaagent.sandbox.engine import MAX_UNIX_SOCKET_PATH, SANDBOX_UID, WIRE_DIR

_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


class WireListener:
    """One session's socket, listening for its supervisor's one connection (`accept`); `close` is safe to
    call at any time, and always called: the name never outlives the wait for that connection."""

    def __init__(self, folder: Path) -> None:
        name = f"{secrets.token_urlsafe(16)}.sock"  # 128 bits, [A-Za-z0-9_-]: runner.js checks the form
        self.path_in_container = f"{WIRE_DIR}/{name}"
        self._path = folder / name
        if len(os.fsencode(self._path)) > MAX_UNIX_SOCKET_PATH:
            raise Unavailable(
                f"A session's wire needs a Unix socket in the engine's volume folder, and {self._path} is longer "
                f"than the {MAX_UNIX_SOCKET_PATH} bytes Linux allows; give the container engine a shorter data "
                "root (dockerd --data-root)"
            )
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind(os.fspath(self._path))
            uid, gid = (int(part) for part in SANDBOX_UID.split(":"))
            os.chown(self._path, uid, gid)  # the sandbox's user connects (the folder is what hides the name)
            self._sock.listen(1)
        except BaseException:
            self.close()
            raise

    async def accept(self) -> socket.socket:
        """The first connection (the supervisor's); the listener is gone once this returns or raises."""
        try:
            connection, _ = await asyncio.get_running_loop().sock_accept(self._sock)
        finally:
            self.close()
        connection.setblocking(False)
        return connection

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)


def came_from(connection: socket.socket, container_id: str) -> bool:
    """Whether the process at the other end of `connection` runs in the container `container_id` (its full
    id), by the kernel's record of who connected: its pid, then that process's cgroups, one of whose paths
    has the container as a whole part (`/docker/<id>`, or `docker-<id>.scope` under systemd). Under runc
    the peer is the supervisor itself; under runsc it is runsc's gofer (uid 0), which opens host sockets
    for the sandbox and sits in the container's cgroups. False where the pid is not this process's to see
    (a peer in another pid namespace reads as 0), or gone."""
    if not _CONTAINER_ID.fullmatch(container_id):
        return False
    pid, _uid, _gid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cgroup", encoding="ascii", errors="replace") as cgroups:
            lines = cgroups.read().splitlines()
    except OSError:
        return False
    scope = f"-{container_id}.scope"
    return any(
        part == container_id or part.endswith(scope) for line in lines for part in line.split(":", 2)[-1].split("/")
    )
