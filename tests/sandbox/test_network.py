"""Network for sandboxed code: ordinary http, https and fetch reach the execution's allowed hosts through
the service's egress guard, and nothing else does; the container itself never gets a network.

The end-to-end tests run a real service process whose ALLOW_HTTP_HOSTS lists 127.0.0.1 by exact IP
(the guard lets an exact IP entry reach a loopback address, so no private-network switch is needed),
and real HTTP and HTTPS servers of the tests on 127.0.0.1, with a test certificate authority that the
sandbox is told to trust through METAAGENT_SANDBOX_EXTRA_CA_CERTS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import docker
import httpx2
import pytest
import trustme

from metaagent.audit import AuditLog
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard
from metaagent.errors import ConfigError, RequestRefused
from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import image_tag
from metaagent.sandbox.engine import WIRE_DIR, Engine
from metaagent.sandbox.execute import Outcome, execute
from metaagent.sandbox.network import NetworkLimits, SandboxNetwork, read_extra_ca_certs
from metaagent.sandbox.tunnel import (
    ACCEPTS_PER_TUNNEL,
    BURST_S,
    DEFAULT_TUNNEL_RATE,
    MAX_REFUSALS,
    SLOT_WAIT_S,
    TunnelStats,
)
from tests.conftest import _UpstreamHandler
from tests.sandbox.conftest import Result, Service, audit_records, running_service
from tests.sandbox.test_tunnel import closing_server, holding_server, port_of
from tests.test_cli import serving
from tests.test_metrics import samples

MAX_TUNNEL_BYTES = 1024 * 1024
NETWORK_SERVICE_HOSTS = '["127.0.0.1", "127.0.0.2", "*.sandbox.test"]'


# --- fixtures -----------------------------------------------------------------------------------------


@contextmanager
def serving_https(cert: trustme.LeafCert) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _UpstreamHandler)
    server.daemon_threads = True
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def sandbox_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def https_port(sandbox_ca: trustme.CA) -> Iterator[int]:
    """An HTTPS server on 127.0.0.1 whose certificate the test CA signed."""
    with serving_https(sandbox_ca.issue_cert("127.0.0.1")) as port:
        yield port


@pytest.fixture(scope="module")
def network_service(
    tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient, sandbox_ca: trustme.CA
) -> Iterator[Service]:
    workdir = tmp_path_factory.mktemp("network-service")
    ca_path = workdir / "test-ca.pem"
    sandbox_ca.cert_pem.write_to_path(str(ca_path))
    with running_service(
        workdir,
        ALLOW_HTTP_HOSTS=NETWORK_SERVICE_HOSTS,
        METAAGENT_SANDBOX_EXTRA_CA_CERTS=str(ca_path),
        METAAGENT_SANDBOX_MAX_TUNNEL_BYTES=str(MAX_TUNNEL_BYTES),
        METAAGENT_LANGUAGES="javascript,python",
    ) as service:
        yield service


RunNet = Callable[..., Result]


@pytest.fixture
def run_net(network_service: Service) -> RunNet:
    """Runs code on the network service; `allow` becomes the request's `network.allow` (None: no network)."""

    def run(code: str, allow: list[str] | None = None, *, timeout_s: int = 10, language: str = "javascript") -> Result:
        body: dict[str, Any] = {"code": code, "timeout_s": timeout_s, "language": language}
        if allow is not None:
            body["network"] = {"allow": allow}
        response = network_service.post("/tools/code-interpreter", body)
        return Result(response.status_code, response.json())

    return run


def audit_of(service: Service, execution_id: str) -> list[dict[str, Any]]:
    return [r for r in audit_records(service) if r.get("execution_id") == execution_id]


def finished_record(service: Service, result: Result) -> dict[str, Any]:
    return next(r for r in audit_of(service, result.body["execution_id"]) if r["event"] == "execution.finished")


# --- sandboxed code reaches allowed hosts -------------------------------------------------------------

CLIENTS = {
    "fetch-http": """
        fetch('http://127.0.0.1:HTTP_PORT/echo?via=fetch')
          .then(async (r) => console.log(r.status, (await r.json()).path));
    """,
    "fetch-https": """
        fetch('https://127.0.0.1:HTTPS_PORT/echo?via=fetch')
          .then(async (r) => console.log(r.status, (await r.json()).path));
    """,
    "http.get": """
        require('http').get('http://127.0.0.1:HTTP_PORT/echo?via=http', (res) => {
          let body = ''; res.on('data', (c) => body += c);
          res.on('end', () => console.log(res.statusCode, JSON.parse(body).path));
        });
    """,
    "https.get": """
        require('https').get('https://127.0.0.1:HTTPS_PORT/echo?via=https', (res) => {
          let body = ''; res.on('data', (c) => body += c);
          res.on('end', () => console.log(res.statusCode, JSON.parse(body).path));
        });
    """,
    "http.request-post": """
        const req = require('http').request('http://127.0.0.1:HTTP_PORT/echo?via=post', { method: 'POST' }, (res) => {
          let body = ''; res.on('data', (c) => body += c);
          res.on('end', () => { const echo = JSON.parse(body); console.log(res.statusCode, echo.path, echo.body); });
        });
        req.end('hello');
    """,
}
EXPECTED = {
    "fetch-http": "200 /echo?via=fetch\n",
    "fetch-https": "200 /echo?via=fetch\n",
    "http.get": "200 /echo?via=http\n",
    "https.get": "200 /echo?via=https\n",
    "http.request-post": "200 /echo?via=post hello\n",
}


