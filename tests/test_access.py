"""Access: API keys in front of every route, loopback by default, refusal to listen publicly without keys."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time
from pathlib import Path

import anyio
import httpx2
import pytest

from metaagent.access import ExecutionQuota, KeyRing, key_id
from metaagent.app import TOOLS, create_app
from metaagent.errors import AtCapacity, ConfigError
from metaagent.fleet.state import LocalState
from metaagent.tenancy import Caller
from metaagent.tools.code_interpreter import Admission
from tests.conftest import ServiceFactory, make_settings
from tests.live_service import serving as serving_app
from tests.test_cli import METAAGENT, clean_env, free_port, run, serving
from tests.test_mcp import INITIALIZE, MCP_HEADERS

pytestmark = pytest.mark.security

ALICE = "alice-0123456789abcdef0123456789"
BOB = "bob-fedcba9876543210fedcba98765"
KEYS = f"alice:{ALICE},{BOB}"
BOB_ID = "key_" + hashlib.sha256(BOB.encode()).hexdigest()[:8]

PROTECTED = [
    ("GET", "/tools"),
    ("GET", "/executions"),
    ("GET", "/executions/exe_x"),
    ("DELETE", "/executions/exe_x"),
    ("POST", "/tools/http"),
    ("POST", "/tools/code-interpreter"),
    ("POST", "/tools/search"),
    ("POST", "/tools/embeddings"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/metrics"),
    ("POST", "/mcp"),
]


def test_keys_are_read_from_json_comma_text_and_files_with_names_or_hashed_ids(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# operators\nci:{'c' * 20}:admin\n\n{'d' * 20}\n")
    ring = KeyRing.from_settings(
        make_settings(tmp_path, api_keys=f'["alice:{ALICE}", "{BOB}"]', api_keys_file=key_file)
    )
    assert ring.key_ids == ["alice", BOB_ID, "ci", key_id("d" * 20)]
    assert ring.identify(ALICE) == Caller("alice")
    assert ring.identify(BOB) == Caller(BOB_ID)
    assert ring.identify("d" * 20) == Caller(key_id("d" * 20))
    assert ring.identify("c" * 20) == Caller("ci", operator=True)  # `name:key:admin`: an operator's key
    assert ring.identify("c" * 20 + ":admin") is None
    assert ring.identify(ALICE + "x") is None
    assert ring.identify("") is None
    same = KeyRing.from_settings(make_settings(tmp_path, api_keys=f"@{key_file}"))
    assert same.key_ids == ["ci", key_id("d" * 20)]
    assert KeyRing.from_settings(make_settings(tmp_path, api_keys=KEYS)).key_ids == ["alice", BOB_ID]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("short", "at least 16 visible ASCII characters"),
        (f"{ALICE},,{BOB}", "entry 2 is empty"),
        (f"bad name:{ALICE}", "a name before ':' may hold only"),
        (f"{ALICE},{ALICE}", "listed twice"),
        (f'["{ALICE}",', "not a valid JSON array"),
        ("@/nonexistent/keys", "cannot read the API key file /nonexistent/keys"),
    ],
)
def test_malformed_keys_are_refused_without_quoting_them(tmp_path: Path, value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        KeyRing.from_settings(make_settings(tmp_path, api_keys=value))
    assert problem in str(caught.value)
    assert ALICE not in str(caught.value)


def test_serve_with_a_malformed_key_exits_2_and_never_prints_the_key(tmp_path: Path) -> None:
    result = run(tmp_path, "serve", METAAGENT_API_KEYS="alice:too-short-key")
    assert result.returncode == 2
    assert "METAAGENT_API_KEYS is malformed" in result.stderr
    assert "too-short-key" not in result.stderr


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_every_route_but_health_answers_401_without_a_key(
    service: ServiceFactory, method: str, path: str
) -> None:
    async with service(api_keys=KEYS) as client:
        response = await client.request(method, path, json={})
    assert response.status_code == 401
    assert response.json() == {"error": "Missing API key: send it as 'Authorization: Bearer <key>'"}
    assert response.headers["www-authenticate"] == 'Bearer realm="metaagent"'


@pytest.mark.parametrize("header", [f"Bearer {ALICE}x", "Bearer ", f"Basic {ALICE}", ALICE])
async def test_a_wrong_key_or_scheme_is_401_invalid_token(service: ServiceFactory, header: str) -> None:
    async with service(api_keys=KEYS) as client:
        response = await client.get("/tools", headers={"Authorization": header})
    assert response.status_code == 401
    assert response.json()["error"].startswith("Invalid API key")
    assert response.headers["www-authenticate"] == 'Bearer realm="metaagent", error="invalid_token"'
    assert ALICE not in response.text


async def test_health_is_open_for_probes_and_everything_else_opens_with_a_key(service: ServiceFactory) -> None:
    async with service(api_keys=KEYS) as client:
        health = await client.get("/health")
        tools = await client.get("/tools", headers={"Authorization": f"Bearer {ALICE}"})
        blocked = await client.post(
            "/tools/http", json={"url": "https://example.com/"}, headers={"Authorization": f"bearer {BOB}"}
        )
        metrics = await client.get("/metrics", headers={"Authorization": f"Bearer {BOB}"})
    assert health.status_code == 200
    assert set(health.json()) == {"status"}  # without a key, the status alone
    assert tools.status_code == 200
    assert [t["name"] for t in tools.json()["tools"]] == [spec.name for spec in TOOLS]
    assert blocked.status_code == 400  # past the key check, stopped by the allow-list
    assert metrics.status_code == 403  # service-wide figures: an operator's key only


async def test_a_service_without_keys_asks_for_none(service: ServiceFactory) -> None:
    async with service() as client:
        assert (await client.get("/tools")).status_code == 200


async def test_mcp_over_http_needs_a_key_and_works_with_one(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path, api_keys=KEYS))
    with serving_app(app) as url, anyio.fail_after(30):
        async with httpx2.AsyncClient(base_url=url, timeout=10) as client:
            refused = await client.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS)
            wrong = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Authorization": "Bearer x"})
            accepted = await client.post(
                "/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Authorization": f"Bearer {ALICE}"}
            )
    assert refused.status_code == 401
    assert wrong.status_code == 401
    assert accepted.status_code == 200
    assert "serverInfo" in accepted.text


async def test_per_key_quota_refuses_past_its_limit_and_frees_on_exit() -> None:
    quota = ExecutionQuota(LocalState(), limit=2)
    async with quota.hold("alice"), quota.hold("alice"):
        with pytest.raises(AtCapacity) as caught:
            async with quota.hold("alice"):
                pass
        assert caught.value.retry_after_s > 0
        assert "Key alice already has 2 executions" in caught.value.message
        async with quota.hold("bob"), quota.hold(None), quota.hold(None):
            with pytest.raises(AtCapacity, match="This caller already has 2 executions"):
                async with quota.hold(None):
                    pass
    async with quota.hold("alice"), quota.hold("alice"):  # both of alice's places were given back
        pass


def _listening_addresses(pid: int, port: int) -> set[str]:
    """Local addresses on which process `pid` listens on `port`, from /proc (IPv4 and IPv6 tables)."""
    found: set[str] = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_serve_listens_only_on_loopback_by_default(tmp_path: Path) -> None:
    with serving(tmp_path) as (base, process):
        port = int(base.rsplit(":", 1)[1])
        assert _listening_addresses(process.pid, port) == {"0100007F"}  # 127.0.0.1, little-endian hex


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "service.example"])
def test_serve_refuses_to_listen_beyond_loopback_without_keys(tmp_path: Path, host: str) -> None:
    result = run(tmp_path, "serve", "--host", host, "--port", str(free_port()))
    assert result.returncode == 2
    assert f"refusing to start: --host {host} is reachable from other machines, and no API keys are set" in (
        result.stderr
    )
    assert "Set METAAGENT_API_KEYS" in result.stderr


def test_serve_with_keys_listens_publicly_and_still_asks_for_a_key(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [*METAAGENT, "serve", "--host", "0.0.0.0", "--port", str(port)],
        cwd=tmp_path,
        env=clean_env(tmp_path, METAAGENT_API_KEYS=KEYS),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(300):  # until it answers, and its start-up checks have run (no more 503 starting)
            try:
                health = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if health.json() != {"status": "starting"}:
                    break
            except httpx2.TransportError:
                pass
            assert process.poll() is None
            time.sleep(0.1)
        assert health.status_code == 200
        assert _listening_addresses(process.pid, port) == {"00000000"}  # 0.0.0.0
        assert httpx2.get(f"http://127.0.0.1:{port}/tools", timeout=5).status_code == 401
        ok = httpx2.get(f"http://127.0.0.1:{port}/tools", headers={"Authorization": f"Bearer {ALICE}"}, timeout=5)
        assert ok.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert ALICE not in stderr
    assert "refused GET /tools from 127.0.0.1: no API key" in stderr


OPS = "ops-4f1e9a7c2b8d0e6f3a5c"
TENANT_KEYS = f"{KEYS},ops:{OPS}:admin"


async def test_health_without_a_key_says_only_the_status_and_a_tenant_sees_no_service_wide_counts(
    service: ServiceFactory,
) -> None:
    """The finding: without a key, /health showed the whole service's running and queued counts."""
    async with service(api_keys=TENANT_KEYS) as client:
        anonymous = await client.get("/health")
        tenant = await client.get("/health", headers={"Authorization": f"Bearer {ALICE}"})
        operator = await client.get("/health", headers={"Authorization": f"Bearer {OPS}"})
        wrong = await client.get("/health", headers={"Authorization": f"Bearer {ALICE}x"})
    assert anonymous.status_code == 200
    assert set(anonymous.json()) == {"status"}
    assert anonymous.json()["status"] == operator.json()["status"]

    checks = tenant.json()["checks"]
    assert set(checks) == set(operator.json()["checks"])  # every check, for every caller with a key
    assert checks["executions"] == {"ok": True, "capacity": checks["executions"]["capacity"], "yours": 0}
    assert not {"ready", "size", "served"} & set(checks["warm_pool"])  # they follow other tenants' demand
    assert {"running", "queued"} <= set(operator.json()["checks"]["executions"])
    assert {"ready", "size", "served"} <= set(operator.json()["checks"]["warm_pool"])
    assert wrong.status_code == 401  # a key sent to /health is checked as anywhere else


