"""Fleet nodes on one machine: each a network namespace with its own dockerd, its own replica and its own
copy of the sandbox image, joined to the others by veth pairs on a bridge; one redis-server for all.

    switch namespace: bridge br0
      ├── veth ── node a's namespace: eth0 10.213.0.1/24, lo; dockerd, `metaagent serve` on 0.0.0.0:3102
      ├── veth ── node b's namespace: eth0 10.213.0.2/24, ...
      └── ...

Every interface is created inside the namespaces (`ip -n`), never in the host's, and deleting the
namespaces at the end deletes them. The addresses exist only inside those namespaces. Redis listens on a
unix socket, which every namespace reaches through the file system. The test reaches each replica
through a unix socket too: a small relay inside the node's namespace (`tests/uds_relay.py`) passes its
connections to the replica's 127.0.0.1:3102 there. Everything started is stopped by its pid, and nothing
touches an engine that this module did not start.

`python -m tests.fleet_nodes` runs a demonstration with three nodes (see README, "More than one machine").
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import docker
import httpx2

from metaagent.languages.javascript.image import image_tag
from tests.redis_server import RedisServer
from tests.sandbox.private_engine import PrivateEngine, in_netns
from tests.test_cli import METAAGENT, clean_env

SUBNET = "10.213.0"
PORT = 3102
START_TIMEOUT_S = 300
RELAY = Path(__file__).with_name("uds_relay.py")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Node:
    name: str
    namespace: str
    address: str
    root: Path
    engine: PrivateEngine
    replica: subprocess.Popen[bytes] | None = None
    relay: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Where the other replicas reach this one (its METAAGENT_NODE_URL)."""
        return f"http://{self.address}:{PORT}"

    @property
    def socket(self) -> Path:
        return self.root / "api.sock"

    @property
    def log(self) -> Path:
        return self.root / "replica.log"

    def client(self, key: str | None = None, timeout: float = 120) -> httpx2.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx2.HTTPTransport(uds=str(self.socket))
        return httpx2.Client(transport=transport, base_url="http://127.0.0.1", headers=headers, timeout=timeout)

    def async_transport(self) -> httpx2.AsyncHTTPTransport:
        return httpx2.AsyncHTTPTransport(uds=str(self.socket))

    def start_replica(self) -> None:
        with self.log.open("ab") as log:
            self.replica = subprocess.Popen(
                [*in_netns(self.namespace), *METAAGENT, "serve", "--host", "0.0.0.0", "--port", str(PORT)],
                cwd=self.root, env=self.env, stdout=log, stderr=log,
            )  # fmt: skip

    def wait_ready(self, key: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client(key, timeout=10) as client:
            while True:
                assert self.replica is not None
                assert self.replica.poll() is None, self.log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"node {self.name} was not ready: {self.log.read_text()[-3000:]}"
                if not _accepts(self.socket):  # first: httpx leaks the socket of a unix connect that fails
                    time.sleep(0.2)
                    continue
                try:
                    checks = client.get("/health").json().get("checks")
                    if checks and checks["sandbox_image"]["ok"] and checks["container_engine"]["runtime"]:
                        return
                except (httpx2.TransportError, ValueError):
                    pass
                time.sleep(0.2)

    def kill(self) -> None:
        """kill -9 of the replica, as a machine that dies would leave it (its containers stay)."""
        if self.replica is not None and self.replica.poll() is None:
            self.replica.send_signal(signal.SIGKILL)
            self.replica.wait(30)

    def stop(self) -> None:
        for process in (self.replica, self.relay):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(30)


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


@dataclass
class Fleet:
    nodes: list[Node]
    redis: RedisServer
    token: str


def _engine_config() -> dict[str, object]:
    """The host engine's registered runtimes (runsc, where it is), so that each node chooses as it would."""
    try:
        runtimes = json.loads(Path("/etc/docker/daemon.json").read_text()).get("runtimes")
    except (OSError, ValueError):
        runtimes = None
    return {"runtimes": runtimes} if runtimes else {}


@contextmanager
def fleet_nodes(source: docker.DockerClient, count: int, keys: str, **env: str) -> Iterator[Fleet]:
    """`count` nodes (a, b, c, ...) sharing one Redis, each replica started with `env` and these API keys,
    ready when this yields. `source` is the engine the sandbox image is copied from."""
    tag = secrets.token_hex(3)
    switch = f"ma{tag}-sw"
    base = Path(tempfile.mkdtemp(prefix=f"maf{tag}-", dir="/tmp"))  # short: socket paths
    token = secrets.token_urlsafe(32)
    nodes: list[Node] = []
    namespaces: list[str] = []
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        stack.callback(_delete_namespaces, namespaces)  # after everything in them stopped; takes their veths
        redis = RedisServer(base)
        redis.start()
        stack.callback(redis.stop)

        _ip("netns", "add", switch)
        namespaces.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index in range(count):
            name = "abcdefgh"[index]
            namespace = f"ma{tag}-{name}"
            _ip("netns", "add", namespace)
            namespaces.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{name}", "netns", switch)
            _ip("-n", switch, "link", "set", f"p{name}", "master", "br0", "up")
            address = f"{SUBNET}.{index + 1}"
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            root = base / name
            root.mkdir()
            engine = PrivateEngine(root, netns=namespace, config=_engine_config())
            node = Node(name, namespace, address, root, engine)
            nodes.append(node)

        for node in nodes:  # each engine: started, given the image, emptied and stopped at the end
            node.engine.start()
            stack.callback(_stop_engine, node.engine)
            node.engine.load_image(source, image_tag())
        for node in nodes:
            node.env = clean_env(
                node.root,
                DOCKER_HOST=node.engine.url,
                XDG_STATE_HOME=str(node.root / "state"),
                METAAGENT_LANGUAGES="javascript",
                METAAGENT_SANDBOX_BUILD_ON_START="false",
                METAAGENT_API_KEYS=keys,
                METAAGENT_REDIS_URL=redis.url,
                METAAGENT_NODE_URL=node.url,
                METAAGENT_FLEET_TOKEN=token,
                **env,
            )
            with (node.root / "relay.log").open("ab") as log:
                relay = [sys.executable, str(RELAY), str(node.socket), "127.0.0.1", str(PORT)]
                node.relay = subprocess.Popen([*in_netns(node.namespace), *relay], stdout=log, stderr=log)
            stack.callback(node.stop)
            node.start_replica()
        first_key = keys.split(",")[0].split(":")[1]
        for node in nodes:
            node.wait_ready(first_key)
        yield Fleet(nodes, redis, token)


def _delete_namespaces(namespaces: list[str]) -> None:
    for namespace in namespaces:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30, check=False)