@pytest.mark.docker
def test_a_session_with_network_reaches_an_allowed_host_and_its_close_ends_no_other_session(
    network_service: Service, upstream: str
) -> None:
    """A session's network (its tunnel server) is entered by the request that opens it and left by the task
    that ends the session: that once failed the task group of every session, so closing one session with
    network ended all the others (410 killed)."""
    other = network_service.post("/sessions", {})
    assert other.status_code == 201, other.text
    other_id = other.json()["session_id"]
    assert network_service.post(f"/sessions/{other_id}/execute", {"code": "var x = 41"}).status_code == 200
    opened = network_service.post("/sessions", {"network": {"allow": ["127.0.0.1"]}})
    assert opened.status_code == 201, opened.text
    session_id = opened.json()["session_id"]
    code = f"(await (await fetch('http://127.0.0.1:{port_of(upstream)}/echo?via=session')).json()).path"
    called = network_service.post(f"/sessions/{session_id}/execute", {"code": code})
    assert called.status_code == 200, called.text
    assert called.json()["result"] == "'/echo?via=session'", called.json()
    closed = httpx2.delete(f"{network_service.base_url}/sessions/{session_id}", timeout=60)
    assert closed.status_code == 200, closed.text
    still = network_service.post(f"/sessions/{other_id}/execute", {"code": "x + 1"})
    assert still.status_code == 200, still.text
    assert still.json()["result"] == "42"
    assert "background task sessions failed" not in network_service.stderr_path.read_text()
    httpx2.delete(f"{network_service.base_url}/sessions/{other_id}", timeout=60)


@pytest.mark.docker
@pytest.mark.security
def test_tls_is_verified_inside_the_sandbox(run_net: RunNet) -> None:
    # The service only moves bytes, so a certificate the sandbox does not trust fails in the sandbox.
    with serving_https(trustme.CA().issue_cert("127.0.0.1")) as port:
        result = run_net(
            f"""
            fetch('https://127.0.0.1:{port}/').then(() => console.log('TRUSTED'), (e) => console.log(e.cause.code));
            require('https').get('https://127.0.0.1:{port}/', () => console.log('TRUSTED'))
              .on('error', (e) => console.log(e.code));
            """,
            ["127.0.0.1"],
        )
    assert result.stdout.splitlines() == ["UNABLE_TO_VERIFY_LEAF_SIGNATURE"] * 2


PARALLEL_REQUESTS = {
    "javascript": """
        const urls = Array.from({ length: 30 }, (_, i) => 'http://127.0.0.1:UPSTREAM_PORT/echo?i=' + i);
        Promise.all(urls.map((u) => fetch(u).then((r) => r.json())))
          .then((all) => console.log(all.length, new Set(all.map((e) => e.path)).size));
    """,
    # Threads with urllib (more than the 8 tunnels, fewer than the container's 32 processes and threads)
    # and asyncio's streams: both wait for a tunnel when all are open.
    "python": """
import asyncio, concurrent.futures, json, urllib.request
def get(i):
    with urllib.request.urlopen(f"http://127.0.0.1:UPSTREAM_PORT/echo?i={i}", timeout=20) as r:
        return json.load(r)["path"]
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    paths = list(pool.map(get, range(30)))
async def fetch(i):
    reader, writer = await asyncio.open_connection("127.0.0.1", UPSTREAM_PORT)
    writer.write(f"GET /echo?a={i} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n".encode())
    response = await reader.read()
    writer.close()
    return json.loads(response.partition(b"\\r\\n\\r\\n")[2])["path"]
async def main():
    return await asyncio.gather(*(fetch(i) for i in range(30)))
paths += asyncio.run(main())
print(len(paths), len(set(paths)))
""",
}


@pytest.mark.docker
@pytest.mark.parametrize("language", PARALLEL_REQUESTS)
def test_many_parallel_requests_wait_for_a_free_tunnel_instead_of_failing(
    run_net: RunNet, upstream: str, language: str
) -> None:
    code = PARALLEL_REQUESTS[language].replace("UPSTREAM_PORT", str(port_of(upstream)))
    result = run_net(code, ["127.0.0.1"], timeout_s=30, language=language)
    expected = {"javascript": "30 30\n", "python": "60 60\n"}[language]
    assert result.stdout == expected, result.body


# --- Python, through the same tunnel -----------------------------------------------------------------

