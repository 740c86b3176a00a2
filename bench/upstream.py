"""A minimal HTTP/1.1 server on 127.0.0.1 for the HTTP tool's benchmark: `GET /` answers `ok`.

Run as its own process (`python -m bench.upstream`), so that it competes with neither the client nor
the service for an interpreter lock. It prints its port on stdout once it listens.
"""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY = b"ok"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real upstreams do
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the client's
    # delayed ACK (tens of ms), which would swamp what is measured.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: object) -> None:  # the base class's name
        pass  # a log line per request would be most of what is measured


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()  # until the benchmark terminates this process


if __name__ == "__main__":
    main()