async def test_a_service_without_keys_shows_its_one_caller_every_figure(service: ServiceFactory) -> None:
    async with service() as client:
        health = await client.get("/health")
        metrics = await client.get("/metrics")
    assert {"running", "queued"} <= set(health.json()["checks"]["executions"])
    assert metrics.status_code == 200


async def test_metrics_needs_an_operators_key(service: ServiceFactory) -> None:
    """The finding: every key read the whole service's /metrics."""
    async with service(api_keys=TENANT_KEYS) as client:
        tenant = await client.get("/metrics", headers={"Authorization": f"Bearer {ALICE}"})
        operator = await client.get("/metrics", headers={"Authorization": f"Bearer {OPS}"})
    assert tenant.status_code == 403
    assert tenant.json()["error"].startswith("GET /metrics shows the whole service's figures")
    assert "metaagent_executions" not in tenant.text
    assert operator.status_code == 200
    assert "metaagent_executions_running" in operator.text


async def test_a_429_at_capacity_gives_no_count_of_other_tenants_work() -> None:
    """The finding: 'At capacity: 4 executions running and 32 queued' told a tenant the service's load."""
    admission = Admission(capacity=3, queue_size=0)
    async with admission.slot(), admission.slot(), admission.slot():
        with pytest.raises(AtCapacity) as caught:
            async with admission.slot():
                pass
    assert caught.value.message == (
        "At capacity: every execution slot of the service is busy and its queue "
        "(METAAGENT_EXECUTION_QUEUE_SIZE) is full; retry shortly"
    )