PYTHON_CLIENTS = {
    "urllib-http": """
import json, urllib.request
with urllib.request.urlopen("http://127.0.0.1:HTTP_PORT/echo?via=urllib", timeout=10) as r:
    print(r.status, json.load(r)["path"])
""",
    "urllib-https": """
import json, urllib.request
with urllib.request.urlopen("https://127.0.0.1:HTTPS_PORT/echo?via=urllib", timeout=10) as r:
    print(r.status, json.load(r)["path"])
""",
    "http.client-post": """
import http.client, json
connection = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=10)
connection.request("POST", "/echo?via=post", body="hello")
response = connection.getresponse()
echo = json.load(response)
print(response.status, echo["path"], echo["body"])
""",
    "socket": """
import json, socket
with socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=10) as s:
    s.sendall(b"GET /echo?via=socket HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
head, _, body = data.partition(b"\\r\\n\\r\\n")
print(head.split()[1].decode(), json.loads(body)["path"])
""",
    "asyncio": """
import asyncio, json
async def main():
    reader, writer = await asyncio.open_connection("127.0.0.1", HTTP_PORT)
    writer.write(b"GET /echo?via=asyncio HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n")
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\\r\\n\\r\\n")
    print(head.split()[1].decode(), json.loads(body)["path"])
asyncio.run(main())
""",
}
PYTHON_EXPECTED = {
    "urllib-http": "200 /echo?via=urllib\n",
    "urllib-https": "200 /echo?via=urllib\n",
    "http.client-post": "200 /echo?via=post hello\n",
    "socket": "200 /echo?via=socket\n",
    "asyncio": "200 /echo?via=asyncio\n",
}


CLIENTS_OF = {"javascript": (CLIENTS, EXPECTED), "python": (PYTHON_CLIENTS, PYTHON_EXPECTED)}


@pytest.mark.docker
@pytest.mark.parametrize(
    ("language", "client"), [(language, client) for language, (codes, _) in CLIENTS_OF.items() for client in codes]
)
def test_sandboxed_code_reaches_an_allowed_host(
    run_net: RunNet, upstream: str, https_port: int, language: str, client: str
) -> None:
    codes, expected = CLIENTS_OF[language]
    code = codes[client].replace("HTTP_PORT", str(port_of(upstream))).replace("HTTPS_PORT", str(https_port))
    result = run_net(code, ["127.0.0.1"], language=language)
    assert result.status == 200, result.body
    assert (result.stdout, result.stderr, result.exit_code) == (expected[client], "", 0)


@pytest.mark.docker
@pytest.mark.security
def test_python_code_is_refused_hosts_off_its_list_and_an_untrusted_certificate_by_the_same_guard(
    run_net: RunNet, network_service: Service, upstream: str
) -> None:
    port = port_of(upstream)
    with serving_https(trustme.CA().issue_cert("127.0.0.1")) as untrusted_port:
        result = run_net(
            f"""
import ssl, urllib.error, urllib.request
for url in ("http://127.0.0.2:{port}/", "https://api.sandbox.test/"):
    try:
        urllib.request.urlopen(url, timeout=10)
        print("REACHED")
    except urllib.error.URLError as exc:
        print(exc.reason)
try:
    urllib.request.urlopen("https://127.0.0.1:{untrusted_port}/", timeout=10)
    print("TRUSTED")
except urllib.error.URLError as exc:
    print(type(exc.reason).__name__, exc.reason.verify_message)
""",
            ["127.0.0.1"],
            language="python",
        )
    assert result.stdout.splitlines() == [
        "[Errno 111] ERR_METAAGENT_HOST_BLOCKED: Host 127.0.0.2 is not allowed: "
        "it is not on this execution's network allow-list",
        "[Errno 111] ERR_METAAGENT_HOST_BLOCKED: Host api.sandbox.test is not allowed: "
        "it is not on this execution's network allow-list",
        "SSLCertVerificationError unable to get local issuer certificate",
    ], result.body
    blocked = sorted(
        (r["host"], r["port"])
        for r in audit_of(network_service, result.body["execution_id"])
        if r["event"] == "egress.blocked"
    )
    assert blocked == [("127.0.0.2", port), ("api.sandbox.test", 443)]


@pytest.mark.docker
@pytest.mark.security
def test_python_code_reaches_nothing_past_the_tunnel(run_net: RunNet, upstream: str) -> None:
    """The gate lets a socket connect to the tunnel's path alone: a connect that skips the runner's
    patched one (the C method itself) is refused, so is a socket of another family (netlink), and
    without network every socket is."""
    port = port_of(upstream)
    code = f"""
import _socket, socket
attempts = (
    (_socket.AF_INET, _socket.SOCK_STREAM, ("127.0.0.1", {port})),
    (_socket.AF_UNIX, _socket.SOCK_STREAM, "/run/metaagent-wire/x.sock"),
    (_socket.AF_NETLINK, _socket.SOCK_RAW, None),
)
for family, kind, address in attempts:
    try:
        made = _socket.socket(family, kind)
        if address is not None:
            made.connect(address)
        print("CONNECTED")
    except OSError as exc:
        print(type(exc).__name__, str(exc).split(":")[0])
"""
    refused = ["PermissionError [Errno 1] ERR_METAAGENT_BLOCKED_API"] * 3
    with_network = run_net(code, ["127.0.0.1"], language="python")
    assert with_network.stdout.splitlines() == refused, with_network.body
    without = run_net(code, language="python")
    assert without.stdout.splitlines() == refused, without.body


