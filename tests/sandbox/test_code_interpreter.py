"""`POST /tools/code-interpreter` end to end: the real service, the real engine, a fresh container each."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import docker as docker_sdk
import httpx2
import pytest

from metaagent.languages.javascript.image import image_tag
from metaagent.sandbox.runtime import RUNC, Runtime
from tests.sandbox.conftest import (
    HOST_SECRET,
    Result,
    RunJs,
    Service,
    audit_record,
    audited,
    code_runner,
    owned_containers,
)
from tests.sandbox.test_cpu_weight import cpu_limits
from tests.test_cli import serving

pytestmark = pytest.mark.docker

BENIGN = {
    "json": ("console.log(JSON.stringify({a: [1, 2, {b: null}]}))", '{"a":[1,2,{"b":null}]}\n'),
    "promises": ("Promise.all([1, Promise.resolve(2)]).then((v) => console.log(v.join('+')))", "1+2\n"),
    "async_await": (
        "const wait = (ms) => new Promise((r) => setTimeout(r, ms));"
        "(async () => { await wait(10); console.log('awaited'); })()",
        "awaited\n",
    ),
    "timers": (  # each timer set by the one before: the order holds however slowly the container runs
        "setImmediate(() => { console.log('a'); setTimeout(() => { console.log('b');"
        " const i = setInterval(() => { console.log('c'); clearInterval(i); }, 10); }, 20); })",
        "a\nb\nc\n",
    ),
    "buffer": ("console.log(Buffer.from('héllo').toString('base64'))", "aMOpbGxv\n"),
    "crypto": (
        "console.log(require('crypto').createHash('sha256').update('abc').digest('hex'))",
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\n",
    ),
    "url": (
        "const u = new URL('https://a.example/p?q=1#f'); console.log(u.host, u.searchParams.get('q'))",
        "a.example 1\n",
    ),
    "text_encoder": (
        "console.log(new TextEncoder().encode('€').length, new TextDecoder().decode(new Uint8Array([226, 130, 172])))",
        "3 €\n",
    ),
    "unicode_output": ("console.log('日本語 🚀 Ωmega')", "日本語 🚀 Ωmega\n"),
    "user_info": ("const u = require('os').userInfo(); console.log(u.username, u.uid)", "sandbox 1001\n"),
    "intl": ("console.log(new Intl.NumberFormat('de-DE').format(1234567.891))", "1.234.567,891\n"),
    "class_and_generators": (
        "class A { *g() { yield 1; yield 2; } } console.log([...new A().g()].length)",
        "2\n",
    ),
}


@pytest.mark.parametrize("name", sorted(BENIGN))
def test_benign_program_works(run_js_both: RunJs, name: str) -> None:
    code, expected = BENIGN[name]
    result = run_js_both(code)
    assert result.status == 200, result.body
    assert result.stdout == expected, result.stderr
    assert result.exit_code == 0
    assert result.body["timed_out"] is False


def test_stdin_reaches_the_program(run_js_both: RunJs) -> None:
    code = """
    const lines = [];
    require('readline').createInterface({input: process.stdin})
      .on('line', (l) => lines.push(l.toUpperCase()))
      .on('close', () => console.log(lines.join(',')));
    """
    assert run_js_both(code, stdin="one\ntwo\nthree\n").stdout == "ONE,TWO,THREE\n"


def test_thrown_error_is_a_200_with_nonzero_exit_and_the_stack(run_js_both: RunJs) -> None:
    result = run_js_both("function f() { throw new TypeError('boom') }\nf()")
    assert result.status == 200
    assert result.exit_code == 1
    assert "TypeError: boom" in result.stderr
    assert "/app/main.js:1" in result.stderr


def test_process_exit_code_is_reported(run_js_both: RunJs) -> None:
    assert run_js_both("console.log('bye'); process.exit(7)").exit_code == 7


@pytest.mark.security
def test_endless_loop_is_stopped_by_sigterm_at_the_timeout(
    run_js_both: RunJs, containers_of: Callable[[str], list[str]]
) -> None:
    result = run_js_both("for (;;) {}", timeout_s=1)
    assert result.timed_out
    assert result.exit_code == 143  # SIGTERM, forwarded by dumb-init: the grace period was not needed
    assert result.body["duration_ms"] >= 1000
    assert containers_of(result.body["execution_id"]) == []


@pytest.mark.security
def test_program_ignoring_sigterm_is_killed_after_the_grace_period(run_js_both: RunJs) -> None:
    result = run_js_both("process.on('SIGTERM', () => console.log('ignoring')); for (;;) {}", timeout_s=1)
    assert result.timed_out
    assert result.exit_code == 137  # SIGKILL
    assert result.body["duration_ms"] >= 6000  # timeout_s + the 5 s grace period


@pytest.mark.security
def test_event_loop_starvation_cannot_dodge_the_timeout(run_js_both: RunJs) -> None:
    result = run_js_both("const spin = () => Promise.resolve().then(spin); spin()", timeout_s=1)
    assert result.timed_out


def test_the_runner_starts_from_the_images_snapshot_for_its_memory_size_and_without_one_otherwise(
    run_js_both: RunJs, cold_service: Service
) -> None:
    # Every other test of this file runs its programs, the hostile ones included, on the snapshot (256 MB).
    # (The heap limit it was built with holds: test_allocation_heavy_program_fails_with_a_heap_error_or_oom.)
    show = "console.log(JSON.stringify(process.execArgv))"
    snapshotted = run_js_both(show)
    assert snapshotted.exit_code == 0, snapshotted.stderr
    flags = json.loads(snapshotted.stdout)
    assert "--snapshot-blob=/opt/metaagent/runner-256m.blob" in flags
    assert "--max-old-space-size=192" in flags
    plain = code_runner(cold_service, "cold")(show, memory_mb=300)  # no snapshot of that size: from the files
    assert plain.exit_code == 0, plain.stderr
    flags = json.loads(plain.stdout)
    assert not [flag for flag in flags if flag.startswith("--snapshot-blob")]
    assert "--max-old-space-size=225" in flags


@pytest.mark.security
def test_allocation_heavy_program_fails_with_a_heap_error_or_oom(run_js_both: RunJs) -> None:
    result = run_js_both("const keep = []; for (;;) keep.push(new Array(1e6).fill(Math.random()))")
    assert result.status == 200
    assert result.exit_code != 0
    assert result.body["oom_killed"] or "heap out of memory" in result.stderr


@pytest.mark.security
def test_memory_hog_outside_the_heap_is_oom_killed(run_js_both: RunJs) -> None:
    # It ends at the memory limit long before the timeout; the timeout only has to outlast a slow fill
    # (gVisor's ptrace platform at 0.5 CPU on a loaded machine).
    result = run_js_both("const keep = []; for (;;) keep.push(Buffer.alloc(8 << 20, 1))", timeout_s=30)
    assert result.exit_code == 137, result.body
    assert result.body["timed_out"] is False
    assert result.body["oom_killed"] is True, result.body  # CI runs this again under runc (scripts/test)


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


@pytest.mark.security
def test_output_flood_is_truncated_with_a_marker_while_the_service_stays_small(sandbox_service: Service) -> None:
    run_js = code_runner(sandbox_service)  # the RSS measured is this service's
    run_js("console.log('warm-up')")
    before = _rss_kib(sandbox_service.pid)
    # ~200 MB on stdout and stderr, written around any JavaScript wrapper by process._rawDebug too.
    code = """
    const line = 'x'.repeat(1 << 20);
    for (let i = 0; i < 150; i++) process.stdout.write(line);
    for (let i = 0; i < 50; i++) process._rawDebug(line);
    """
    result = run_js(code, timeout_s=30)
    after = _rss_kib(sandbox_service.pid)
    assert result.body["stdout_truncated"] is True
    assert result.body["stderr_truncated"] is True
    assert "[output truncated: 157286400 bytes produced, the first 51200 shown]" in result.stdout
    assert len(result.stdout.encode()) < 52 * 1024
    assert len(result.stderr.encode()) < 27 * 1024
    assert after - before < 64 * 1024  # KiB: the flood was counted, not kept


FOREVER_FLOODS = {
    "sync-write": "const chunk = 'x'.repeat(1 << 16); for (;;) process.stdout.write(chunk);",
    "console-log": "for (let i = 0; ; i++) console.log('line', i, 'y'.repeat(1000));",
    "async-write": "const chunk = 'z'.repeat(1 << 16);"
    " (function more() { process.stdout.write(chunk); setImmediate(more); })();",
    "stderr": "const chunk = 'e'.repeat(1 << 16); for (;;) process.stderr.write(chunk);",
}


@pytest.mark.security
@pytest.mark.parametrize("code", FOREVER_FLOODS.values(), ids=FOREVER_FLOODS.keys())
def test_a_program_that_floods_forever_ends_at_its_deadline_with_capped_output(run_js_both: RunJs, code: str) -> None:
    # Output written faster than the service reads it must wait in the pipe, not pile up in the process:
    # the program runs until its deadline rather than dying early of a full heap.
    result = run_js_both(code, timeout_s=2)
    assert result.timed_out, result
    assert not result.body["oom_killed"]
    assert "heap out of memory" not in result.stderr
    assert result.body["stdout_truncated"] or result.body["stderr_truncated"]


def test_truncation_never_splits_a_character(run_js_both: RunJs) -> None:
    result = run_js_both("process.stdout.write('€'.repeat(40000))")  # 120,000 bytes of 3-byte characters
    kept = result.stdout.split("\n[output truncated")[0]
    assert set(kept) == {"€"}
    assert "\ufffd" not in result.stdout


@pytest.mark.security
def test_environment_holds_no_host_secret(run_js_both: RunJs) -> None:
    result = run_js_both("console.log(JSON.stringify(process.env))")
    env = json.loads(result.stdout)
    assert HOST_SECRET not in result.stdout
    assert not {"OPENAI_API_KEY", "SERPER_API_KEY", "METAAGENT_TEST_SECRET"} & set(env)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"code": "1", "timeout_s": 0}, "timeout_s"),
        ({"code": "1", "timeout_s": 301}, "timeout_s"),
        ({"code": "1", "memory_mb": 2048}, "memory_mb"),
        ({"code": "1", "memory_mb": 32}, "memory_mb"),
        ({"code": ""}, "code"),
        ({"code": "1", "unknown": True}, "unknown"),
        ({"timeout_s": 5}, "code"),
    ],
)
def test_invalid_fields_get_a_422_naming_the_field(
    sandbox_service: Service, body: dict[str, object], field: str
) -> None:
    response = sandbox_service.post("/tools/code-interpreter", body)
    assert response.status_code == 422
    assert field in response.json()["error"]


def test_every_execution_gets_a_fresh_container_that_is_removed(
    run_js_both: RunJs, containers_of: Callable[[str], list[str]]
) -> None:
    first, second = run_js_both("console.log(require('os').hostname())"), run_js_both("console.log(1)")
    assert first.body["execution_id"] != second.body["execution_id"]
    assert containers_of(first.body["execution_id"]) == []
    assert containers_of(second.body["execution_id"]) == []


def test_every_execution_writes_an_audit_record_with_its_security_context(
    sandbox_service: Service, sandbox_runtime: Runtime
) -> None:
    # The process limit: the pids cgroup under runc; under runsc RLIMIT_NPROC in gVisor's kernel, and a
    # cgroup with room for gVisor's own host threads (sandbox/runtime.py).
    process_limit = {"pids_limit": 32} if sandbox_runtime is RUNC else {"pids_limit": 384, "nproc": 32}
    code = "console.log('audited')"
    result = code_runner(sandbox_service)(code)
    record = audit_record(sandbox_service, result.execution_id)
    assert record["event"] == "execution.finished"
    assert record["code_sha256"] == hashlib.sha256(code.encode()).hexdigest()
    assert record["code_bytes"] == len(code)
    assert code not in json.dumps(record)
    assert record["security"] == {
        "runtime": sandbox_runtime.name,
        "user": "1001:1001",
        "capabilities": [],
        "no_new_privileges": True,
        "read_only_root": True,
        "network_mode": "none",
        "ipc_mode": "none",
        **process_limit,
        "nofile": 256,
        "tmpfs": "/tmp 100m noexec",
        "workspace": "/workspace 100m noexec nosuid",
        "mounts": [],
    }
    assert record["outcome"]["exit_code"] == 0  # type: ignore[index]
    assert re.fullmatch(r"[0-9a-f]{64}", str(record["container_id"]))
    assert record["limits"] == {"timeout_s": 5, "memory_mb": 256, "cpus": 0.5, "stdout_cap": 51200, "stderr_cap": 25600}
    assert record["container_path"] in ("warm", "cold")
    assert record["prev_hash"] != record["hash"]
    assert str(record["image"]).startswith("metaagent-sandbox:")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", str(record["image_id"]))


def test_a_long_execution_is_listed_fetched_and_killed(sandbox_service: Service) -> None:
    holder: dict[str, Result] = {}

    def long_run() -> None:
        response = sandbox_service.post(
            "/tools/code-interpreter", {"code": "setInterval(() => {}, 1000)", "timeout_s": 60}
        )
        holder["result"] = Result(response.status_code, response.json())

    thread = threading.Thread(target=long_run)
    thread.start()
    execution_id = _wait_until_running(sandbox_service, timeout_s=60)
    fetched = sandbox_service.get(f"/executions/{execution_id}").json()
    assert fetched["memory_mb"] == 256
    assert fetched["container_id"]
    killed = sandbox_service_delete(sandbox_service, execution_id)
    assert killed == {"execution_id": execution_id, "killed": True}
    thread.join(timeout=120)
    assert not thread.is_alive(), "the killed execution did not answer"
    result = holder["result"]
    assert result.body["killed"] is True
    assert result.body["timed_out"] is False
    assert sandbox_service.get(f"/executions/{execution_id}").status_code == 404


def _wait_until_running(service: Service, *, timeout_s: int) -> str:
    """The id of the service's execution of `timeout_s` (the test's own, told apart by it) once it runs."""
    deadline = time.monotonic() + 120
    while True:
        listed = service.get("/executions").json()["executions"]
        running = [e for e in listed if e["timeout_s"] == timeout_s and e["state"] == "running"]
        if running:
            return str(running[0]["execution_id"])
        assert time.monotonic() < deadline, f"no execution of timeout_s={timeout_s} ran within 120 s: {listed}"
        time.sleep(0.05)


def sandbox_service_delete(service: Service, execution_id: str) -> dict[str, object]:
    response = httpx2.delete(f"{service.base_url}/executions/{execution_id}", timeout=30)
    assert response.status_code == 200
    body: dict[str, object] = response.json()
    return body


def test_unknown_execution_is_a_404(sandbox_service: Service) -> None:
    assert sandbox_service.get("/executions/exe_nope").status_code == 404
    response = httpx2.delete(f"{sandbox_service.base_url}/executions/exe_nope", timeout=30)
    assert response.status_code == 404
    assert "exe_nope" in response.json()["error"]


def test_health_reports_the_engine_and_the_image(sandbox_service: Service) -> None:
    health = sandbox_service.get("/health").json()
    assert health["status"] == "ok"
    assert health["checks"]["container_engine"]["ok"] is True
    assert health["checks"]["sandbox_image"]["tag"].startswith("metaagent-sandbox:")


@pytest.mark.security
def test_client_that_disconnects_gets_its_container_removed(
    sandbox_service: Service, containers_of: Callable[[str], list[str]]
) -> None:
    body = json.dumps({"code": "console.log('started'); setInterval(() => {}, 1000)", "timeout_s": 120}).encode()
    address = urlsplit(sandbox_service.base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as client:
        client.sendall(
            b"POST /tools/code-interpreter HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (address.netloc.encode(), len(body), body)
        )
        # The client hangs up only once the execution runs: a hang-up still in the admission (a slow
        # machine's) would end the call before there is an execution or a container to remove.
        execution_id = _wait_until_running(sandbox_service, timeout_s=120)
    # The service notices the hang-up, cancels, kills and removes; its audit record is written last.
    deadline = time.monotonic() + 120
    while (record := audited(sandbox_service, execution_id)) is None:
        assert time.monotonic() < deadline, f"{execution_id} did not end within 120 s of the client's hang-up"
        time.sleep(0.1)
    assert record["outcome"] == {"status": "error", "error": "cancelled"}
    assert sandbox_service.get(f"/executions/{execution_id}").status_code == 404
    assert containers_of(execution_id) == []


def test_service_start_removes_containers_left_by_a_dead_service(
    docker_client: object, tmp_path: Path, containers_of: Callable[[str], list[str]]
) -> None:
    client = docker_sdk.from_env()
    orphan = client.api.create_container(
        image_tag(),
        command=["/usr/bin/node", "-e", "0"],
        labels={
            "org.metaagent.service": "metaagent",
            "org.metaagent.execution": "exe_orphan",
            "org.metaagent.owner-pid": "999999999",
        },
    )
    try:
        with serving(tmp_path, METAAGENT_SANDBOX_BUILD_ON_START="false"):
            for _ in range(100):
                if not containers_of("exe_orphan"):
                    break
                time.sleep(0.1)
        assert containers_of("exe_orphan") == []
    finally:
        with contextlib.suppress(docker_sdk.errors.NotFound):
            client.api.remove_container(orphan["Id"], force=True)
        client.close()


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_shutdown_signal_kills_running_executions_and_exits_0(
    sandbox_service: Service, docker_client: docker_sdk.DockerClient, tmp_path: Path, signal_name: str
) -> None:
    # sandbox_service: only so that the image is there; this test needs a service of its own to stop.
    with serving(tmp_path) as (base, process):
        holder: dict[str, httpx2.Response] = {}

        def long_run() -> None:
            body = {"code": "setInterval(() => {}, 1000)", "timeout_s": 120}
            holder["response"] = httpx2.post(f"{base}/tools/code-interpreter", json=body, timeout=120)

        thread = threading.Thread(target=long_run)
        thread.start()
        for _ in range(300):
            running = httpx2.get(f"{base}/executions", timeout=10).json()["executions"]
            if running and running[0]["state"] == "running":
                break
            time.sleep(0.05)
        assert running
        assert running[0]["state"] == "running"
        assert running[0]["container_id"] in owned_containers(docker_client, process.pid)

        process.send_signal(getattr(signal, signal_name))
        assert process.wait(timeout=60) == 0  # not a speed check: far below the execution's 120 s
        thread.join(timeout=10)
        assert holder["response"].status_code == 200
        assert holder["response"].json()["killed"] is True
        assert owned_containers(docker_client, process.pid) == []
        record = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
        assert record["outcome"]["killed"] is True  # the audit record was flushed before the exit


@pytest.mark.security
@pytest.mark.parametrize("service_name", ["sandbox_service", "cold_service"])
def test_user_code_runs_at_the_execution_cpu_share_however_fast_the_runner_started(
    request: pytest.FixtureRequest, service_name: str
) -> None:
    service: Service = request.getfixturevalue(service_name)
    holder: dict[str, httpx2.Response] = {}

    def long_run() -> None:
        body = {"code": "setInterval(() => {}, 1000)", "timeout_s": 60}
        holder["response"] = service.post("/tools/code-interpreter", body)

    thread = threading.Thread(target=long_run)
    thread.start()
    try:
        for _ in range(300):
            running = [e for e in service.get("/executions").json()["executions"] if e["state"] == "running"]
            if running:
                break
            time.sleep(0.05)
        assert running
        # 0.5 CPU, in force while the user's code runs (the cgroup's: the engine's record keeps the create's)
        assert cpu_limits(running[0]["container_id"])[1] == 50_000
        sandbox_service_delete(service, running[0]["execution_id"])
    finally:
        thread.join(timeout=30)
    assert holder["response"].json()["killed"] is True
