"""An adversarial pass on the session supervisor (issue 22): each test is a finding of that pass, on a real
service and the real engine, written as the behaviour the issue asks for."""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import httpx2
import pytest

from tests.sandbox.conftest import (
    HealthProber,
    Service,
    Sessions,
    health_latencies,
    owned_containers,
    running_service,
)

pytestmark = [pytest.mark.docker, pytest.mark.security]


def _service_cpu_s(service: Service) -> float:
    """The service process's own CPU time (user + system) so far."""
    fields = Path(f"/proc/{service.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ~9,990 empty files whose workspace paths are ~780 bytes of ASCII each: the listing reply is ~8 MB,
# just under the wire's 8 MiB frame cap, and every character of every path is checked by a Python loop
# (paths.checked_path) on the event loop, then each entry validated by pydantic, sorted and serialised.
LONG_PATHS = r"""
const fs = require('fs');
const segment = 'a'.repeat(250);
const folder = `${segment}/${segment}/${segment.slice(0, 10)}`;
fs.mkdirSync(folder, { recursive: true });
for (let i = 0; i < 9990; i++) fs.writeFileSync(`${folder}/${String(i).padStart(240, '0')}`, '');
fs.readdirSync(folder).length
"""


def test_listing_a_workspace_of_ten_thousand_long_paths_leaves_every_caller_served(sessions: Sessions) -> None:
    """One session's GET /files held /health for every caller for ~2 s (runsc), each time it is asked, since
    the service checks a listing's ~10 million path characters in one pass without yielding."""
    base_url = sessions.service.base_url
    health_latencies(base_url, 5)
    quiet = statistics.median(health_latencies(base_url, 20))
    sid = sessions.create()
    assert sessions.run(sid, LONG_PATHS, timeout_s=60)["result"] == "9990"
    prober = HealthProber(base_url)
    try:
        for _ in range(3):
            listing = sessions.request("GET", f"/sessions/{sid}/files")
            assert listing.status_code == 200
            assert len(listing.json()["files"]) == 9990
    finally:
        during = prober.stop()
    # The bar is /health within 100 ms throughout; as generous ratios to the quiet latency, so that
    # a busy machine's own pauses pass (one listing held every probe for 1.3-2.8 s before).
    assert statistics.median(during) < 25 * quiet, (quiet, sorted(during)[-5:])
    # A floor of 1 s: a loaded machine alone can stall one probe that long; the bug held every probe 1.3-8 s.
    assert max(during) < max(250 * quiet, 1.0), (quiet, sorted(during)[-5:])


# Call 1 replaces Buffer.prototype.toString, which the program's own request loop (session.js, in the same
# realm as user code) uses to decode each `x` frame: from then on it rewrites the code of every later call.
REWRITE_LATER_CALLS = r"""
const original = Buffer.prototype.toString;
Buffer.prototype.toString = function (...args) {
  const text = Reflect.apply(original, this, args);
  if (text.startsWith('{"id":"') && text.includes('"code"')) {
    const message = JSON.parse(text);
    message.code = "'the code you sent never ran'";
    return JSON.stringify(message);
  }
  return text;
};
'hooked'
"""


def test_a_later_call_runs_the_code_it_was_given_whatever_an_earlier_call_replaced(sessions: Sessions) -> None:
    """An earlier call (a prompt-injected snippet, say) makes every later call run other code: the later call
    answers exit 0 with the attacker's result, its side effect never happens, and its `session.call` audit
    record names the sha256 of code that never ran."""
    sid = sessions.create()
    assert sessions.run(sid, REWRITE_LATER_CALLS)["result"] == "'hooked'"
    later = sessions.run(sid, "require('fs').writeFileSync('proof', 'ran'); 'wrote proof'")
    files = sessions.request("GET", f"/sessions/{sid}/files").json()["files"]
    assert (later["result"], [f["path"] for f in files]) == ("'wrote proof'", ["proof"])


# Output as single bytes: the supervisor frames each read of its pipe on its own, so ~77,000 frames of
# one byte (within the window's 75 KiB) reach the service per call, each its own attach chunk.
TINY_WRITES = r"""
{
  const cell = new Int32Array(new SharedArrayBuffer(4));
  for (let i = 0; i < 51200; i++) { process.stdout.write('x'); if (i % 2 === 0) Atomics.wait(cell, 0, 0, 0.01); }
  for (let i = 0; i < 25600; i++) { process.stderr.write('y'); if (i % 2 === 0) Atomics.wait(cell, 0, 0, 0.01); }
  'tiny'
}
"""
BULK_WRITES = "process.stdout.write('x'.repeat(51200)); process.stderr.write('y'.repeat(25600)); 'bulk'"


def test_output_written_a_byte_at_a_time_costs_the_service_no_more_than_the_same_bytes_at_once(
    sessions: Sessions,
) -> None:
    """The same 75 KiB per call cost the service ~1 s of CPU as one-byte writes, against ~0.01 s as two
    writes (runsc): each write was a frame. The supervisor now sends what came within a moment as one
    frame. The baseline is the same bytes in two writes from a call that lasts as long (the service's own
    background work over that time counts on both sides)."""
    sid = sessions.create()
    sessions.run(sid, BULK_WRITES)  # warm
    before = _service_cpu_s(sessions.service)
    tiny = sessions.run(sid, TINY_WRITES, timeout_s=120)
    per_tiny = _service_cpu_s(sessions.service) - before
    assert (tiny["result"], len(tiny["stdout"])) == ("'tiny'", 51200)
    as_long = f"{BULK_WRITES.rsplit(';', 1)[0]}; Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, "
    as_long += f"{tiny['duration_ms']}); 'bulk'"
    before = _service_cpu_s(sessions.service)
    assert sessions.run(sid, as_long, timeout_s=120)["result"] == "'bulk'"
    per_bulk = max(_service_cpu_s(sessions.service) - before, 0.05)
    # Before the batching, 70-140x; after it about 1-6x here, the upper end on a busy machine.
    assert per_tiny < 10 * per_bulk, (per_tiny, per_bulk, tiny["duration_ms"])


# Scripts run by `docker exec` in a session's container, on a file of its workspace that the session
# made: the test acts at the moment it chooses (once a download is under way, say), which a timer in the
# session could only guess, whatever the machine's load. Exit 3: no such file in this container.
SHRINK = """
const fs = require('fs');
const name = process.argv[1];
if (!fs.existsSync(name)) process.exit(3);
fs.truncateSync(name, 0); fs.unlinkSync(name); fs.mkdirSync(name);
"""
# A SIGSTOP is done only once every thread of the process shows it: `kill` queues the signal, and the stop
# begins when one thread takes it (a busy machine's private dockerd answered a request in between).
SIGNAL_THE_NAMED_PROCESS = """
const fs = require('fs');
const [name, signal] = process.argv.slice(1);
if (!fs.existsSync(name)) process.exit(3);
const pid = Number(fs.readFileSync(name, 'utf8'));
process.kill(pid, signal);
const state = (task) => fs.readFileSync(`/proc/${pid}/task/${task}/stat`, 'utf8').split(') ').pop()[0];
const cell = new Int32Array(new SharedArrayBuffer(4));
while (signal === 'SIGSTOP' && !fs.readdirSync(`/proc/${pid}/task`).every((t) => 'Tt'.includes(state(t)))) {
  Atomics.wait(cell, 0, 0, 10);
}
"""


def _in_the_container_with(client: docker.DockerClient, service: Service, name: str, script: str, *args: str) -> None:
    """Runs node's `script` on /workspace/`name` (and `args`) in whichever of the service's running containers
    has that file: a session's container may have come from the warm pool, so no label names its session."""
    done = 0
    for container_id in owned_containers(client, service.pid):
        command = ["/usr/bin/node", "-e", script, name, *args]
        try:
            container = client.containers.get(container_id)
            if container.status != "running":
                continue
            exit_code, output = container.exec_run(command, user="1001", workdir="/workspace")
        except (docker.errors.NotFound, docker.errors.APIError) as exc:
            # Another container of the service (a warm one, a session another test closed) ended between
            # the listing and the exec; the session's own container cannot, as it holds this test's session.
            if isinstance(exc, docker.errors.NotFound) or exc.status_code == 409:
                continue
            raise
        assert exit_code in (0, 3), output
        done += exit_code == 0
    assert done == 1, f"{script!r} ran on {name} in {done} containers"


def _name_the_supervisor(sessions: Sessions, session_id: str) -> str:
    """The workspace file in which the session's program wrote its supervisor's pid (its parent's)."""
    named = f"supervisor-{session_id}.pid"
    answer = sessions.run(session_id, f"require('fs').writeFileSync({named!r}, String(process.ppid)); 'named'")
    assert answer["result"] == "'named'"
    return named


def _stop_the_supervisor(sessions: Sessions, client: docker.DockerClient, session_id: str) -> None:
    """SIGSTOP to the session's supervisor, from outside, before this returns."""
    named = _name_the_supervisor(sessions, session_id)
    _in_the_container_with(client, sessions.service, named, SIGNAL_THE_NAMED_PROCESS, "SIGSTOP")


def test_a_file_that_shrinks_during_its_download_ends_the_download_without_a_traceback(
    sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    """The supervisor ends a shrunk file's download early (`z` with sent < size) and the service passes the
    end on as if whole: uvicorn raises "Too little data for declared Content-Length", logged twice with full
    tracebacks, and the client sees a reset connection rather than a clear end."""
    log_before = sessions.service.stderr_path.read_text()
    sid = sessions.create()
    name = f"big-{sid}"
    size = 20 * 1024 * 1024  # far more than the pipes and socket buffers between supervisor and client hold
    sessions.run(sid, f"require('fs').writeFileSync({name!r}, Buffer.alloc({size}, 97)); 1")
    received = 0
    with httpx2.stream("GET", f"{sessions.service.base_url}/sessions/{sid}/files/{name}", timeout=60) as response:
        assert response.headers["content-length"] == str(size)
        chunks = response.iter_raw(65536)
        received += len(next(chunks))  # the supervisor is reading; it stalls once the buffers are full
        _in_the_container_with(docker_client, sessions.service, name, SHRINK)
        try:
            for chunk in chunks:
                received += len(chunk)
        except httpx2.RemoteProtocolError:
            pass
    assert received < size  # the file did shrink under the download
    time.sleep(1)
    added = sessions.service.stderr_path.read_text()[len(log_before) :]
    assert not re.search(r"Traceback|Content-Length", added), added[-2000:]


def test_a_file_path_is_decoded_once_however_the_session_id_is_spelled(sessions: Sessions) -> None:
    """With the session id written `ses%5F...`, `_raw_file_path` misses its marker in the raw path and falls
    back to the router's decoded path, which the workspace rules decode again: GET and DELETE of `%2541`
    (the file named `%41`) reach the file `A` instead, so a DELETE removes a file the caller did not name."""
    sid = sessions.create()
    sessions.run(sid, "require('fs').writeFileSync('%41', 'percent'); require('fs').writeFileSync('A', 'plain'); 1")
    spelled = sid.replace("_", "%5F", 1)
    read = sessions.request("GET", f"/sessions/{spelled}/files/%2541")
    assert (read.status_code, read.text) == (200, "percent")
    assert sessions.request("DELETE", f"/sessions/{spelled}/files/%2541").status_code == 200
    names = [f["path"] for f in sessions.request("GET", f"/sessions/{sid}/files").json()["files"]]
    assert names == ["A"]


@pytest.mark.parametrize("seconds", [3e11, 1e13], ids=["year-11476", "past-the-js-date-range"])
def test_a_file_with_an_out_of_range_modification_time_does_not_end_its_session_when_listed(
    sessions: Sessions, seconds: float
) -> None:
    """A file's mtime is the program's to set (fs.utimes; or an archive it unpacks). Past year 9999 the
    supervisor's `+011476-...` date was refused by the service's FileInfo, which ended the session as a
    liar; past JS's Date range `toISOString` threw in the supervisor, which died. The supervisor now holds
    a listed time to the years 1970-9999 (runsc clamps file times to 2262 itself)."""
    sid = sessions.create()
    made = sessions.run(
        sid, f"require('fs').writeFileSync('f', ''); require('fs').utimesSync('f', {seconds}, {seconds}); 1"
    )
    assert made["exit_code"] == 0
    listing = sessions.request("GET", f"/sessions/{sid}/files")
    assert listing.status_code == 200, listing.text
    assert sessions.request("GET", f"/sessions/{sid}").status_code == 200


FILE_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def quick_file_timeout(
    tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient
) -> Iterator[Service]:
    """A service whose file requests time out after FILE_TIMEOUT_S."""
    with running_service(
        tmp_path_factory.mktemp("attack3-file-timeout"), METAAGENT_SESSION_FILE_TIMEOUT_S=str(FILE_TIMEOUT_S)
    ) as service:
        yield service


@pytest.fixture
def quick_sessions(quick_file_timeout: Service) -> Iterator[Sessions]:
    client = Sessions(quick_file_timeout)
    yield client
    for record in client.request("GET", "/sessions").json()["sessions"]:
        client.close(record["session_id"])


# The program stops its supervisor (same uid: process.kill(process.ppid, 'SIGSTOP')) from a timer.
def test_an_upload_into_a_session_whose_supervisor_stopped_answers_within_the_file_timeout(
    quick_sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    """The file timeout covers only the start of an answer: a PUT whose bytes the (stopped) supervisor never
    takes waits in sock_sendall forever. The request never answers, the session stays `busy` (so the idle
    reaper never ends it) until its lifetime cap, and the client's disconnect is not seen."""
    sid = quick_sessions.create()
    _stop_the_supervisor(quick_sessions, docker_client, sid)

    def body() -> Iterator[bytes]:
        for _ in range(200):
            yield b"x" * (256 * 1024)

    try:
        url = f"{quick_sessions.service.base_url}/sessions/{sid}/files/up"
        response = httpx2.put(url, content=body(), timeout=20 * FILE_TIMEOUT_S)
        status = response.status_code
    except httpx2.TimeoutException:
        status = None
    assert status in (410, 504), status


def test_a_download_from_a_session_whose_supervisor_stopped_ends_within_the_file_timeout(
    quick_sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    """Once the `f` header came, a download waits for the supervisor's next frame without a deadline: a
    program that stops its supervisor mid-file leaves the response open, sending nothing, until the
    session's lifetime cap."""
    sid = quick_sessions.create()
    size = 20 * 1024 * 1024  # far more than the pipes and socket buffers between supervisor and client hold
    quick_sessions.run(sid, f"require('fs').writeFileSync('big', Buffer.alloc({size}, 97)); 1")
    named = _name_the_supervisor(quick_sessions, sid)  # no call runs while the download holds the session
    url = f"{quick_sessions.service.base_url}/sessions/{sid}/files/big"
    ended = False
    received = 0
    try:
        with httpx2.stream("GET", url, timeout=20 * FILE_TIMEOUT_S) as response:
            assert response.status_code == 200
            chunks = response.iter_raw(65536)
            received += len(next(chunks))  # the supervisor is mid-file: it stalls once the buffers are full
            _in_the_container_with(docker_client, quick_sessions.service, named, SIGNAL_THE_NAMED_PROCESS, "SIGSTOP")
            for chunk in chunks:
                received += len(chunk)
        ended = True
    except httpx2.RemoteProtocolError:
        ended = True  # cut: the session ended
    except httpx2.TimeoutException:
        ended = False
    assert ended
    assert received < size


def test_ending_a_session_with_a_stalled_upload_leaves_the_next_callers_connection_served(
    sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    """A program stops its supervisor; its caller starts a PUT (which stalls in the service's sock_sendall,
    its writer registered with the event loop), hangs up, and closes the session. The session's attach
    socket is closed with that writer still in the loop's selector, so the next connection the server
    accepts on the same descriptor number, anyone's, fails in `_add_reader` (FileNotFoundError from epoll,
    logged as "Exception in callback"): its request is never read and the client waits until it gives up.
    The PUT's task never ends either. Each round poisons one descriptor, for any key."""
    base_url = sessions.service.base_url

    def body() -> Iterator[bytes]:
        for _ in range(200):
            yield b"x" * (256 * 1024)

    # Other callers, at once, so that one of their connections gets the freed descriptor number.
    def victim(_: int) -> int | str:
        try:
            return httpx2.get(f"{base_url}/health", timeout=10).status_code
        except httpx2.TimeoutException as exc:
            return type(exc).__name__

    outcomes: list[int | str] = []
    for _ in range(3):  # the freed number is not always the next one taken: a few rounds
        sid = sessions.create()
        _stop_the_supervisor(sessions, docker_client, sid)
        with pytest.raises(httpx2.TimeoutException):
            httpx2.put(f"{base_url}/sessions/{sid}/files/up", content=body(), timeout=5)
        assert sessions.close(sid).status_code == 200
        with ThreadPoolExecutor(20) as pool:
            outcomes += pool.map(victim, range(20))
    assert outcomes == [200] * 60


def test_a_large_call_to_a_session_whose_supervisor_stopped_answers_within_its_timeout(
    sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    """`SessionContainer.call` sends the `x` frame before its `move_on_after(timeout_s)`: with the supervisor
    stopped, a call of 1 MB of code never leaves sock_sendall, and `timeout_s: 3` answers nothing at all
    (the request waits until the client hangs up)."""
    sid = sessions.create()
    _stop_the_supervisor(sessions, docker_client, sid)
    code = "//" + "x" * 1_000_000 + "\n1"
    try:
        url = f"{sessions.service.base_url}/sessions/{sid}/execute"
        response = httpx2.post(url, json={"code": code, "timeout_s": 3}, timeout=60)
        answered = response.status_code
    except httpx2.TimeoutException:
        answered = None
    assert answered == 200
