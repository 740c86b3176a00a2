"""The real service over real HTTP: uvicorn on a free 127.0.0.1 port, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx2
import uvicorn
from fastapi import FastAPI

START_TIMEOUT_S = 20
STOP_TIMEOUT_S = 20


def wait_until_started(url: str, deadline: float) -> None:
    """Until /health stops answering 503 `starting` (its start-up checks have run once), by `deadline`."""
    while True:
        try:
            if httpx2.get(f"{url}/health", timeout=5).json().get("status") != "starting":
                return
        except httpx2.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the service's start-up checks did not run")
        time.sleep(0.05)


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Runs `app` (lifespan included) until the block ends; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the service did not start")
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        wait_until_started(url, deadline)
        yield url
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
