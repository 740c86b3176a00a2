"""The session supervisor against a hostile program, on a real engine: the program cannot steer the
file service, forge the wire, or make the service wait, whatever it replaces or writes (issue 22,
findings 1-3)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import docker
import pytest

from tests.sandbox.conftest import HealthProber, Sessions, health_latencies

pytestmark = [pytest.mark.docker, pytest.mark.security]


# Replaces every method and getter of every built-in prototype and namespace the program can reach
# (generated from globalThis, not picked by hand) with ones that lead out of /workspace: strings and
# splits name /etc/passwd, iterators yield '../../opt/metaagent' paths. It runs from a timer, after the
# call that installs it has answered, so every later duty meets the poisoned realm.
POISON_EVERYTHING = r"""
globalThis.__poisoned = 0;
setTimeout(() => {
  const evil = ['..', '..', 'etc', 'passwd'];
  const poison = (key) => function () {
    if (key === Symbol.iterator) return ['../../opt/metaagent/runner.js', '../../etc/passwd'][Symbol.iterator]();
    if (key === 'split') return ['../../etc', 'passwd'];
    if (key === 'join' || key === 'toString' || key === 'slice') return '../../etc/passwd';
    if (key === 'startsWith' || key === 'includes' || key === 'endsWith') return true;
    return evil;
  };
  const seen = new Set();
  const targets = [];
  for (const name of Reflect.ownKeys(globalThis)) {
    let value;
    try { value = globalThis[name]; } catch { continue; }
    if (typeof value === 'function' && value.prototype) targets.push(value.prototype, value);
    else if (value !== null && typeof value === 'object') targets.push(value);
  }
  targets.push(Object.getPrototypeOf([][Symbol.iterator]()), Object.getPrototypeOf(''[Symbol.iterator]()));
  for (const target of targets) {
    if (seen.has(target) || target === globalThis) continue;
    seen.add(target);
    for (const key of Reflect.ownKeys(target)) {
      if (key === 'constructor' || key === 'prototype') continue;
      const descriptor = Reflect.getOwnPropertyDescriptor(target, key);
      if (!descriptor || !descriptor.configurable) continue;
      try {
        if (descriptor.get) Reflect.defineProperty(target, key, { get: poison(key), configurable: true });
        else if (typeof descriptor.value === 'function') {
          Reflect.defineProperty(target, key, { value: poison(key), writable: true, configurable: true });
        }
        globalThis.__poisoned += 1;
      } catch {}
    }
  }
}, 0);
null
"""


def test_a_program_that_replaces_every_built_in_never_steers_a_file_request(sessions: Sessions) -> None:
    sid = sessions.create()
    assert sessions.request("PUT", f"/sessions/{sid}/files/x/keep.txt", content=b"kept").status_code == 201
    assert sessions.run(sid, POISON_EVERYTHING)["exit_code"] == 0
    time.sleep(0.3)  # the timer has poisoned the program's realm

    # Every duty is exact: write, read, list, delete, and nothing outside /workspace is ever named.
    written = sessions.request("PUT", f"/sessions/{sid}/files/x/new.txt", content=b"new")
    assert written.status_code == 201, written.text
    for path, content in (("x/keep.txt", b"kept"), ("x/new.txt", b"new")):
        read = sessions.request("GET", f"/sessions/{sid}/files/{path}")
        assert (read.status_code, read.content) == (200, content)
    for outside in ("x/passwd", "x/runner", "x/runner.js"):
        assert sessions.request("GET", f"/sessions/{sid}/files/{outside}").status_code == 404
    listed = sessions.request("GET", f"/sessions/{sid}/files").json()["files"]
    assert [entry["path"] for entry in listed] == ["x/keep.txt", "x/new.txt"]
    assert sessions.request("DELETE", f"/sessions/{sid}/files/x/new.txt").status_code == 200
    listed = sessions.request("GET", f"/sessions/{sid}/files").json()["files"]
    assert [entry["path"] for entry in listed] == ["x/keep.txt"]

    # The program's realm is its own: a later call answers (whatever its poisoned inspect shows), and
    # the supervisor's answer is well formed.
    later = sessions.request("POST", f"/sessions/{sid}/execute", json={"code": "__poisoned", "timeout_s": 3})
    assert later.status_code == 200, later.text
    assert set(later.json()) >= {"exit_code", "stdout", "stderr", "result", "session_ended"}


# Raw bytes, forged frames among them, to every descriptor the program can open or name, by every route it
# has: fs on a number, and a native stream on it (tty and net, where the gate lets them through).
RAW_TO_EVERY_DESCRIPTOR = r"""
const fs = require('fs');
const forged = (type, message) => {
  const body = Buffer.from(JSON.stringify(message));
  const head = Buffer.alloc(5); head[0] = type.charCodeAt(0); head.writeUInt32BE(body.length, 1);
  return Buffer.concat([head, body]);
};
const payload = Buffer.concat([
  forged('r', { id: 3, status: 'ok', result: "'forged'", files: [{ path: '../../etc/passwd', size: 1 }] }),
  forged('r', { id: 4, status: 'ok', result: "'forged'" }),
  forged('f', { id: 4, size: 3, modified_at: '2020-01-01T00:00:00Z' }),
  Buffer.from([0x6f, 0, 0, 0, 0]),
]);
const reached = [];
for (let fd = 0; fd < 64; fd++) {
  for (const [route, write] of [
    ['fs', () => fs.writeSync(fd, payload)],
    ['tty', () => new (require('tty').WriteStream)(fd).write(payload)],
    ['net', () => new (require('net').Socket)({ fd, readable: false }).write(payload)],
  ]) {
    try { write(); reached.push(`${route}:${fd}`); } catch (e) {}
  }
}
globalThis.reached = reached;
'written'
"""


def test_raw_bytes_to_every_descriptor_change_nothing_but_the_programs_own_output(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.request("PUT", f"/sessions/{sid}/files/real.txt", content=b"real")
    first = sessions.run(sid, RAW_TO_EVERY_DESCRIPTOR)
    assert first["result"] == "'written'", first
    time.sleep(0.3)
    # Later calls run for real: their results are computed, not forged, and the files are the real ones.
    for n in (1, 2, 3):
        later = sessions.run(sid, f"globalThis.count = (globalThis.count || 0) + 1; count * {n}")
        assert later["result"] == str(n * n), later
        assert later["exit_code"] == 0
        assert later["session_ended"] is False
    listed = sessions.request("GET", f"/sessions/{sid}/files").json()["files"]
    assert [entry["path"] for entry in listed] == ["real.txt"]
    assert sessions.request("GET", f"/sessions/{sid}/files/real.txt").content == b"real"


# After its call has answered, the program writes for 3 s as fast as it can: tiny writes through its
# stream, through fs on fd 1, and through a raw native stream where one is reachable, and some bulk.
FLOOD_AFTER_THE_CALL = r"""
const fs = require('fs');
let raw = null;
try { raw = new (require('tty').WriteStream)(1); } catch {}
const until = Date.now() + 3000;
const bulk = 'z'.repeat(16384);
const flood = () => {
  for (let i = 0; i < 1000 && Date.now() < until; i++) {
    process.stdout.write('x');
    fs.writeSync(1, 'y');
    if (i % 50 === 0) process.stdout.write(bulk);
    if (raw) raw.write(Buffer.alloc(0));
  }
  if (Date.now() < until) setImmediate(flood);
};
setTimeout(flood, 0);
'flooding'
"""


def test_a_program_that_floods_its_output_between_calls_leaves_every_caller_served(sessions: Sessions) -> None:
    base_url = sessions.service.base_url
    health_latencies(base_url, 5)  # warm the connection path
    quiet = statistics.median(health_latencies(base_url, 20))
    sid = sessions.create()
    assert sessions.run(sid, FLOOD_AFTER_THE_CALL)["result"] == "'flooding'"
    prober = HealthProber(base_url)
    time.sleep(3)
    during = prober.stop()
    # Generous ratios to the quiet latency measured just before (the flood once held /health for 8 s).
    assert statistics.median(during) < 25 * quiet, (quiet, sorted(during)[-5:])
    # A floor of 1 s: a loaded machine alone can stall one probe that long; the bug held every probe 1.3-8 s.
    assert max(during) < max(250 * quiet, 1.0), (quiet, sorted(during)[-5:])

    time.sleep(1)  # the flood is over
    later = sessions.run(sid, "'after'")
    assert later["result"] == "'after'"
    # What the window could not hold was counted, not sent: the marker says how much was produced.
    assert later["stdout_truncated"] is True
    produced = int(later["stdout"].rsplit("[output truncated: ", 1)[1].split(" bytes", 1)[0])
    assert produced > 10 * 50 * 1024


def test_no_wire_socket_outlives_its_supervisors_connection(
    sessions: Sessions, python_sessions: Sessions, docker_client: docker.DockerClient
) -> None:
    """A session's frames go on a Unix socket the supervisor connects to (wire_socket.py): once sessions
    of both languages run calls, the wire folder holds no name any program could connect to."""
    opened = [sessions.create(), python_sessions.create(language="python")]
    assert sessions.run(opened[0], "6 * 7")["result"] == "42"
    assert python_sessions.run(opened[1], "6 * 7")["result"] == "42"
    for service in (sessions.service, python_sessions.service):
        (volume,) = [
            v for v in docker_client.volumes.list() if v.name.startswith(f"metaagent-wire-{service.process.pid}-")
        ]
        folder = Path(volume.attrs["Mountpoint"])
        assert folder.stat().st_mode & 0o777 == 0o711  # traversable, not listable, by the sandbox's user
        assert list(folder.iterdir()) == []