@pytest.mark.docker
def test_a_python_asyncio_connect_that_waits_for_a_tunnel_leaves_the_event_loop_running(
    run_net: RunNet, upstream: str
) -> None:
    """With every tunnel of the execution held open (8, the default), the runner waits for one to close
    before it asks for a new one: asyncio's connect waits in a thread meanwhile, so other tasks run and
    `wait_for` gives up on it; once a tunnel closes, a connect gets through."""
    code = f"""
import asyncio, socket
held = [socket.create_connection(("127.0.0.1", {port_of(upstream)})) for _ in range(8)]
ticks = 0
async def tick():
    global ticks
    while True:
        await asyncio.sleep(0.01)
        ticks += 1
async def main():
    ticker = asyncio.create_task(tick())
    try:
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", {port_of(upstream)}), 0.5)
        print("OPENED")
    except TimeoutError:
        print("GAVE UP", ticks > 0)
    held.pop().close()
    reader, writer = await asyncio.open_connection("127.0.0.1", {port_of(upstream)})
    print("OPENED")
    writer.close()
    await writer.wait_closed()
    held.append(socket.create_connection(("127.0.0.1", {port_of(upstream)})))
    try:
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", {port_of(upstream)}), 0.2)
    except TimeoutError:
        print("GAVE UP AGAIN")
    ticker.cancel()
asyncio.run(main())
"""
    # The program ends with its 8 tunnels still open and a connect given up on: the thread that waited
    # for a tunnel stops, or the program's exit would wait for it until the execution's timeout.
    result = run_net(code, ["127.0.0.1"], timeout_s=30, language="python")
    assert (result.stdout, result.exit_code) == ("GAVE UP True\nOPENED\nGAVE UP AGAIN\n", 0), result.body


@pytest.mark.docker
def test_a_python_connect_past_the_tunnel_limit_waits_in_the_runner_and_is_never_refused(
    run_net: RunNet, network_service: Service, upstream: str
) -> None:
    """With the execution's 8 tunnels open, a 9th connect waits in the runner, as node's does, for longer
    than the service would hold it before refusing it, and opens once one closes: the service never saw
    it early, so nothing was refused (each refusal would count towards the execution's cap of 50)."""
    code = f"""
import socket, threading, time
address = ("127.0.0.1", {port_of(upstream)})
held = [socket.create_connection(address, timeout=60) for _ in range(8)]
ninth = []
waiter = threading.Thread(target=lambda: ninth.append(socket.create_connection(address, timeout=60)))
waiter.start()
time.sleep({SLOT_WAIT_S + 1})
print("waiting", not ninth)
held.pop().close()
waiter.join()
print("opened", len(ninth))
"""
    result = run_net(code, ["127.0.0.1"], timeout_s=60, language="python")
    assert (result.stdout, result.exit_code) == ("waiting True\nopened 1\n", 0), result.body
    tunnels = finished_record(network_service, result)["network"]["tunnels"]
    assert (tunnels["opened"], tunnels["refused"]) == (9, 0), tunnels


@pytest.mark.docker
def test_a_python_tunnel_is_free_again_however_its_descriptor_closes(run_net: RunNet, upstream: str) -> None:
    """The runner counts the execution's 8 tunnels by their descriptors: a socket closed, dropped unclosed,
    taken apart (`detach`, then `os.close`), or copied (`dup`) and closed twice gives its tunnel back, so
    the next 8 open (a tunnel still counted would make the next connect wait out its 10 s timeout and
    fail); a copy keeps the tunnel counted while it is open (the 8th connect waits out 0.5 s)."""
    code = f"""
import os, socket
address = ("127.0.0.1", {port_of(upstream)})
for way in ("closed", "dropped", "os.close", "dup"):
    for _ in range(2):
        sockets = [socket.create_connection(address, timeout=10) for _ in range(8)]
        if way == "closed":
            for s in sockets:
                s.close()
        elif way == "os.close":
            for s in sockets:
                os.close(s.detach())
        elif way == "dup":
            copies = [s.dup() for s in sockets]
            for s in sockets:
                s.close()
            try:
                socket.create_connection(address, timeout=0.5)
            except TimeoutError as exc:
                print(exc.strerror)  # the runner's wait, not the service's (which would be "timed out")
            for s in copies:
                s.close()
        del sockets
    print(way)
"""
    result = run_net(code, ["127.0.0.1"], timeout_s=30, language="python")
    copies_count = "all 8 tunnels of the execution stayed open\n"
    expected = f"closed\ndropped\nos.close\n{copies_count * 2}dup\n"
    assert (result.stdout, result.exit_code) == (expected, 0), result.body


