"""Sessions against a real engine: REPL semantics, interrupts, the end of a session and its 410, files
through the runner, the confined fs, ownership, limits and order, frames forged by the code."""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx2
import pytest

from tests.sandbox.conftest import Service, Sessions, audit_records, labelled_containers, running_service
from tests.sandbox.test_gate import HOSTILE, PASSWD_LINE, SANDBOX_PASSWD_LINE, Hostile

pytestmark = [pytest.mark.docker]

PATH_REFUSED = "ERR_METAAGENT_PATH_REFUSED"
ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdefgh"


@pytest.fixture(scope="module")
def tight_service(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Iterator[Service]:
    """A service with small session limits and two API keys."""
    with running_service(
        tmp_path_factory.mktemp("sessions-tight"),
        METAAGENT_API_KEYS=f"alice:{ALICE},bob:{BOB}",
        METAAGENT_SESSION_WORKSPACE_MB="2",
        METAAGENT_SESSION_MAX_FILE_MB="1",
        METAAGENT_SESSION_MAX="3",
        METAAGENT_SESSIONS_PER_KEY="2",
        METAAGENT_SESSION_QUEUE="1",
        METAAGENT_SESSION_FILE_TIMEOUT_S="3",
        METAAGENT_POOL_ENABLED="false",
        METAAGENT_KILL_GRACE_S="2",
    ) as service:
        yield service


# --- REPL semantics ------------------------------------------------------------------------------------


def test_declarations_and_globals_persist_from_call_to_call(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.run(
        sid, "let a = 1; const b = 2; var c = 3; function f() { return a + b + c; } class K { v() { return 4; } }"
    )
    sessions.run(sid, "globalThis.d = 5; a += 10")
    result = sessions.run(sid, "[a, b, c, f(), new K().v(), d]")
    assert result["result"] == "[ 11, 2, 3, 16, 4, 5 ]"
    assert result["exit_code"] == 0


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        ("[1,2,3].map(x=>x*x)", "[ 1, 4, 9 ]"),
        ("'a'", "'a'"),
        ("1; let z = 3", "1"),
        ("let z2 = 3", None),
        ("Promise.resolve(5)", "Promise { 5 }"),
        ("({ nested: { deep: [1, { x: 'y' }] } })", "{\n  nested: { deep: [ 1, { x: 'y' } ] }\n}"),
        ("undefined", None),
        ("null", "null"),
    ],
)
def test_the_result_is_what_the_node_repl_shows(sessions: Sessions, code: str, shown: str | None) -> None:
    assert sessions.run(sessions.create(), code)["result"] == shown


def test_top_level_await_works_and_its_declarations_persist(sessions: Sessions) -> None:
    sid = sessions.create()
    first = sessions.run(sid, "const v = await new Promise((r) => setTimeout(() => r(41), 20)); v + 1")
    assert first["result"] == "42"
    assert sessions.run(sid, "v")["result"] == "41"
    mod = sessions.run(sid, "const { join } = await import('node:path'); join('a', 'b')")
    assert mod["result"] == "'a/b'"


