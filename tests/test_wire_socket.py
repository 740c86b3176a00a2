"""A session's wire socket, on this machine's kernel: one connection is taken, and then its name is gone."""

from __future__ import annotations

import socket
from pathlib import Path

import anyio
import pytest

from metaagent.errors import Unavailable
from metaagent.sandbox.engine import WIRE_DIR
from metaagent.sandbox.wire_socket import WireListener, came_from

pytestmark = [pytest.mark.security]


def host_path(folder: Path, listener: WireListener) -> Path:
    return folder / listener.path_in_container.removeprefix(f"{WIRE_DIR}/")


async def test_the_first_connection_is_taken_and_then_no_one_can_connect(tmp_path: Path) -> None:
    listener = WireListener(tmp_path)
    path = host_path(tmp_path, listener)
    name = path.name.removesuffix(".sock")
    assert len(name) == 22  # 128 random bits, as runner.js checks the form
    first = socket.socket(socket.AF_UNIX)
    first.connect(str(path))
    with anyio.fail_after(10):
        taken = await listener.accept()
    first.sendall(b"frames")
    assert taken.recv(16) == b"frames"
    assert not path.exists()  # unlinked: the name leads nowhere now
    with socket.socket(socket.AF_UNIX) as second, pytest.raises(FileNotFoundError):
        second.connect(str(path))
    taken.close()
    first.close()


async def test_a_wait_abandoned_before_any_connection_leaves_no_name(tmp_path: Path) -> None:
    listener = WireListener(tmp_path)
    path = host_path(tmp_path, listener)
    with anyio.move_on_after(0.01):
        await listener.accept()
    assert not path.exists()
    listener.close()  # again: harmless


def test_two_listeners_never_share_a_name(tmp_path: Path) -> None:
    listeners = [WireListener(tmp_path) for _ in range(100)]
    try:
        assert len({listener.path_in_container for listener in listeners}) == 100
    finally:
        for listener in listeners:
            listener.close()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_too_deep_for_a_unix_socket_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(Unavailable, match="shorter data root"):
        WireListener(deep)
    assert list(deep.iterdir()) == []


async def test_a_connection_from_this_process_comes_from_no_container(tmp_path: Path) -> None:
    listener = WireListener(tmp_path)
    with socket.socket(socket.AF_UNIX) as mine:
        mine.connect(str(host_path(tmp_path, listener)))
        with anyio.fail_after(10):
            taken = await listener.accept()
        with taken:
            assert not came_from(taken, "a" * 64)
            assert not came_from(taken, "")  # never "in" every path