@pytest.mark.docker
def test_a_tunneled_python_socket_reports_its_peer_and_refuses_a_second_connect(run_net: RunNet, upstream: str) -> None:
    """As on a network: the peer is the address connected to (asyncio's `peername` too), the socket's own
    end has no TCP address here, and a connected socket refuses another connect (`EISCONN`)."""
    port = port_of(upstream)
    code = f"""
import asyncio, errno, socket
with socket.create_connection(("127.0.0.1", {port}), timeout=10) as s:
    print(s.getpeername(), s.getsockname())
    try:
        s.connect(("127.0.0.1", {port}))
    except OSError as exc:
        print(errno.errorcode[exc.errno])
async def main():
    reader, writer = await asyncio.open_connection("127.0.0.1", {port})
    print(writer.get_extra_info("peername"))
    writer.close()
asyncio.run(main())
"""
    result = run_net(code, ["127.0.0.1"], language="python")
    expected = f"('127.0.0.1', {port}) ('0.0.0.0', 0)\nEISCONN\n('127.0.0.1', {port})\n"
    assert (result.stdout, result.exit_code) == (expected, 0), result.body


@pytest.mark.docker
def test_a_python_session_with_network_reaches_an_allowed_host(network_service: Service, upstream: str) -> None:
    opened = network_service.post("/sessions", {"language": "python", "network": {"allow": ["127.0.0.1"]}})
    assert opened.status_code == 201, opened.text
    session_id = opened.json()["session_id"]
    try:
        code = (
            "import json, urllib.request\n"
            f"json.load(urllib.request.urlopen('http://127.0.0.1:{port_of(upstream)}/echo?via=session'))['path']"
        )
        for _ in range(2):  # a second call reuses the patched resolver and connect
            called = network_service.post(f"/sessions/{session_id}/execute", {"code": code})
            assert called.status_code == 200, called.text
            assert called.json()["result"] == "'/echo?via=session'", called.json()
    finally:
        httpx2.delete(f"{network_service.base_url}/sessions/{session_id}", timeout=60)


# --- and nothing else -----------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.security
def test_host_outside_the_execution_list_is_refused_and_logged_even_when_on_allow_http_hosts(
    run_net: RunNet, network_service: Service, upstream: str
) -> None:
    port = port_of(upstream)
    result = run_net(
        f"""
        fetch('http://127.0.0.2:{port}/').then(() => console.log('REACHED'),
          (e) => console.log(e.cause.code + ': ' + e.cause.message));
        require('https').get('https://api.sandbox.test/', () => console.log('REACHED'))
          .on('error', (e) => console.log(e.code + ': ' + e.message));
        """,
        ["127.0.0.1"],
    )
    assert sorted(result.stdout.splitlines()) == [
        "ERR_METAAGENT_HOST_BLOCKED: Host 127.0.0.2 is not allowed: it is not on this execution's network allow-list",
        "ERR_METAAGENT_HOST_BLOCKED: Host api.sandbox.test is not allowed: "
        "it is not on this execution's network allow-list",
    ]
    log = network_service.stderr_path.read_text()
    assert f"[SECURITY] Blocked HTTP request to disallowed host: 127.0.0.2 (CONNECT 127.0.0.2:{port})\n" in log
    line = "[SECURITY] Blocked HTTP request to disallowed host: api.sandbox.test (CONNECT api.sandbox.test:443)"
    assert f"{line}\n" in log
    records = audit_of(network_service, result.body["execution_id"])
    blocked = sorted((r["host"], r["port"]) for r in records if r["event"] == "egress.blocked")
    assert blocked == [("127.0.0.2", port), ("api.sandbox.test", 443)]
    finished = next(r for r in records if r["event"] == "execution.finished")
    tunnels = finished["network"]["tunnels"]
    assert finished["network"]["allow"] == ["127.0.0.1"]
    assert (tunnels["opened"], tunnels["refused"]) == (0, 2)
    assert sorted((r["host"], r["port"]) for r in tunnels["refusals"]) == blocked


@pytest.mark.docker
@pytest.mark.security
@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("127.0.0.3", "an exact host ALLOW_HTTP_HOSTS does not list"),
        ("*.example.com", "a wildcard over another domain"),
        ("sandbox.test", "the root domain, which *.sandbox.test does not match"),
    ],
)
def test_network_pattern_that_would_widen_the_policy_is_a_400(run_net: RunNet, pattern: str, why: str) -> None:
    result = run_net("console.log('RAN')", ["127.0.0.1", pattern])
    assert result.status == 400, why
    assert result.body["pattern"] == pattern
    assert result.body["error"].startswith(f"Network pattern not allowed: {pattern} would widen")


@pytest.mark.docker
@pytest.mark.parametrize("pattern", ["https://127.0.0.1", "127.0.0.1:80", "*"])
def test_malformed_network_pattern_is_a_400(run_net: RunNet, pattern: str) -> None:
    result = run_net("console.log('RAN')", [pattern])
    assert result.status == 400
    assert result.body["error"].startswith(f"Invalid network.allow entry {pattern!r}")


