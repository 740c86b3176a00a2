"""Fake Serper and OpenAI servers: real HTTP on 127.0.0.1, speaking the real request and response formats.

Each checks the key header as the real service does, records every request, and can be scripted to
answer 429 with Retry-After, 5xx, malformed bodies or slowly before it answers normally again.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SERPER_KEY = "serper-test-key-3f9a7c1e5b"
OPENAI_KEY = "sk-test-openai-key-8d2b6e4f0a"


@dataclass
class Scripted:
    """One scripted answer: status, headers, raw body, and an optional delay before it."""

    status: int
    body: bytes | str | dict[str, Any] = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any


class FakeUpstream:
    """State shared with the handler thread: the script of answers and the requests received."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.requests: list[Recorded] = []
        self._script: list[Scripted] = []
        self._lock = threading.Lock()

    def script(self, *answers: Scripted) -> None:
        """The next requests get these answers, in order; later ones get the normal answer."""
        with self._lock:
            self._script.extend(answers)

    def next_scripted(self) -> Scripted | None:
        with self._lock:
            return self._script.pop(0) if self._script else None

    def record(self, request: Recorded) -> None:
        with self._lock:
            self.requests.append(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeUpstream

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def reply(self, status: int, body: bytes | str | dict[str, Any], headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
        self.fake.record(Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        scripted = self.fake.next_scripted()
        if scripted is not None:
            time.sleep(scripted.delay_s)
            self.reply(scripted.status, scripted.body, scripted.headers)
            return
        self.answer(body)

    def answer(self, body: Any) -> None:
        raise NotImplementedError


class _SerperHandler(_Handler):
    def answer(self, body: Any) -> None:
        if self.headers.get("X-API-KEY") != SERPER_KEY:
            self.reply(403, {"message": "Unauthorized.", "statusCode": 403})
            return
        kind = self.path.rsplit("/", 1)[-1]
        if kind not in ("search", "news", "images") or not isinstance(body, dict) or not body.get("q"):
            self.reply(400, {"message": "Missing query parameter", "statusCode": 400})
            return
        q, num = body["q"], int(body.get("num", 10))
        params = {"q": q, "gl": body.get("gl", "us"), "hl": body.get("hl", "en"), "type": kind, "num": num}
        answer: dict[str, Any] = {"searchParameters": params, "credits": 1}
        if kind == "search":
            answer["organic"] = [
                {
                    "title": f"{q} result {i}",
                    "link": f"https://example.com/{i}",
                    "snippet": f"About {q}, number {i}.",
                    "position": i,
                    "sitelinks": [{"title": "More", "link": f"https://example.com/{i}/more"}],
                }
                for i in range(1, num + 1)
            ]
            answer["answerBox"] = {"title": q, "answer": "42", "link": "https://example.com/answer"}
            answer["knowledgeGraph"] = {"title": q.title(), "type": "Thing", "description": f"{q} is a thing."}
            answer["peopleAlsoAsk"] = [{"question": f"What is {q}?", "snippet": "It is a thing.", "title": "Q"}]
            answer["relatedSearches"] = [{"query": f"{q} meaning"}, {"query": f"{q} history"}]
        elif kind == "news":
            answer["news"] = [
                {
                    "title": f"News about {q} {i}",
                    "link": f"https://news.example.com/{i}",
                    "snippet": f"Today in {q}.",
                    "date": f"{i} hours ago",
                    "source": "Example News",
                    "imageUrl": f"https://news.example.com/{i}.jpg",
                    "position": i,
                }
                for i in range(1, num + 1)
            ]
        else:
            answer["images"] = [
                {
                    "title": f"Picture of {q} {i}",
                    "imageUrl": f"https://img.example.com/{i}.png",
                    "imageWidth": 640,
                    "imageHeight": 480,
                    "thumbnailUrl": f"https://thumb.example.com/{i}.png",
                    "source": "Example Images",
                    "domain": "img.example.com",
                    "link": f"https://img.example.com/page/{i}",
                    "googleUrl": "https://www.google.com/imgres?x",
                    "position": i,
                }
                for i in range(1, num + 1)
            ]
        self.reply(200, answer)


def vector_for(text: str, dimensions: int = 4) -> list[float]:
    """The fake model's embedding of a text: exactly representable in float32, different per text."""
    seed = sum(ord(c) for c in text)
    return [float(len(text)), float(seed % 1000), *(float((seed + i) % 7) / 2 for i in range(dimensions - 2))]


class _OpenAIHandler(_Handler):
    max_inputs = 2048
    plain_floats = False
    reverse_order = False

    def answer(self, body: Any) -> None:
        if self.headers.get("Authorization") != f"Bearer {OPENAI_KEY}":
            presented = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            # The real service echoes part of a wrong key; this one echoes all of it, to test redaction.
            error = {"message": f"Incorrect API key provided: {presented}.", "type": "invalid_request_error"}
            self.reply(401, {"error": {**error, "param": None, "code": "invalid_api_key"}})
            return
        if not self.path.endswith("/embeddings") or not isinstance(body, dict):
            self.reply(404, {"error": {"message": "Unknown endpoint", "type": "invalid_request_error"}})
            return
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or len(texts) > self.max_inputs:
            message = f"'$.input' is invalid: at most {self.max_inputs} inputs per request"
            self.reply(400, {"error": {"message": message, "type": "invalid_request_error"}})
            return
        dimensions = int(body.get("dimensions") or 4)
        data = []
        for index, text in enumerate(texts):
            vector = vector_for(text, dimensions)
            encoded: Any = vector
            if body.get("encoding_format") == "base64" and not self.plain_floats:
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        if self.reverse_order:
            data.reverse()
        tokens = sum(len(t.split()) for t in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        self.reply(200, {"object": "list", "data": data, "model": body.get("model"), "usage": usage})


@contextmanager
def _serving(handler: type[_Handler], path: str = "", **options: Any) -> Iterator[FakeUpstream]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    fake = FakeUpstream(f"http://127.0.0.1:{server.server_address[1]}{path}")
    server.RequestHandlerClass = type(handler.__name__, (handler,), {"fake": fake, **options})
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def fake_serper() -> Iterator[FakeUpstream]:
    """A Serper look-alike; `fake.url` is the base URL (`/search`, `/news`, `/images` below it)."""
    with _serving(_SerperHandler) as fake:
        yield fake


@contextmanager
def fake_openai(
    *, max_inputs: int = 2048, plain_floats: bool = False, reverse_order: bool = False
) -> Iterator[FakeUpstream]:
    """An OpenAI look-alike; `fake.url` ends in `/v1`, like OpenAI's base URL."""
    options = {"max_inputs": max_inputs, "plain_floats": plain_floats, "reverse_order": reverse_order}
    with _serving(_OpenAIHandler, "/v1", **options) as fake:
        yield fake
