"""A small npm registry on 127.0.0.1: packuments and .tgz tarballs made in the test, every request
recorded, and packages that answer slowly. npm talks to it through its ordinary `--registry`."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class FakePackage:
    name: str
    version: str = "1.0.0"
    files: dict[str, bytes] = field(default_factory=lambda: {"index.js": b"module.exports = 'ok';\n"})
    scripts: dict[str, str] = field(default_factory=dict)
    dependencies: dict[str, str] = field(default_factory=dict)

    def manifest(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "main": "index.js",
            "scripts": self.scripts,
            "dependencies": self.dependencies,
        }

    def tarball(self) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            files = {"package.json": json.dumps(self.manifest()).encode(), **self.files}
            for path, content in files.items():
                info = tarfile.TarInfo(f"package/{path}")
                info.size, info.mode, info.mtime = len(content), 0o644, 1_700_000_000
                tar.addfile(info, io.BytesIO(content))
        return buffer.getvalue()


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


class FakeRegistry:
    def __init__(self) -> None:
        self.url = ""
        self.requests: list[str] = []
        self.slow: dict[str, float] = {}  # package name -> seconds its packument takes
        self._packages: dict[str, list[FakePackage]] = {}
        self._tarballs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def add(self, package: FakePackage) -> FakePackage:
        data = package.tarball()
        self._tarballs[self._tarball_path(package)] = data
        self._packages.setdefault(package.name, []).append(package)
        return package

    def _tarball_path(self, package: FakePackage) -> str:
        base = package.name.rsplit("/", 1)[-1]
        return f"/{package.name}/-/{base}-{package.version}.tgz"

    def integrity_of(self, package: FakePackage) -> str:
        return integrity(self._tarballs[self._tarball_path(package)])

    def requests_for(self, name: str) -> list[str]:
        with self._lock:
            return [r for r in self.requests if r == f"/{name}" or r.startswith(f"/{name}/")]

    def packument(self, name: str) -> dict[str, Any]:
        versions = {}
        for package in self._packages[name]:
            data = self._tarballs[self._tarball_path(package)]
            versions[package.version] = {
                **package.manifest(),
                "dist": {
                    "tarball": self.url + self._tarball_path(package),
                    "integrity": integrity(data),
                    "shasum": hashlib.sha1(data).hexdigest(),  # noqa: S324  # npm's legacy checksum field
                },
            }
        latest = self._packages[name][-1].version
        return {"name": name, "dist-tags": {"latest": latest}, "versions": versions}

    def record(self, path: str) -> None:
        with self._lock:
            self.requests.append(path)


def _handler(registry: FakeRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # npm was killed at its deadline
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = unquote(urlsplit(self.path).path)
            registry.record(path)
            if path in registry._tarballs:
                self._reply(200, registry._tarballs[path], "application/octet-stream")
                return
            name = path.lstrip("/")
            if name in registry.slow:
                time.sleep(registry.slow[name])
            if name in registry._packages:
                self._reply(200, json.dumps(registry.packument(name)).encode(), "application/json")
                return
            self._reply(404, b'{"error":"Not found"}', "application/json")

    return Handler


@contextmanager
def running_registry(*packages: FakePackage) -> Iterator[FakeRegistry]:
    registry = FakeRegistry()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(registry))
    server.daemon_threads = True
    registry.url = f"http://127.0.0.1:{server.server_address[1]}"
    for package in packages:
        registry.add(package)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry
    finally:
        server.shutdown()
        server.server_close()