@pytest.mark.docker
@pytest.mark.security
def test_without_network_every_attempt_fails_as_before(
    run_net: RunNet, network_service: Service, upstream: str, https_port: int
) -> None:
    port = port_of(upstream)
    result = run_net(
        f"""
        const report = (what) => (e) => console.log(what, (e.cause || e).code);
        fetch('http://127.0.0.1:{port}/').then(() => console.log('REACHED'), report('fetch'));
        require('http').get('http://127.0.0.1:{port}/', () => console.log('REACHED')).on('error', report('http'));
        require('https').get('https://127.0.0.1:{https_port}/', () => console.log('REACHED'))
          .on('error', report('https'));
        """
    )
    assert sorted(result.stdout.splitlines()) == ["fetch ECONNREFUSED", "http ECONNREFUSED", "https ECONNREFUSED"]
    finished = finished_record(network_service, result)
    assert finished["network"] is None
    assert finished["security"]["mounts"] == []


@pytest.mark.docker
@pytest.mark.security
def test_network_execution_has_only_loopback_no_raw_sockets_and_no_dns_of_its_own(run_net: RunNet) -> None:
    result = run_net(
        """
        const blocked = (name) => { try { require(name); return 'LOADED'; } catch (e) { return e.code; } };
        console.log(JSON.stringify(Object.keys(require('os').networkInterfaces())));
        console.log(['net', 'tls', 'dgram', 'http2'].map(blocked).join(' '));
        require('dns').promises.resolve4('api.sandbox.invalid').then(() => console.log('RESOLVED'),
          () => console.log('dns FAILED'));
        """,
        ["127.0.0.1"],
    )
    assert result.stdout.splitlines() == [
        '["lo"]',
        " ".join(["ERR_METAAGENT_BLOCKED_MODULE"] * 4),
        "dns FAILED",
    ]


@pytest.mark.docker
def test_byte_limit_cuts_the_tunnel(run_net: RunNet, network_service: Service, upstream: str) -> None:
    result = run_net(
        f"""
        fetch('http://127.0.0.1:{port_of(upstream)}/bytes?n={2 * MAX_TUNNEL_BYTES}')
          .then((r) => r.arrayBuffer())
          .then((b) => console.log('RECEIVED', b.byteLength), (e) => console.log('CUT', e.name));
        """,
        ["127.0.0.1"],
    )
    assert result.stdout == "CUT TypeError\n"
    finished = finished_record(network_service, result)
    tunnels = finished["network"]["tunnels"]
    assert tunnels["byte_limit_reached"]
    assert tunnels["bytes_to_upstream"] + tunnels["bytes_from_upstream"] <= MAX_TUNNEL_BYTES


@pytest.mark.docker
def test_tunnels_and_volume_are_gone_after_the_execution(
    run_net: RunNet, docker_client: docker.DockerClient, containers_of: Callable[[str], list[str]]
) -> None:
    with holding_server() as (port, upstream_closed):
        result = run_net(f"require('http').get('http://127.0.0.1:{port}/')", ["127.0.0.1"], timeout_s=2)
        assert result.timed_out
        assert upstream_closed.wait(30)
    execution_id = result.body["execution_id"]
    volumes = docker_client.volumes.list(filters={"label": f"org.metaagent.execution={execution_id}"})
    assert volumes == []
    assert containers_of(execution_id) == []