def test_a_call_that_throws_answers_exit_1_with_the_error_and_the_session_lives_on(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.run(sid, "let kept = 7")
    thrown = sessions.run(sid, "throw new Error('boom')")
    assert thrown["exit_code"] == 1
    assert "Uncaught Error: boom" in thrown["stderr"]
    assert "/opt/metaagent" not in thrown["stderr"]  # the runner's frames are not the caller's business
    assert "node:" not in thrown["stderr"]
    assert thrown["session_ended"] is False
    rejected = sessions.run(sid, "await Promise.reject(new TypeError('async boom'))")
    assert rejected["exit_code"] == 1
    assert "Uncaught TypeError: async boom" in rejected["stderr"]
    syntax = sessions.run(sid, "let = ;")
    assert syntax["exit_code"] == 1
    assert "SyntaxError" in syntax["stderr"]
    assert sessions.run(sid, "kept")["result"] == "7"


def test_output_belongs_to_its_call_and_a_timers_later_output_comes_once(sessions: Sessions) -> None:
    sid = sessions.create()
    printed = sessions.run(sid, "console.log('one'); console.error('two'); 3")
    assert (printed["stdout"], printed["stderr"], printed["result"]) == ("one\n", "two\n", "3")
    timer = sessions.run(sid, "setTimeout(() => { console.log('from a timer'); globalThis.printed = true; }, 50); null")
    later = sessions.run(sid, "while (!globalThis.printed) await new Promise((r) => setTimeout(r, 10)); 1")
    # The timer prints after its call's answer was written. Whether it prints before the next call starts
    # or while that call waits, it is the next call's output, unless the supervisor was kept from reading
    # the answer for those 50 ms (a loaded machine: CI saw it once): then it reads the answer's pipe and
    # the output's together, in either order, and the output may close the call that set the timer.
    # Either way it comes once.
    assert (timer["stdout"] + later["stdout"], later["result"]) == ("from a timer\n", "1")


def test_a_result_over_the_cap_is_truncated_with_a_marker(sessions: Sessions) -> None:
    result = sessions.run(
        sessions.create(), "Object.fromEntries(Array.from({ length: 3000 }, (_, i) => ['k' + i, 'v'.repeat(40)]))"
    )
    assert result["result_truncated"] is True
    assert "[result truncated:" in result["result"]
    assert len(result["result"].encode()) < 52 * 1024


# --- interrupts and the end of a session -----------------------------------------------------------


def test_a_synchronous_endless_loop_is_interrupted_at_its_deadline_and_the_session_keeps_its_state(
    sessions: Sessions,
) -> None:
    sid = sessions.create()
    sessions.run(sid, "let before = 'kept'")
    stuck = sessions.run(sid, "while (true) {}", timeout_s=1)
    assert stuck["timed_out"] is True
    assert stuck["exit_code"] is None
    assert stuck["session_ended"] is False
    assert sessions.run(sid, "before")["result"] == "'kept'"


def test_an_await_that_never_settles_is_interrupted_and_the_session_lives_on(sessions: Sessions) -> None:
    sid = sessions.create()
    waited = sessions.run(sid, "await new Promise(() => {})", timeout_s=1)
    assert waited["timed_out"] is True
    assert waited["session_ended"] is False
    assert sessions.run(sid, "2 + 2")["result"] == "4"


def test_a_call_that_cannot_be_interrupted_ends_the_session_with_410_timeout(tight_service: Service) -> None:
    alice = Sessions(tight_service, ALICE)
    sid = alice.create()
    # The call waits, and its event loop is taken from under it: the interrupt at timeout_s cannot land.
    stuck = alice.run(sid, "setTimeout(() => { for (;;) {} }, 10); await new Promise(() => {})", timeout_s=1)
    assert stuck["timed_out"] is True
    assert stuck["session_ended"] is True
    gone = alice.request("GET", f"/sessions/{sid}")
    assert gone.status_code == 410
    assert gone.json() == {"error": f"Session {sid} has ended: timeout", "reason": "timeout"}


def test_process_exit_ends_the_session_with_its_code_and_410_exited(sessions: Sessions) -> None:
    sid = sessions.create()
    ended = sessions.run(sid, "process.exit(3)")
    assert ended["exit_code"] == 3
    assert ended["session_ended"] is True
    gone = sessions.request("POST", f"/sessions/{sid}/execute", json={"code": "1"})
    assert gone.status_code == 410
    assert gone.json()["reason"] == "exited"


def test_running_out_of_memory_ends_the_session_with_410_oom(sessions: Sessions) -> None:
    sid = sessions.create(memory_mb=64)
    ended = sessions.run(sid, "const hog = []; for (;;) hog.push(new Array(1e6).fill(1));", timeout_s=30)
    assert ended["session_ended"] is True
    reason = sessions.request("GET", f"/sessions/{sid}").json()["reason"]
    # V8's heap error or, under runsc where gVisor's own memory counts too, the cgroup's OOM kill first.
    assert ended["oom_killed"] is True
    assert reason == "oom"


def test_closing_a_session_removes_its_container_and_a_second_close_is_410(
    sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    sid = sessions.create()
    record = next(r for r in audit_records(sessions.service) if r.get("session_id") == sid)
    container_id = record["container_id"]
    closed = sessions.close(sid)
    assert closed.json() == {"session_id": sid, "closed": True}
    assert container_id not in labelled_containers(docker_client, "org.metaagent.service=metaagent")
    again = sessions.close(sid)
    assert again.status_code == 410
    assert again.json()["reason"] == "closed"


def test_closing_a_session_during_a_call_ends_the_call_killed(sessions: Sessions) -> None:
    sid = sessions.create()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(sessions.run, sid, "await new Promise(() => {})", 30)
        sessions.running_call(sid)
        sessions.close(sid)
        result = call.result(timeout=60)
    assert result["killed"] is True
    assert result["session_ended"] is True


def test_a_running_call_is_listed_and_deleting_it_interrupts_it_without_ending_the_session(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.run(sid, "let still = 'here'")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(sessions.run, sid, "while (true) {}", 60)
        sessions.request("DELETE", f"/executions/{sessions.running_call(sid)}")
        result = call.result(timeout=60)
    assert result["killed"] is True
    assert result["session_ended"] is False
    assert sessions.run(sid, "still")["result"] == "'here'"


def test_an_interrupt_that_reaches_the_program_before_its_call_does_still_interrupts_the_call(
    sessions: Sessions,
) -> None:
    sid = sessions.create()
    # A timer holds the program's event loop for 3 s: the next call's frame waits unread behind it, and
    # the SIGINT of its interrupt (at its 1 s timeout) reaches a program that has no call armed to take
    # it. Only an interrupt sent again once the loop is free stops the call before the 5 s grace ends.
    # (On a machine so slow that the timer ends before the timeout, the interrupt simply lands in time.)
    sessions.run(sid, "setTimeout(() => { const end = Date.now() + 3000; while (Date.now() < end) {} }, 0); 1")
    result = sessions.run(sid, "while (true) {}", 1)
    assert result["timed_out"] is True
    assert result["session_ended"] is False
    assert sessions.run(sid, "1 + 1")["result"] == "2"


def test_an_idle_session_ends_with_410_idle(sessions: Sessions) -> None:
    sid = sessions.create(idle_timeout_s=10)
    time.sleep(12)
    gone = sessions.request("GET", f"/sessions/{sid}")
    assert gone.status_code == 410
    assert gone.json()["reason"] == "idle"


# --- order, limits, ownership --------------------------------------------------------------------------


def test_concurrent_calls_run_one_at_a_time_in_arrival_order(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.run(sid, "const order = []")
    # Each request is written whole from this one thread before the next (http.client sends on `request`
    # and reads on `getresponse`), so no client thread's scheduling can reorder the arrivals.
    url = httpx2.URL(sessions.service.base_url)
    connections = []
    for i in range(4):
        connection = http.client.HTTPConnection(url.host, url.port, timeout=60)
        body = json.dumps({"code": f"await new Promise(r => setTimeout(r, 100)); order.push({i})", "timeout_s": 5})
        connection.request(
            "POST", f"/sessions/{sid}/execute", body, {**sessions.headers, "Content-Type": "application/json"}
        )
        connections.append(connection)
        time.sleep(0.05)
    results = []
    for connection in connections:
        response = connection.getresponse()
        assert response.status == 200
        results.append(json.loads(response.read()))
        connection.close()
    assert sessions.run(sid, "order")["result"] == "[ 0, 1, 2, 3 ]"
    assert all(r["exit_code"] == 0 for r in results)
    assert results[-1]["queued_ms"] > 0


def test_another_key_cannot_see_a_session_and_gets_404_open_or_ended(tight_service: Service) -> None:
    alice, bob = Sessions(tight_service, ALICE), Sessions(tight_service, BOB)
    sid = alice.create()
    for method, path in [
        ("GET", f"/sessions/{sid}"),
        ("DELETE", f"/sessions/{sid}"),
        ("GET", f"/sessions/{sid}/files"),
    ]:
        assert bob.request(method, path).status_code == 404
    assert bob.request("POST", f"/sessions/{sid}/execute", json={"code": "1"}).status_code == 404
    assert sid not in [s["session_id"] for s in bob.request("GET", "/sessions").json()["sessions"]]
    assert sid in [s["session_id"] for s in alice.request("GET", "/sessions").json()["sessions"]]
    alice.close(sid)
    assert bob.request("GET", f"/sessions/{sid}").status_code == 404
    assert alice.request("GET", f"/sessions/{sid}").status_code == 410


def test_session_limits_answer_429_for_the_key_and_for_the_service(tight_service: Service) -> None:
    alice, bob = Sessions(tight_service, ALICE), Sessions(tight_service, BOB)
    opened = [alice.create(), alice.create()]
    refused = alice.request("POST", "/sessions")
    assert refused.status_code == 429
    assert "METAAGENT_SESSIONS_PER_KEY" in refused.json()["error"]
    assert "Retry-After" in refused.headers
    opened.append(bob.create())
    full = bob.request("POST", "/sessions")
    assert full.status_code == 429
    assert "METAAGENT_SESSION_MAX" in full.json()["error"]
    for sid in opened[:2]:
        alice.close(sid)
    bob.close(opened[2])


def test_calls_past_the_queue_answer_429(tight_service: Service) -> None:
    alice = Sessions(tight_service, ALICE)
    sid = alice.create()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(alice.run, sid, "await new Promise(() => {})", 60)
        first_id = alice.running_call(sid)  # listed once it holds the session
        # Of two more calls, one waits (METAAGENT_SESSION_QUEUE is 1) and the other is refused at once,
        # whichever comes first: the first call holds the session until the test kills it.
        later = [
            pool.submit(alice.request, "POST", f"/sessions/{sid}/execute", json={"code": code}) for code in ("2", "3")
        ]
        refused = next(concurrent.futures.as_completed(later, timeout=60)).result()
        assert refused.status_code == 429
        assert "METAAGENT_SESSION_QUEUE" in refused.json()["error"]
        alice.request("DELETE", f"/executions/{first_id}")
        assert first.result(timeout=60)["killed"] is True
        (waited,) = [answer for answer in (call.result(timeout=60) for call in later) if answer is not refused]
        assert (waited.status_code, waited.json()["result"]) in ((200, "2"), (200, "3"))
    alice.close(sid)


# --- files -----------------------------------------------------------------------------------------------


def test_files_go_in_and_out_through_the_runner(sessions: Sessions) -> None:
    sid = sessions.create()
    data = b"a,b\n1,2\n3,4\n"
    written = sessions.request("PUT", f"/sessions/{sid}/files/data/in.csv", content=data)
    assert written.status_code == 201
    assert written.json() == {"path": "data/in.csv", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    computed = sessions.run(
        sid,
        "const fs = require('fs');"
        " const rows = fs.readFileSync('data/in.csv', 'utf8').trim().split('\\n').slice(1);"
        " const sums = rows.map(r => r.split(',').map(Number).reduce((a, b) => a + b));"
        " fs.writeFileSync('out.json', JSON.stringify(sums)); rows.length",
    )
    assert computed["result"] == "2"
    read = sessions.request("GET", f"/sessions/{sid}/files/out.json")
    assert read.status_code == 200
    assert read.content == b"[3,7]"
    assert read.headers["content-type"] == "application/json"
    listed = sessions.request("GET", f"/sessions/{sid}/files").json()["files"]
    assert [(f["path"], f["size"]) for f in listed] == [("data/in.csv", len(data)), ("out.json", 5)]
    assert sessions.request("DELETE", f"/sessions/{sid}/files/out.json").json() == {"path": "out.json", "deleted": True}
    assert sessions.request("GET", f"/sessions/{sid}/files/out.json").status_code == 404
    assert sessions.request("DELETE", f"/sessions/{sid}/files/out.json").status_code == 404


def test_a_large_file_round_trips_byte_for_byte(sessions: Sessions) -> None:
    sid = sessions.create()
    data = bytes(range(256)) * (4 * 4096)  # 4 MiB
    assert sessions.request("PUT", f"/sessions/{sid}/files/big.bin", content=data).status_code == 201
    assert sessions.request("GET", f"/sessions/{sid}/files/big.bin").content == data
    assert sessions.run(sid, "require('fs').statSync('big.bin').size")["result"] == str(len(data))


@pytest.mark.parametrize(
    "path",
    ["..%2Fetc%2Fpasswd", "%2e%2e/x", "a/%2E%2E/b", "a//b", "a/", "%2Fetc%2Fpasswd", "a%00b", "a%0Ab", "a%7Fb",
     "a%C2%85b", "%FF%FE", "x" * 256, "/".join(["d"] * 600)],
    ids=["encoded-slash-traversal", "encoded-dots", "encoded-dots-inside", "empty-segment", "trailing-slash",
         "absolute", "nul", "newline", "del", "c1", "not-utf8", "long-segment", "long-path"],
)  # fmt: skip
def test_a_path_that_breaks_the_rules_is_a_400_that_says_why(sessions: Sessions, path: str) -> None:
    sid = sessions.create()
    for method in ("PUT", "GET", "DELETE"):
        response = sessions.request(method, f"/sessions/{sid}/files/{path}", content=b"x" if method == "PUT" else None)
        assert response.status_code == 400, (method, response.text)
        assert response.json()["error"].startswith("Invalid workspace path: ")


def test_a_folder_path_is_a_400(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.request("PUT", f"/sessions/{sid}/files/dir/f.txt", content=b"x")
    assert sessions.request("PUT", f"/sessions/{sid}/files/dir", content=b"y").status_code == 400
    assert sessions.request("PUT", f"/sessions/{sid}/files/dir/f.txt/under", content=b"y").status_code == 400


def test_an_oversize_upload_is_413_and_a_full_workspace_507_and_neither_leaves_a_partial_file(
    tight_service: Service,
) -> None:
    alice = Sessions(tight_service, ALICE)
    sid = alice.create()
    alice.request("PUT", f"/sessions/{sid}/files/keep.txt", content=b"old content")
    too_big = alice.request("PUT", f"/sessions/{sid}/files/keep.txt", content=b"x" * (1024 * 1024 + 1))
    assert too_big.status_code == 413

    def chunked() -> Iterator[bytes]:
        for _ in range(17):
            yield b"y" * 65536

    streamed = alice.request("PUT", f"/sessions/{sid}/files/keep.txt", content=chunked())
    assert streamed.status_code == 413
    for i in range(2):
        alice.request("PUT", f"/sessions/{sid}/files/fill{i}.bin", content=b"z" * (900 * 1024))
    full = alice.request("PUT", f"/sessions/{sid}/files/keep.txt", content=b"w" * (900 * 1024))
    assert full.status_code == 507
    assert alice.request("GET", f"/sessions/{sid}/files/keep.txt").content == b"old content"
    names = [f["path"] for f in alice.request("GET", f"/sessions/{sid}/files").json()["files"]]
    assert sorted(names) == ["fill0.bin", "fill1.bin", "keep.txt"]
    alice.close(sid)


def test_links_fifos_and_sockets_the_code_makes_are_never_listed_or_followed(sessions: Sessions) -> None:
    sid = sessions.create()
    made = sessions.run(
        sid,
        """
        const fs = require('fs'), out = [];
        fs.writeFileSync('real.txt', 'real');
        for (const [name, make] of [['symlink', () => fs.symlinkSync('/etc/passwd', 'link')],
                                    ['link', () => fs.linkSync('real.txt', 'hard')],
                                    ['socket', () => require('http').createServer().listen('/workspace/sock')]]) {
          try { make(); out.push(name + ' made'); } catch (e) { out.push(name + ' ' + e.code); }
        }
        out
        """,
    )
    for outcome in ("'symlink ERR_METAAGENT_PATH_REFUSED'", "'link ERR_METAAGENT_PATH_REFUSED'",
                    "'socket ERR_METAAGENT_BLOCKED_API'"):  # fmt: skip
        assert outcome in made["result"]
    listed = [f["path"] for f in sessions.request("GET", f"/sessions/{sid}/files").json()["files"]]
    assert listed == ["real.txt"]


@pytest.mark.security
def test_code_that_blocks_its_event_loop_does_not_hold_up_file_requests(sessions: Sessions) -> None:
    # The files are the supervisor's to serve, in a process of its own: a program stuck in a loop (a
    # timer, so no call is running) cannot make them wait.
    sid = sessions.create()
    sessions.request("PUT", f"/sessions/{sid}/files/a.txt", content=b"a")
    sessions.run(sid, "setTimeout(() => { for (;;) {} }, 10); null")
    time.sleep(0.2)
    served = sessions.request("GET", f"/sessions/{sid}/files/a.txt")
    assert (served.status_code, served.content) == (200, b"a")
    listed = sessions.request("GET", f"/sessions/{sid}/files").json()["files"]
    assert [entry["path"] for entry in listed] == ["a.txt"]
    assert sessions.request("GET", f"/sessions/{sid}").json()["state"] == "idle"


# --- the confined fs ---------------------------------------------------------------------------------------

CONFINED = """
const fs = require('fs'), path = require('path');
const out = {};
const attempt = async (name, fn) => {
  try { const v = await fn(); out[name] = 'ok ' + String(v).slice(0, 40); } catch (e) { out[name] = e.code; }
};
await attempt('write-workspace', () => fs.writeFileSync('/workspace/w.txt', 'w'));
await attempt('read-relative', () => fs.readFileSync('w.txt', 'utf8'));
await attempt('tmp', () => { fs.writeFileSync('/tmp/t.txt', 't'); return fs.readFileSync('/tmp/t.txt', 'utf8'); });
await attempt('promises', () => require('fs/promises').readFile('w.txt', 'utf8'));
await attempt('import-promises', async () => (await import('node:fs/promises')).readFile('/workspace/w.txt', 'utf8'));
const streamed = (make) => new Promise((ok, no) => make().on('data', ok).on('error', no));
await attempt('stream', () => streamed(() => fs.createReadStream('w.txt')));
await attempt('opendir', async () => {
  const d = await fs.promises.opendir('.'); const e = await d.read(); await d.close(); return !!e;
});
await attempt('etc-passwd', () => fs.readFileSync('/etc/passwd', 'utf8'));
await attempt('dotdot', () => fs.readFileSync('../etc/passwd', 'utf8'));
await attempt('app', () => fs.readdirSync('/app'));
await attempt('proc', () => fs.readFileSync('/proc/self/environ'));
await attempt('dev', () => fs.openSync('/dev/null', 'r'));
await attempt('buffer-path', () => fs.readFileSync(Buffer.from('/etc/passwd')));
await attempt('file-url', () => fs.readFileSync(new URL('file:///etc/passwd')));
await attempt('promises-etc', () => fs.promises.readFile('/etc/hostname', 'utf8'));
await attempt('stream-etc', () => streamed(() => fs.createReadStream('/etc/passwd')));
await attempt('readstream-class', () => streamed(() => new fs.ReadStream('/etc/passwd')));
await attempt('watch-etc', () => fs.watch('/etc'));
await attempt('exists-etc', () => fs.existsSync('/etc/passwd'));
await attempt('rename-out', () => fs.renameSync('/workspace/w.txt', '/app/w.txt'));
await attempt('copy-in', () => fs.copyFileSync('/etc/passwd', '/workspace/p'));
await attempt('fd-not-opened', () => fs.readSync(7, Buffer.alloc(10)));
await attempt('chdir-out', () => process.chdir('/etc'));
await attempt('chdir-tmp', () => {
  process.chdir('/tmp'); const c = process.cwd(); process.chdir('/workspace'); return c;
});
await attempt('require-workspace', () => require('/workspace/w.txt'));
await attempt('symlink-promises', () => fs.promises.symlink('/etc', '/workspace/l'));
await attempt('write-stdout-fd', () => fs.writeSync(1, 'through fd 1\\n'));
console.log(JSON.stringify(out));
"""


def test_fs_works_inside_the_workspace_and_tmp_only(sessions: Sessions) -> None:
    result = sessions.run(sessions.create(), CONFINED, timeout_s=10)
    assert result["exit_code"] == 0, result["stderr"]
    out = json.loads(result["stdout"].splitlines()[-1])
    allowed = ["write-workspace", "read-relative", "tmp", "promises", "import-promises", "stream", "opendir",
               "chdir-tmp", "write-stdout-fd"]  # fmt: skip
    for name in allowed:
        assert out[name].startswith("ok"), (name, out[name])
    assert out["read-relative"] == "ok w"
    assert out["chdir-tmp"] == "ok /tmp"
    refused = [name for name in out if name not in allowed and name != "require-workspace"]
    assert {name: out[name] for name in refused} == dict.fromkeys(refused, PATH_REFUSED)
    assert out["require-workspace"] == "ERR_METAAGENT_BLOCKED_MODULE"
    assert "through fd 1\n" in result["stdout"]


# --- objects the confined fs hands out ---------------------------------------------------------------------
# The facade checks the paths its own functions take; the streams, FileHandles and watchers it returns must
# lead nowhere else either: not through their classes, prototypes or symbol-keyed slots, to the real fs, to
# any path or to any descriptor. Each program below reports `held <code>` when the gate stops it, and what
# it reached otherwise.

FS_OBJECT_ESCAPE = """
const fs = require('fs');
const symbolOf = (object, name) => Object.getOwnPropertySymbols(object).find((s) => s.description === name);
const readAll = (stream) => new Promise((ok, no) => {
  let text = ''; stream.on('data', (d) => { text += d; }).on('end', () => ok(text)).on('error', no);
});
const attack = async () => {
  ATTACK
};
let outcome;
try { outcome = await attack(); } catch (e) { outcome = 'held ' + e.code; }
outcome
"""

FS_OBJECT_ESCAPES = {
    # class X extends Original: Object.getPrototypeOf(X) is node's ReadStream, which takes any path.
    "the-stream-class-parent": "return readAll(new (Object.getPrototypeOf(fs.ReadStream))('/etc/passwd'));",
    # Every fs stream keeps the fs it reads with in a symbol-keyed slot: node's real module.
    "the-real-fs-in-a-stream-slot": """
        const stream = fs.createReadStream('/tmp/'); stream.destroy();
        return stream[symbolOf(stream, 'kFs')].readFileSync('/etc/passwd', 'utf8');""",
    # A FileHandle's descriptor is a symbol-keyed own property: rewritten, the handle's methods use any fd.
    "a-filehandle-whose-descriptor-is-rewritten": """
        const handle = await fs.promises.open('/tmp', 'r');
        handle[symbolOf(handle, 'kFd')] = 0;
        const fifo = (await handle.stat()).isFIFO();
        return fifo ? 'reached fd 0, the runner\\'s request pipe' : 'held (not fd 0)';""",
    # The FileHandle class, from any handle, wraps any descriptor.
    "a-filehandle-made-for-another-descriptor": """
        const handle = await fs.promises.open('/tmp', 'r');
        const forged = new handle.constructor({ fd: 0, close() {} });
        return (await forged.stat()).isFIFO() ? 'reached fd 0, the runner\\'s request pipe' : 'held (not fd 0)';""",
    # An FSWatcher started through its own method takes any path: ENOENT or not says whether it exists.
    "a-watcher-started-directly": """
        const watcher = fs.watch('/tmp'); watcher.close();
        const start = symbolOf(Object.getPrototypeOf(watcher), 'kFSWatchStart');
        const probe = (path) => { try { new watcher.constructor()[start](path, false, false, 'utf8'); return 'exists'; }
                                  catch (e) { return e.code; } };
        return `probed /etc: ${probe('/etc')}, /nonexistent: ${probe('/nonexistent')}`;""",
    # mkdtemp checks `${prefix}XXXXXX` but hands node the prefix itself, which says something else.
    "a-mkdtemp-prefix-whose-tostring-lies": """
        const prefix = Buffer.from('/nonexistent/x');
        prefix.toString = () => '/tmp/x';
        try { return 'made ' + fs.mkdtempSync(prefix); }
        catch (e) {
          return e.code === 'ERR_METAAGENT_PATH_REFUSED' ? 'held ' + e.code : 'reached /nonexistent: ' + e.code;
        }""",
}


@pytest.mark.security
@pytest.mark.parametrize(
    "attack",
    [pytest.param(code, id=name) for name, code in FS_OBJECT_ESCAPES.items()],
)
def test_what_the_confined_fs_hands_out_leads_to_no_other_path_or_descriptor(sessions: Sessions, attack: str) -> None:
    result = sessions.run(sessions.create(), FS_OBJECT_ESCAPE.replace("ATTACK", attack))
    assert result["exit_code"] == 0, result["stderr"]
    assert result["result"].startswith("'held"), result["result"]


# A FileHandle keeps the number of its descriptor. fs.closeSync(handle.fd) closes that descriptor (it was
# the facade's) while the handle stays usable; the next descriptor the process opens takes the number, and
# the handle's methods act on it. Here that is the resolver's socket, which dns.lookup opens at the lowest
# free number: the handle stats (reads, writes) a descriptor the facade never opened.
FILE_HANDLE_REUSED_NUMBER = """
const fs = require('fs');
const handle = await fs.promises.open('/workspace/reused', 'w+');
let refused = null;
try { fs.closeSync(handle.fd); } catch (e) { refused = e.code; }  // a handle's number is not the fs's to close
let reached = null, stop = false;
const deadline = Date.now() + 4000;
const probe = async () => {
  while (!stop && reached === null && Date.now() < deadline) {
    try { if ((await handle.stat()).isSocket()) reached = 'reached a socket the facade never opened'; } catch {}
  }
};
const probes = [probe(), probe()];
while (reached === null && Date.now() < deadline) {
  await new Promise((ok) => require('dns').lookup('metaagent.invalid', () => ok()));
}
stop = true;
await Promise.all(probes);
await handle.close();
reached !== null ? reached : refused === null ? 'held' : 'held ' + refused
"""


@pytest.mark.security
def test_a_file_handle_whose_descriptor_was_closed_reaches_no_descriptor_reusing_its_number(
    sessions: Sessions,
) -> None:
    result = sessions.run(sessions.create(), FILE_HANDLE_REUSED_NUMBER, timeout_s=10)
    assert result["exit_code"] == 0, result["stderr"]
    assert result["result"].startswith("'held"), result["result"]


# A FileHandle the program drops is closed by node when it is collected (with a warning), but its number
# stays among the descriptors the facade opened: fs.fstatSync, readSync, writeSync... then accept it while
# it belongs to whatever the process opens next, here the resolver's socket.
COLLECTED_FILE_HANDLE_NUMBER = """
const fs = require('fs');
let number;
await (async () => { number = (await fs.promises.open('/workspace/dropped', 'w+')).fd; })();
let refused = null;  // a handle's number is no descriptor of the program's fs, before or after
try { fs.fstatSync(number); } catch (e) { refused = e.code; }
let collected = false;
for (let round = 0; round < 40 && !collected; round++) {
  let junk = []; for (let i = 0; i < 200; i++) junk.push(new Array(10000).fill(round)); junk = null;
  await new Promise((ok) => setTimeout(ok, 10));
  try { fs.fstatSync(number); } catch (e) { collected = e.code === 'EBADF' || e.code === refused; }
}
let reached = null;
const deadline = Date.now() + 3000;
while (collected && reached === null && Date.now() < deadline) {
  const lookup = new Promise((ok) => require('dns').lookup('metaagent.invalid', () => ok()));
  for (let i = 0; i < 200 && reached === null; i++) {
    try { if (fs.fstatSync(number).isSocket()) reached = 'fs.fstatSync reached the resolver socket'; } catch {}
  }
  await lookup;
}
collected ? (reached === null ? 'held' : reached) : 'not collected'
"""


@pytest.mark.security
def test_the_number_of_a_collected_file_handle_is_no_longer_a_descriptor_of_the_program(
    sessions: Sessions,
) -> None:
    result = sessions.run(sessions.create(), COLLECTED_FILE_HANDLE_NUMBER, timeout_s=10)
    assert result["exit_code"] == 0, result["stderr"]
    assert result["result"] == "'held'"


# node's ReadStream closes its descriptor when destroyed whatever autoClose says, so a FileHandle's stream
# that is destroyed closes the number through the facade, and then the handle closes it again: by then the
# number may belong to another descriptor (here a handle the program opened meanwhile), which is closed under
# it. Had the runner taken the number (an upload's part file, the resolver's socket), its descriptor would be.
DESTROYED_HANDLE_STREAM = """
const fs = require('fs');
fs.writeFileSync('/workspace/lines', 'a\\nb\\n');
const first = await fs.promises.open('/workspace/lines');
first.readLines().input.destroy();
const second = await fs.promises.open('/workspace/lines');
second.createReadStream().destroy();
const third = await fs.promises.open('/workspace/lines');
let outcome;
try { await third.close(); outcome = 'held'; } catch (e) { outcome = 'the third handle was closed already: ' + e.code; }
outcome
"""


@pytest.mark.security
def test_destroying_a_file_handles_stream_closes_its_descriptor_once(sessions: Sessions) -> None:
    result = sessions.run(sessions.create(), DESTROYED_HANDLE_STREAM, timeout_s=5)
    assert result["exit_code"] == 0, result["stderr"]
    assert result["result"] == "'held'"


# fsgate.js says everything it uses is captured before any user code exists, but FileHandle.readLines
# requires readline when it is called, through the module cache the program can write.
READLINES_POISONED_CACHE = """
const fs = require('fs');
const cache = require('module')._cache;
cache.readline = { id: 'readline', filename: 'readline', loaded: true,
                   exports: { createInterface: (options) => ({ poisoned: true, options }) } };
fs.writeFileSync('/workspace/r', 'x');
const handle = await fs.promises.open('/workspace/r');
const lines = handle.readLines();
delete cache.readline;
await handle.close();
lines.poisoned ? "the runner's readLines used the program's readline" : 'held'
"""


@pytest.mark.security
def test_a_file_handles_read_lines_uses_the_readline_captured_before_user_code(sessions: Sessions) -> None:
    result = sessions.run(sessions.create(), READLINES_POISONED_CACHE)
    assert result["exit_code"] == 0, result["stderr"]
    assert result["result"] == "'held'"


FILE_HANDLES_AND_STREAMS = """
const fs = require('fs');
const handle = await fs.promises.open('notes.txt', 'w+');
await handle.write('line one\\nline two\\n');
const size = (await handle.stat()).size;
const again = await fs.promises.readFile(handle, 'utf8');  // from the handle's position: the end
await handle.close();
const reader = await fs.promises.open('notes.txt');
let streamed = '';
for await (const chunk of reader.createReadStream({ encoding: 'utf8' })) streamed += chunk;
const lines = [];
const lined = await fs.promises.open('notes.txt');
for await (const line of lined.readLines()) lines.push(line);
await new Promise((ok, no) => fs.createWriteStream('copy.txt').on('error', no).end(streamed, ok));
console.log(JSON.stringify({ size, again, streamed, lines, copy: fs.readFileSync('copy.txt', 'utf8'),
                             isStream: fs.createReadStream('copy.txt') instanceof fs.ReadStream }));
"""


def test_file_handles_and_streams_work_inside_the_workspace(sessions: Sessions) -> None:
    result = sessions.run(sessions.create(), FILE_HANDLES_AND_STREAMS, timeout_s=10)
    assert result["exit_code"] == 0, result["stderr"]
    assert json.loads(result["stdout"]) == {
        "size": 18,
        "again": "",
        "streamed": "line one\nline two\n",
        "lines": ["line one", "line two"],
        "copy": "line one\nline two\n",
        "isStream": True,
    }


@pytest.mark.security
@pytest.mark.parametrize(
    "code",
    [
        pytest.param("require('fs').writeFileSync(1, 'through writeFile\\n'); 'after'", id="writeFileSync"),
        pytest.param("require('fs').appendFileSync(1, 'through writeFile\\n'); 'after'", id="appendFileSync"),
        pytest.param(
            "const out = require('fs').createWriteStream(null, { fd: 1 });"
            " await new Promise((ok) => out.end('through writeFile\\n', ok)); 'after'",
            id="createWriteStream-fd",
        ),
    ],
)
def test_writes_to_fd_1_by_any_fs_function_are_the_programs_stdout(sessions: Sessions, code: str) -> None:
    result = sessions.run(sessions.create(), code)
    assert result["session_ended"] is False
    assert result["stdout"] == "through writeFile\n"
    assert result["result"] == "'after'"


@pytest.mark.security
def test_reading_fd_0_by_any_fs_function_sees_an_empty_stdin(sessions: Sessions) -> None:
    result = sessions.run(sessions.create(), "JSON.stringify(require('fs').readFileSync(0, 'utf8'))", timeout_s=2)
    assert result["timed_out"] is False
    assert result["result"] == "'\"\"'"


# --- hostile code --------------------------------------------------------------------------------------------


def test_code_cannot_reach_the_runners_stdout_raw_and_no_other_session_is_touched(sessions: Sessions) -> None:
    # fd 1 carries the runner's frames. A raw socket on it (the way to forge them) is refused by the gate;
    # the decoder's own checks, for whatever gets through anyway, are tests/test_session_wire.py.
    victim, attacker = sessions.create(), sessions.create()
    sessions.run(victim, "let safe = 'untouched'")
    forged = sessions.run(
        attacker,
        """
        const Socket = Object.getPrototypeOf(require('tty').ReadStream);
        let outcome;
        try {
          const raw = new Socket({ fd: 1, readable: false, writable: true });
          raw.write(Buffer.from([0x72, 0xff, 0xff, 0xff, 0xff]));  // a reply frame of 4 GiB
          outcome = 'wrote raw';
        } catch (e) { outcome = e.code; }
        process._rawDebug('garbage that is not a frame');  // fd 2: the program's stderr, raw
        outcome
        """,
    )
    assert forged["result"] == "'ERR_METAAGENT_BLOCKED_API'"
    assert forged["session_ended"] is False
    # Raw fd 2 and the reply's frame on fd 1 are two pipes the engine reads apart: the garbage is this
    # call's stderr, or the next call's when the reply overtook it (output between calls goes to the next).
    after = sessions.run(attacker, "'after'")
    assert after["result"] == "'after'"
    assert "garbage that is not a frame" in forged["stderr"] + after["stderr"]
    assert sessions.run(victim, "safe")["result"] == "'untouched'"
    assert sessions.service.get("/health").status_code == 200


def test_a_frame_forged_through_fs_is_just_output(sessions: Sessions) -> None:
    sid = sessions.create()
    frame = b"r" + len(b'{"id":99,"status":"ok","result":"forged"}').to_bytes(4, "big") + b'{"id":99,"status":"ok"}'
    result = sessions.run(sid, f"require('fs').writeSync(1, Buffer.from({list(frame)})); 'real'")
    assert result["result"] == "'real'"
    assert result["session_ended"] is False


# --- faces -------------------------------------------------------------------------------------------------


def test_code_interpreter_with_a_session_id_runs_in_the_session(sessions: Sessions) -> None:
    sid = sessions.create()
    first = sessions.request("POST", "/tools/code-interpreter", json={"code": "let n = 5", "session_id": sid})
    second = sessions.request("POST", "/tools/code-interpreter", json={"code": "n * 2", "session_id": sid})
    assert first.status_code == second.status_code == 200
    assert second.json()["result"] == "10"
    assert second.json()["session_id"] == sid
    owned = sessions.request("POST", "/tools/code-interpreter", json={"code": "1", "session_id": sid, "memory_mb": 64})
    assert owned.status_code == 422
    assert f"session {sid} has memory_mb 256, not 64" in owned.json()["error"]


def test_a_session_call_may_repeat_the_sessions_own_values_as_strict_mode_callers_send_every_property(
    sessions: Sessions,
) -> None:
    sid = sessions.create()
    every_property = {"memory_mb": 256, "packages": [], "network": None, "language": "javascript", "stdin": None}
    echoed = sessions.request(
        "POST", "/tools/code-interpreter", json={"code": "6 * 7", "session_id": sid, **every_property}
    )
    assert echoed.status_code == 200, echoed.text
    assert echoed.json()["result"] == "42"
    nulls = dict.fromkeys(every_property)
    assert (
        sessions.request("POST", "/tools/code-interpreter", json={"code": "1", "session_id": sid, **nulls}).status_code
        == 200
    )
    for name, other in (("language", "python"), ("stdin", "input"), ("packages", ["left-pad"])):
        refused = sessions.request(
            "POST", "/tools/code-interpreter", json={"code": "1", "session_id": sid, name: other}
        )
        assert refused.status_code == 422, (name, refused.text)
        assert f"session {sid} has {name} " in refused.json()["error"]
        assert refused.json()["details"][0]["field"] == name


def test_every_tool_of_get_tools_is_served_at_post_tools_by_its_name(sessions: Sessions) -> None:
    names = [tool["name"] for tool in sessions.request("GET", "/tools").json()["tools"]]
    assert {"code_interpreter", "session_create", "session_close"} <= set(names)
    for name in names:  # a route for each: a body its model refuses is the tool's own 422, not a 404
        refused = sessions.request("POST", f"/tools/{name}", json={"not_a_field": 1})
        assert refused.status_code == 422, (name, refused.text)
    created = sessions.request("POST", "/tools/session_create", json={})
    assert created.status_code == 200, created.text
    sid = created.json()["session_id"]
    ran = sessions.request("POST", "/tools/code_interpreter", json={"code": "6 * 7", "session_id": sid})
    assert ran.json()["result"] == "42"
    closed = sessions.request("POST", "/tools/session_close", json={"session_id": sid})
    assert closed.json() == {"session_id": sid, "closed": True}


def test_a_default_session_takes_a_warm_container(sessions: Sessions) -> None:
    from tests.sandbox.conftest import wait_for_warm_containers

    wait_for_warm_containers(sessions.service)
    sid = sessions.create()
    created = [
        r for r in audit_records(sessions.service) if r.get("session_id") == sid and r["event"] == "session.created"
    ]
    assert created[0]["container_path"] == "warm"


@pytest.mark.security
def test_a_session_records_the_security_context_of_a_one_shot_execution(sessions: Sessions) -> None:
    sid = sessions.create()
    one_shot = sessions.request("POST", "/tools/code-interpreter", json={"code": "1"}).json()
    records = audit_records(sessions.service)
    created = next(r for r in records if r.get("session_id") == sid and r["event"] == "session.created")
    execution = next(r for r in records if r.get("execution_id") == one_shot["execution_id"])
    assert created["security"]["runtime"] in ("runc", "runsc")
    assert created["security"] == execution["security"]


def test_sessions_are_audited_in_the_hash_chain(sessions: Sessions, tmp_path: Path) -> None:
    from metaagent.audit import verify

    sid = sessions.create()
    sessions.request("PUT", f"/sessions/{sid}/files/f.txt", content=b"data")
    sessions.run(sid, "1 + 1")
    sessions.close(sid)
    events = [r["event"] for r in audit_records(sessions.service) if r.get("session_id") == sid]
    assert events == ["session.created", "session.file_written", "session.call", "session.ended"]
    records = [r for r in audit_records(sessions.service) if r.get("session_id") == sid]
    call = next(r for r in records if r["event"] == "session.call")
    assert call["code_sha256"] == hashlib.sha256(b"1 + 1").hexdigest()
    assert verify(sessions.service.audit_log).ok


# --- streaming --------------------------------------------------------------------------------------------


def test_a_session_call_streams_its_output_and_ends_with_the_buffered_body(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.run(sid, "let n = 0")
    code = "for (let i = 0; i < 3; i++) { console.log('tick ' + i); await new Promise(r => setTimeout(r, 300)); } ++n"
    url = f"{sessions.service.base_url}/sessions/{sid}/execute"
    headers = {"Accept": "text/event-stream"}
    with httpx2.stream("POST", url, json={"code": code, "timeout_s": 10}, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        events = [(sse.event, sse.json()) for sse in httpx2.EventSource(response)]
    names = [name for name, _ in events]
    assert names[-1] == "result"
    assert names.count("result") == 1
    assert "".join(data["text"] for name, data in events if name == "stdout") == "tick 0\ntick 1\ntick 2\n"
    streamed = events[-1][1]
    buffered = sessions.run(sid, code)
    per_call = {"execution_id", "duration_ms", "queued_ms", "result"}
    assert {k: v for k, v in streamed.items() if k not in per_call} == {
        k: v for k, v in buffered.items() if k not in per_call
    }
    assert (streamed["result"], buffered["result"]) == ("1", "2")


def test_a_streamed_call_into_an_ended_or_unknown_session_is_plain_json(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.close(sid)
    headers = {"Accept": "text/event-stream"}
    for target, status in ((sid, 410), ("ses_unknown", 404)):
        response = sessions.request("POST", f"/sessions/{target}/execute", json={"code": "1"}, headers=headers)
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"


# --- the hostile programs of the code interpreter, in a session ----------------------------------------

# One-shot facts these check (the user's file as the one cached main module), which a session has not.
ONE_SHOT_ONLY = {"module-cache-and-parent-chain"}
IN_SESSION = [case for case in HOSTILE if case.id not in ONE_SHOT_ONLY]


def _uses_fs(code: str) -> bool:
    # A session has fs (confined to its folders): for it, loading fs is no escape, reading /etc/passwd is.
    return any(name in code for name in ("'fs'", '"fs"', "fs/promises", ":fs", "readFileSync"))


@pytest.mark.security
@pytest.mark.parametrize("case", IN_SESSION, ids=[case.id for case in IN_SESSION])
def test_each_hostile_program_stays_contained_in_a_session(sessions: Sessions, case: Hostile) -> None:
    sid = sessions.create()
    calls = [sessions.run(sid, case.code)]
    expected = case.expect.replace("Error: ", "", 1)
    # What the program's promises and timers print after the call comes with the next calls: they go on
    # until its expected line has come, however slow the machine (a program that uses fs expects none).
    deadline = time.monotonic() + 30
    while True:
        time.sleep(0.6)
        calls.append(sessions.run(sid, "null"))
        out = "".join(call["stdout"] for call in calls) + "\n" + "".join(call["stderr"] for call in calls)
        if _uses_fs(case.code) or expected in out or time.monotonic() > deadline:
            break
    assert not calls[0]["timed_out"], out
    for sign in (PASSWD_LINE, SANDBOX_PASSWD_LINE, "Debugger listening"):
        assert sign not in out, out
    if _uses_fs(case.code):
        return
    assert "ESCAPED" not in out, out
    assert expected in out, out