def _stop_engine(engine: PrivateEngine) -> None:
    """Removes every container the engine holds (what a killed replica left too), then stops it."""
    try:
        if engine.answers():
            client = docker.DockerClient(base_url=engine.url, version="1.41", timeout=30)
            try:
                for container in client.containers.list(all=True, sparse=True):
                    container.remove(force=True)
            finally:
                client.close()
    finally:
        engine.stop()


def demo() -> None:  # pragma: no cover - a demonstration for people, run by hand
    """Three nodes; a session opened on a, used through b and c; its replica killed; what c says then."""
    keys = "alice:" + secrets.token_urlsafe(24)
    alice = keys.split(":")[1]
    source = docker.from_env()
    with fleet_nodes(source, 3, keys, METAAGENT_POOL_SIZE="1") as fleet:
        a, b, c = fleet.nodes
        print(f"nodes: {', '.join(f'{n.name} at {n.url} in netns {n.namespace}' for n in fleet.nodes)}")
        with a.client(alice) as on_a, b.client(alice) as on_b, c.client(alice) as on_c:
            session = on_a.post("/sessions", json={}).json()["session_id"]
            print(f"a: POST /sessions -> {session}")
            answer = on_b.post(f"/sessions/{session}/execute", json={"code": "globalThis.n = 20; n + 1"}).json()
            print(f"b: execute 'globalThis.n = 20; n + 1' -> result {answer['result']}")
            answer = on_c.post(f"/sessions/{session}/execute", json={"code": "n * 2"}).json()
            print(f"c: execute 'n * 2' -> result {answer['result']}")
            print(f"c: GET /sessions -> {[s['session_id'] for s in on_c.get('/sessions').json()['sessions']]}")
            print(f"c: GET /health -> checks.fleet {on_c.get('/health').json()['checks']['fleet']}")
            a.kill()
            print("a: kill -9")
            killed = time.monotonic()
            while (gone := on_c.get(f"/sessions/{session}")).status_code != 410:
                time.sleep(0.5)
            print(f"c: GET /sessions/{session} after {time.monotonic() - killed:.0f} s -> 410 {gone.json()}")


if __name__ == "__main__":
    demo()