@pytest.mark.docker
def test_service_start_removes_volumes_left_by_a_dead_service(
    docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    labels = {"org.metaagent.service": "metaagent", "org.metaagent.execution": "exe_orphanvolume"}
    orphan = docker_client.volumes.create(labels={**labels, "org.metaagent.owner-pid": "999999999"})
    alive = docker_client.volumes.create(labels={**labels, "org.metaagent.owner-pid": str(os.getpid())})
    try:
        with serving(tmp_path, METAAGENT_SANDBOX_BUILD_ON_START="false"):
            for _ in range(100):
                if orphan.name not in volume_names(docker_client, "exe_orphanvolume"):
                    break
                time.sleep(0.1)
        assert volume_names(docker_client, "exe_orphanvolume") == [alive.name]
    finally:
        for volume in (orphan, alive):
            with contextlib.suppress(docker.errors.NotFound):
                volume.remove(force=True)


def volume_names(client: docker.DockerClient, execution_id: str) -> list[str]:
    found = client.volumes.list(filters={"label": f"org.metaagent.execution={execution_id}"})
    return [str(v.name) for v in found]


# --- the container of a network execution -------------------------------------------------------------


def run_node_with_a_tunnel(
    code: str, tmp_path: Path, limits: NetworkLimits | None = None
) -> tuple[Outcome, TunnelStats]:
    """`node -e code` in a sandbox container with a tunnel to 127.0.0.1, without the runner: what code
    that got past the module gate could do with the socket. The tunnel server runs in this process."""

    async def go() -> tuple[Outcome, TunnelStats]:
        engine = Engine()
        guard = EgressGuard(AllowList.of("127.0.0.1"), audit=AuditLog(tmp_path / "audit.jsonl"))
        sandbox_network = SandboxNetwork(engine, guard, limits or NetworkLimits(max_tunnels=2, max_bytes=1 << 20))
        execution = Execution(new_execution_id(), 10, 256)
        network = sandbox_network.for_execution(execution.execution_id, AllowList.of("127.0.0.1"))
        command = ["/usr/bin/node", "-e", code]
        spec = container_spec(execution.execution_id, image_tag(), 256, 0.5, network.mounts, command)
        try:
            async with network:
                outcome = await execute(engine, spec, b"", execution, timeout_s=10, grace_s=2, ready_marker=b"")
            return outcome, network.stats
        finally:
            engine.close()

    runner: Callable[[], Coroutine[Any, Any, tuple[Outcome, TunnelStats]]] = go
    return anyio.run(runner)


@pytest.mark.docker
@pytest.mark.security
def test_network_execution_reveals_no_host_path_outside_the_engine_data_root(
    network_service: Service, docker_client: docker.DockerClient, tmp_path: Path, upstream: str
) -> None:
    # Without the runner (`node -e`), so the program may read mountinfo and use net itself.
    code = f"""
        const fs = require('fs');
        const mounts = fs.readFileSync('/proc/self/mountinfo', 'utf8').trim().split('\\n')
          .map((line) => {{ const f = line.split(' '); return {{ root: f[3], at: f[4] }}; }});
        const interfaces = Object.keys(require('os').networkInterfaces());
        const routes = fs.readFileSync('/proc/net/route', 'utf8').trim().split('\\n').length - 1;
        const socket = require('net').connect('/run/metaagent/egress.sock');
        socket.on('connect', () => socket.write('127.0.0.1:{port_of(upstream)}\\n'));
        socket.once('data', (reply) => {{
          console.log(JSON.stringify({{ mounts, interfaces, routes, reply: String(reply), uid: process.getuid() }}));
          process.exit(0);
        }});
    """

    outcome, _stats = run_node_with_a_tunnel(code, tmp_path)
    assert outcome.exit_code == 0, outcome.stderr.text()
    report = json.loads(outcome.stdout.text())
    assert report["reply"] == "OK\n"  # uid 1001 reaches the socket through the read-only mount
    assert report["uid"] == 1001
    assert report["interfaces"] == ["lo"]
    assert report["routes"] == 0
    data_root = docker_client.info()["DockerRootDir"]
    docker_files = {"/etc/hostname", "/etc/hosts", "/etc/resolv.conf"}
    for mount in report["mounts"]:
        if mount["at"] in docker_files or mount["at"] in ("/run/metaagent", WIRE_DIR):  # the volumes
            assert mount["root"].startswith(f"{data_root}/"), mount
        elif mount["root"] != "/":
            assert mount["at"].startswith(("/proc", "/sys", "/dev")), mount
    assert any(m["at"] == "/run/metaagent" for m in report["mounts"])
    text = outcome.stdout.text()
    for host_path in ("/work/", "/root", str(tmp_path), "/var/cache/metaagent", "/tmp/"):
        assert host_path not in text


# --- floods: an execution's tunnels cost the service a bounded share of its event loop ---------------------

# The issue's flood: 64 loops, each opening a connection through the tunnel and closing it at once.
FLOOD_S = 3
RUNNER_FLOOD = """
const http = require('http');
let made = 0;
const end = Date.now() + FLOOD_MS;
function loop() {
  if (Date.now() > end) return;
  const req = http.get({ host: '127.0.0.1', port: PORT, path: '/', agent: false });
  req.on('socket', () => { made++; req.destroy(); });
  req.on('error', () => {});
  req.on('close', () => setImmediate(loop));
}
for (let i = 0; i < 64; i++) loop();
process.on('exit', () => console.log(made));
"""
# Without the runner, as code that got past the module gate would do it: raw connections to the socket.
RAW_FLOOD = """
const net = require('net');
const replies = {};
const end = Date.now() + FLOOD_MS;
function loop() {
  if (Date.now() > end) return;
  const c = net.connect('/run/metaagent/egress.sock');
  c.on('connect', () => c.write('127.0.0.1:PORT\\n'));
  const count = (code) => { replies[code] = (replies[code] || 0) + 1; };
  c.on('data', (d) => { count(String(d).split(' ', 2).join(' ').trim()); c.destroy(); });
  c.on('error', (e) => count(e.code));
  c.on('close', () => setImmediate(loop));
}
for (let i = 0; i < 64; i++) loop();
setTimeout(() => { console.log(JSON.stringify(replies)); process.exit(0); }, FLOOD_MS + 300);
"""
# Generous: the flood measured 0.85 of a core before the budgets, about 0.07 with them.
MAX_CPU_PER_WALL_S = 0.35


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood_code(template: str, port: int) -> str:
    return template.replace("FLOOD_MS", str(FLOOD_S * 1000)).replace("PORT", str(port))


@pytest.mark.docker
@pytest.mark.security
def test_a_flood_of_tunnels_is_held_to_the_execution_rate_and_a_bounded_share_of_the_service_cpu(
    run_net: RunNet, network_service: Service
) -> None:
    metrics_before = samples(network_service.get("/metrics").text)
    with closing_server() as port:
        cpu_before, started = cpu_seconds(network_service.pid), time.monotonic()
        result = run_net(flood_code(RUNNER_FLOOD, port), ["127.0.0.1"], timeout_s=FLOOD_S + 7)
        cpu_used, wall_s = cpu_seconds(network_service.pid) - cpu_before, time.monotonic() - started
    metrics_after = samples(network_service.get("/metrics").text)
    assert result.exit_code == 0, result.body
    tunnels = finished_record(network_service, result)["network"]["tunnels"]
    rate = DEFAULT_TUNNEL_RATE
    # The token bucket's bound over the request's wall time: its burst, the connections that may wait
    # for a token, and the rate. Before the budgets, this flood opened over 1,800 tunnels a second.
    assert tunnels["accepted"] <= rate * BURST_S + 8 + rate * wall_s, (tunnels, wall_s)
    assert tunnels["accepted"] >= rate * BURST_S  # and it was a flood: at least the burst went through
    assert tunnels["opened"] == int(result.stdout)  # every connection the program saw was a tunnel
    assert tunnels["rate_refused"] == 0  # the runner keeps its connections within what may wait: slowed, not refused
    assert cpu_used / wall_s <= MAX_CPU_PER_WALL_S, (cpu_used, wall_s)

    def delta(name: str, label: tuple[str, str]) -> float:
        key = (name, (label,))
        return metrics_after.get(key, 0.0) - metrics_before.get(key, 0.0)

    assert delta("metaagent_tunnel_operations_total", ("phase", "accept")) == tunnels["accepted"]
    assert delta("metaagent_tunnel_operations_total", ("phase", "check")) == tunnels["accepted"]
    assert delta("metaagent_tunnel_waits_total", ("phase", "check")) > 0  # the rate held it back
    assert delta("metaagent_tunnel_execution_operations_count", ("phase", "accept")) == 1


@pytest.mark.docker
@pytest.mark.security
def test_a_raw_socket_flood_past_the_runner_is_held_to_the_accept_budget_and_refused_past_the_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    limits = NetworkLimits(max_tunnels=8, max_bytes=1 << 20)
    with closing_server() as port:
        cpu_before, started = sum(os.times()[:2]), time.monotonic()
        outcome, stats = run_node_with_a_tunnel(flood_code(RAW_FLOOD, port), tmp_path, limits)
        cpu_used, wall_s = sum(os.times()[:2]) - cpu_before, time.monotonic() - started
    assert outcome.exit_code == 0, outcome.stderr.text()
    replies = json.loads(outcome.stdout.text())
    accepts = DEFAULT_TUNNEL_RATE * ACCEPTS_PER_TUNNEL
    assert stats.accepted <= accepts * BURST_S + accepts * wall_s, (stats.record(), wall_s)
    assert stats.rate_refused > 0
    assert replies["ERR ERR_METAAGENT_TUNNEL_RATE"] <= stats.rate_refused
    assert replies.get("EAGAIN", 0) > 0  # the rest waited in, or bounced off, the kernel's backlog
    # Every refusal is counted; at most MAX_REFUSALS have a line each, and one line sums up the rest.
    assert stats.refused + stats.opened + stats.failed <= stats.accepted
    lines = [r.getMessage() for r in caplog.records if r.name == "metaagent.tunnel"]
    assert len(lines) <= MAX_REFUSALS + 1
    assert lines[-1].endswith(
        f"{stats.rate_refused} past the rate of 50 new tunnels per second, "
        f"{stats.capped - MAX_REFUSALS} after its first 50 refusals"
    )
    assert cpu_used / wall_s <= MAX_CPU_PER_WALL_S, (cpu_used, wall_s)


# --- the service's side, without containers ---------------------------------------------------------------


def test_an_execution_list_may_narrow_the_service_list(tmp_path: Path) -> None:
    guard = EgressGuard(AllowList.of("*.example.com", "127.0.0.1"))
    network = SandboxNetwork(Engine(), guard, NetworkLimits(8, 1 << 20))
    narrowed = network.allowlist_for(["api.example.com", "*.eu.example.com", "127.0.0.1"])
    assert narrowed.patterns == ("api.example.com", "*.eu.example.com", "127.0.0.1")
    with pytest.raises(RequestRefused, match=r"^Network pattern not allowed: example\.com would widen"):
        network.allowlist_for(["example.com"])


def test_extra_ca_certs_keep_only_the_certificates(tmp_path: Path, sandbox_ca: trustme.CA) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(sandbox_ca.cert_pem.bytes() + sandbox_ca.private_key_pem.bytes())
    pem = read_extra_ca_certs(bundle)
    assert pem.strip() == sandbox_ca.cert_pem.bytes().strip()
    assert b"PRIVATE KEY" not in pem


@pytest.mark.parametrize(("content", "message"), [(None, "cannot read"), (b"not a pem", "holds no PEM certificate")])
def test_unusable_extra_ca_certs_refuse_the_configuration(tmp_path: Path, content: bytes | None, message: str) -> None:
    bundle = tmp_path / "bundle.pem"
    if content is not None:
        bundle.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_extra_ca_certs(bundle)
