"""The hostile Python set: every vector of PYTHON_HARDENING.md (§2, §4.8) against the real service, one
case each, with the class of what stops it.

- gate: the audit hook of runner.py refuses, with ERR_METAAGENT_PATH_REFUSED, ERR_METAAGENT_BLOCKED_API
  or ERR_METAAGENT_BLOCKED_MODULE in the error the program sees;
- container only: the payload defeats the gate (each docstring says how) and then finds the container
  intact: no shell to exec, a read-only root, no interface but lo, uid 1001;
- runner: node's runner outside the program ends it at the deadline, whatever signal handlers it set;
- limits: the container's pids, inode and memory caps;
- benign: what data work needs (CSV, .npy, PNG in /workspace and /tmp) is not refused.

The gate is defence in depth, not the boundary (SECURITY.md, "Python"): a container-only case passes
when the container holds, and would be no failure of the gate. A payload prints ESCAPED where it got a
power it must not have, so a test fails on an escape even if the expected error shows up as well.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest

from metaagent.sandbox.runtime import RUNC, Runtime
from tests.sandbox.conftest import Result, RunJs, Service, Sessions, code_runner, runtime_of

pytestmark = [pytest.mark.docker, pytest.mark.security]

PATH_REFUSED = "ERR_METAAGENT_PATH_REFUSED"
BLOCKED_API = "ERR_METAAGENT_BLOCKED_API"
BLOCKED_MODULE = "ERR_METAAGENT_BLOCKED_MODULE"
MEMORY_MB = 256  # Python's least (languages/python MIN_MEMORY_MB): the warm pool's containers have it
# A bound, not a threshold: a run ends as soon as its program does. At 0.5 CPU on a busy machine under
# runsc, a Python program that raises took over 5 s (the default) to exit.
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def python_runtime(python_service: Service) -> Runtime:
    return runtime_of(python_service)


@pytest.fixture
def run_py(python_service: Service) -> RunJs:
    run = code_runner(python_service)

    def run_python(code: str, timeout_s: int = TIMEOUT_S, **fields: Any) -> Result:
        return run(code, language="python", memory_mb=MEMORY_MB, timeout_s=timeout_s, **fields)

    return run_python


class PythonSessions(Sessions):
    def run(self, session_id: str, code: str, timeout_s: int = TIMEOUT_S) -> dict[str, Any]:
        return super().run(session_id, code, timeout_s)


@pytest.fixture
def py_sessions(python_service: Service) -> Iterator[Sessions]:
    client = PythonSessions(python_service)
    yield client
    for record in client.request("GET", "/sessions").json()["sessions"]:
        client.close(record["session_id"])


def python_session(sessions: Sessions) -> str:
    return sessions.create(language="python", memory_mb=MEMORY_MB)


def output_of(result: Result) -> str:
    assert result.status == 200, result.body
    assert not result.timed_out, result.body
    out = f"{result.stdout}\n{result.stderr}"
    assert "ESCAPED" not in result.stdout, out  # stderr's traceback may quote the payload's source line
    return out


def assert_refused(result: Result, error: str) -> None:
    """The program died of the gate's refusal: `error` (the exception's type and the message's start) is the
    last line of the traceback python3 prints for it."""
    out = output_of(result)
    assert result.exit_code == 1, result.body
    assert error in result.stderr.strip().splitlines()[-1], out


def read_only_errno(runtime: Runtime) -> int:
    """What a write to the read-only root gives: EROFS under runc; under runsc, gVisor answers EACCES."""
    return errno.EROFS if runtime is RUNC else errno.EACCES


# --- gate: each refused power, in one-shot runs ----------------------------------------------------------

CTYPES_SO = "/usr/lib/python3.11/lib-dynload/_ctypes.cpython-311-x86_64-linux-gnu.so"
MEMFD_LOAD = f"""
import _imp, importlib.machinery, os
fd = os.memfd_create("ext")
with open({CTYPES_SO!r}, "rb") as so:
    os.write(fd, so.read())
module = _imp.create_dynamic(importlib.machinery.ModuleSpec(NAME, None, origin=f"/proc/self/fd/{{fd}}"))
print("ESCAPED", module)
"""

GATE_CASES = {
    "import_ctypes": ("import ctypes", f"ImportError: {BLOCKED_MODULE}: the module 'ctypes' is refused"),
    "create_dynamic_as_foo_ctypes": (
        "import _imp, importlib.machinery\n"
        f"spec = importlib.machinery.ModuleSpec('foo._ctypes', None, origin={CTYPES_SO!r})\n"
        "print('ESCAPED', _imp.create_dynamic(spec))",
        f"ImportError: {BLOCKED_MODULE}: the module 'foo._ctypes' is refused",
    ),
    # An extension from a memfd: by its own name the import is refused; by another name, its file is.
    "memfd_extension_as_ctypes": (
        MEMFD_LOAD.replace("NAME", "'_ctypes'"),
        f"ImportError: {BLOCKED_MODULE}: the module '_ctypes' is refused",
    ),
    "memfd_extension_by_another_name": (
        MEMFD_LOAD.replace("NAME", "'memfd_ext'"),
        f"PermissionError: [Errno 13] {PATH_REFUSED}: files can be read only in /tmp",
    ),
    "import_readline": ("import readline", f"ImportError: {BLOCKED_MODULE}: the module 'readline' is refused"),
    # A second interpreter runs without this one's audit hooks.
    "import_xxsubinterpreters": (
        "import _xxsubinterpreters\nprint('ESCAPED', _xxsubinterpreters.create())",
        f"ImportError: {BLOCKED_MODULE}: the module '_xxsubinterpreters' is refused",
    ),
    "os_system": ("import os\nos.system('echo ESCAPED')", f"PermissionError: [Errno 1] {BLOCKED_API}: os.system is"),
    "subprocess_run": (
        "import subprocess\nsubprocess.run(['/usr/bin/python3.11', '-c', 'print(\"ESCAPED\")'])",
        f"PermissionError: [Errno 1] {BLOCKED_API}: subprocess.Popen is",
    ),
    "os_posix_spawn": (
        "import os\nos.posix_spawn('/usr/bin/python3.11', ['python3', '-c', 'print(\"ESCAPED\")'], {})",
        f"PermissionError: [Errno 1] {BLOCKED_API}: os.posix_spawn is",
    ),
    "os_fork": (
        "import os\nif os.fork() == 0:\n    print('ESCAPED')",
        f"PermissionError: [Errno 1] {BLOCKED_API}: os.fork is",
    ),
    "socket_connect": (
        "import socket\nsocket.socket().connect(('127.0.0.1', 9))",
        f"PermissionError: [Errno 1] {BLOCKED_API}: socket.__new__ is refused",
    ),
    "write_etc": (
        "open('/etc/x', 'w')",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: files can be written only in /tmp: '/etc/x'",
    ),
    "write_workspace_dotdot_etc": (
        "open('/workspace/../etc/x', 'w')",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: files can be written only in /tmp: '/etc/x'",
    ),
    "proc_self_mem": (
        "open('/proc/self/mem', 'r+b')",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: files can be written only in /tmp: '/proc/self/mem'",
    ),
    # The open event does not name dir_fd: a relative path with '..' could climb out of any directory.
    "relative_dotdot_with_dir_fd": (
        "import os\n"
        "folder = os.open('/tmp', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.open('../proc/self/mem', os.O_RDWR, dir_fd=folder)",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: a relative path with '..' is refused here",
    ),
    # The image's own links (/usr/share/zoneinfo/posix/Europe -> ../Europe) make a lexical '..' lie: this
    # path reads as /usr/share/zoneinfo and opens /, and a relative path under that dir_fd is checked
    # against the cwd: it opened the supervisor's memory read-write (runc; runsc refuses that open).
    "image_link_dotdot_to_root": (
        "import os\n"
        "up = '/usr/share/zoneinfo/posix/Europe' + '/../posix/Europe' * 4 + '/..' * 4\n"
        "root = os.open(up, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.open(f'proc/{os.getppid()}/mem', os.O_RDWR, dir_fd=root)\n"
        "print('ESCAPED')",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: '..' is refused here outside /tmp and /workspace",
    ),
    # resource.prlimit of the parent (same uid) had no rule: a CPU limit of 0 killed the supervisor (137).
    "prlimit_of_the_supervisor": (
        "import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_CPU, (0, 0))\nprint('ESCAPED')",
        f"PermissionError: [Errno 1] {BLOCKED_API}: resource.prlimit is refused here for another process",
    ),
    "gc_get_objects": ("import gc\ngc.get_objects()", f"PermissionError: [Errno 1] {BLOCKED_API}: gc.get_objects is"),
    "sys_settrace": (
        "import sys\nsys.settrace(lambda *args: None)",
        f"PermissionError: [Errno 1] {BLOCKED_API}: sys.settrace is",
    ),
    "symlink_to_etc": (
        "import os\nos.symlink('/etc', '/tmp/etc')\nopen('/tmp/etc/x', 'w')",
        f"PermissionError: [Errno 1] {BLOCKED_API}: os.symlink is refused here",
    ),
    "hard_link": (
        "import os\nopen('/tmp/a', 'w').close()\nos.link('/tmp/a', '/tmp/b')",
        f"PermissionError: [Errno 1] {BLOCKED_API}: os.link is refused here",
    ),
    # The Popen class reached without importing subprocess: its module's _fork_exec is the gate's stub,
    # and its _posixsubprocess is gone (the raw module, by another way, is container-only below).
    "subclasses_to_popens_fork_exec": (
        "popen = next(c for c in object.__subclasses__() if c.__name__ == 'Popen')\n"
        "internals = popen.__init__.__globals__\n"
        "assert internals['_posixsubprocess'] is None\n"
        "exe = b'/usr/bin/python3.11'\n"
        "internals['_fork_exec']([exe, b'-c', b'print(\"ESCAPED\")'], [exe], *[None] * 21)",
        f"PermissionError: [Errno 1] {BLOCKED_API}: subprocess.Popen is refused here",
    ),
    # A path whose type is a str subclass reaches the hook unchanged; the gate runs none of its methods.
    "str_subclass_path": (
        "class Path(str):\n"
        "    def __eq__(self, other): return True\n"
        "    def __hash__(self): return 0\n"
        "    def startswith(self, *args): return True\n"
        "    def __fspath__(self): return '/tmp/x'\n"
        "open(Path('/etc/x'), 'w')",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: a path must be a str or bytes here",
    ),
    # The gate calls nothing user code can replace: its helpers are bound when it is made.
    "poisoned_helpers": (
        "import builtins, os, posixpath, stat\n"
        "builtins.isinstance = lambda *args: True\n"
        "stat.S_ISLNK = lambda mode: False\n"
        "posixpath.normpath = posixpath.realpath = posixpath.abspath = lambda path: '/tmp/x'\n"
        "os.path = posixpath\n"
        "open('/etc/x', 'w')",
        f"PermissionError: [Errno 13] {PATH_REFUSED}: files can be written only in /tmp: '/etc/x'",
    ),
}


@pytest.mark.parametrize(("code", "error"), list(GATE_CASES.values()), ids=list(GATE_CASES))
def test_the_gate_refuses_with_its_code(run_py: RunJs, code: str, error: str) -> None:
    assert_refused(run_py(code), error)


def test_an_audit_hook_added_by_user_code_is_dropped(run_py: RunJs) -> None:
    """The gate refuses sys.addaudithook, and CPython swallows a refusal derived from Exception there: the
    call returns None, and the hook is not added (it never sees an event)."""
    code = (
        "import sys\n"
        "print('added:', sys.addaudithook(lambda event, args: print('ESCAPED: a hook of mine saw', event)))\n"
        "open('/tmp/x', 'w').close()\n"
        "import json\n"
        "compile('1', 'x', 'eval')\n"
        "print('done')"
    )
    out = output_of(run_py(code))
    assert "added: None" in out, out
    assert "done" in out, out


CHDIR_RACE = """
import os, threading
refused = []
def flip():
    try:
        while not refused:
            os.chdir("/")
            os.chdir("/tmp")
    except PermissionError as exc:
        refused.append(str(exc))
flipper = threading.Thread(target=flip)
flipper.start()
for _ in range(2000):
    try:
        fd = os.open("proc/self/mem", os.O_RDWR)
    except OSError:
        continue
    print("ESCAPED: /proc/self/mem opened read-write as", os.fstat(fd))
    break
refused.append("done")
flipper.join()
print("chdir:", refused[0])
"""


def test_the_cwd_cannot_leave_the_readable_tree_so_a_relative_path_is_checked_where_it_opens(run_py: RunJs) -> None:
    """A relative path is checked against the cwd of the moment, and the open happens a moment later with
    the GIL released: a thread that flipped the cwd between / and /tmp made `proc/self/mem`, checked as
    /tmp/proc/self/mem, open the process's memory read-write within a few tries (os.chdir had no rule).
    Now the cwd may only move where code may read."""
    out = output_of(run_py(CHDIR_RACE))
    assert f"chdir: [Errno 13] {PATH_REFUSED}: files can be read only in /tmp" in out, out


FRAME_WALK = """
import os
try:
    os.system("echo ESCAPED")
except PermissionError as exc:
    tb = exc.__traceback__
frames = []
while tb is not None:
    frames.append(tb.tb_frame)
    tb = tb.tb_next
gate = next(frame for frame in frames if frame.f_code.co_name == "gate")
print("reached", gate.f_code.co_name, sorted(gate.f_locals)[:3])
# Its locals are a snapshot, its policy is frozensets and tuples bound as defaults, its globals are the
# runner's module: rewriting all of them changes nothing the gate decides with.
gate.f_locals["_handled"] = frozenset()
gate.f_locals["_process_events"] = ()
for name in ("HANDLED_EVENTS", "PROCESS_EVENTS", "REFUSED_MODULES", "make_gate", "PermissionError"):
    gate.f_globals[name] = None
gate.f_builtins["PermissionError"] = None
os.system("echo ESCAPED")
"""


def test_walking_from_a_refusal_to_the_gates_frame_gains_nothing(run_py: RunJs) -> None:
    """sys._getframe and tracebacks stay allowed (numpy and pandas use them), so user code reaches the
    gate's own frame from the traceback of a refusal; the gate holds no mutable state to change there."""
    result = run_py(FRAME_WALK)
    assert "reached gate" in result.stdout, result.body
    assert_refused(result, f"PermissionError: [Errno 1] {BLOCKED_API}: os.system is")


HOOK_AT_THE_RECURSION_LIMIT = """
import sys
sys.setrecursionlimit(300)
outcomes = set()
def attempt():
    try:
        open("/proc/self/status").read()  # the gate refuses this read; the container would allow it
        print("ESCAPED: the hook let a read through")
    except RecursionError:
        outcomes.add("RecursionError")
    except PermissionError as exc:
        outcomes.add("refused" if "ERR_METAAGENT_PATH_REFUSED" in str(exc) else repr(exc))
def dive(depth):
    if depth:
        dive(depth - 1)
    attempt()
for depth in range(250, 310):
    try:
        dive(depth)
    except RecursionError:
        pass
print(sorted(outcomes))
"""


def test_a_hook_called_at_the_recursion_limit_fails_closed(run_py: RunJs) -> None:
    """Every depth up to the limit: where the hook itself cannot be called the open fails with the
    RecursionError (the gate has no try/except to swallow it), elsewhere the gate refuses."""
    out = output_of(run_py(HOOK_AT_THE_RECURSION_LIMIT))
    assert "['RecursionError', 'refused']" in out, out


def test_modules_planted_in_sys_modules_reach_neither_the_gate_nor_the_runner(py_sessions: Sessions) -> None:
    """sys.modules edits raise no event: a session plants traps for what the gate and the runner use
    (posixpath, stat, json, errno, traceback...); the gate binds its helpers when it is made and the
    runner holds its modules as globals, so no trap ever runs, later calls are refused and answered."""
    sid = python_session(py_sessions)
    planted = py_sessions.run(
        sid,
        "import sys, types\n"
        "class Trap(types.ModuleType):\n"
        "    def __getattr__(self, name):\n"
        "        print('ESCAPED: the trap', self.__name__, name, 'ran')\n"
        "        raise AttributeError(name)\n"
        "for name in ('posixpath', 'os.path', 'genericpath', 'stat', 'json', 'errno', 'traceback',\n"
        "             'linecache', 'base64', 'io', 'subprocess'):\n"
        "    sys.modules[name] = Trap(name)\n"
        "'planted'",
    )
    assert planted["result"] == "'planted'", planted
    refused = py_sessions.run(sid, "open('/etc/x', 'w')")
    assert refused["error"]["name"] == "PermissionError", refused
    assert refused["error"]["message"].startswith(f"[Errno 13] {PATH_REFUSED}: files can be written only in"), refused
    assert py_sessions.run(sid, "6 * 7")["result"] == "42"
    for answer in (planted, refused):
        assert "ESCAPED" not in f"{answer.get('stdout')}{answer.get('stderr')}", answer


def test_a_session_gets_the_gates_refusals_as_its_error(py_sessions: Sessions) -> None:
    sid = python_session(py_sessions)
    for code, name, message in (
        ("import ctypes", "ImportError", f"{BLOCKED_MODULE}: the module 'ctypes' is refused"),
        ("import os\nos.system('true')", "PermissionError", f"[Errno 1] {BLOCKED_API}: os.system is refused"),
        ("import sys\nsys.settrace(print)", "PermissionError", f"[Errno 1] {BLOCKED_API}: sys.settrace is refused"),
        ("open('/workspace/../etc/x', 'w')", "PermissionError", f"[Errno 13] {PATH_REFUSED}: files can be written"),
        ("import os\nos.chdir('/')", "PermissionError", f"[Errno 13] {PATH_REFUSED}: files can be read only in"),
    ):
        answer = py_sessions.run(sid, code)
        assert answer["error"]["name"] == name, answer
        assert answer["error"]["message"].startswith(message), answer
        assert answer["session_ended"] is False, answer


# --- container only: the gate defeated, the container intact ---------------------------------------------

# Run by an ungated python3.11 (a raw fork_exec) or after the gate's strings are overwritten.
CONTAINER_PROBE = r"""
import os, socket
probe = {"shell": os.path.exists("/bin/sh"), "uid": os.getuid()}
try:
    open("/etc/x", "w")
    probe["etc"] = "WROTE"
except OSError as exc:
    probe["etc"] = exc.errno
try:
    os.symlink("/etc", "/tmp/etc")
    open("/tmp/etc/x", "w")
    probe["through_link"] = "WROTE"
except OSError as exc:
    probe["through_link"] = exc.errno
probe["interfaces"] = [name for _, name in socket.if_nameindex()]
print("PROBE", sorted(probe.items()), flush=True)
"""


def expected_probe(runtime: Runtime) -> str:
    denied = read_only_errno(runtime)
    facts = {"etc": denied, "interfaces": ["lo"], "shell": False, "through_link": denied, "uid": 1001}
    return f"PROBE {sorted(facts.items())}"


RAW_FORK_EXEC = f"""
import _imp, importlib.machinery, os
# _posixsubprocess is built into Debian's python3.11, and _imp.create_builtin raises no audit event.
fork_exec = _imp.create_builtin(importlib.machinery.ModuleSpec("_posixsubprocess", None)).fork_exec
errors_read, errors_write = os.pipe()
exe = b"/usr/bin/python3.11"
pid = fork_exec(
    [exe, b"-I", b"-S", b"-c", {CONTAINER_PROBE.encode()!r}], [exe], True, (errors_write,), None, None,
    -1, -1, -1, -1, -1, -1, errors_read, errors_write, True, False, -1, None, None, None, -1, None, False,
)
os.close(errors_write)
print("child", os.waitpid(pid, 0)[1], os.read(errors_read, 100))
"""


def test_a_raw_fork_exec_starts_an_ungated_python_that_finds_the_container_intact(
    run_py: RunJs, python_runtime: Runtime
) -> None:
    """Gate defeated: `_imp.create_builtin` hands out a fresh `_posixsubprocess` (built in, no audit event
    for a built-in's creation), whose fork_exec raises none either; the python3.11 it starts has no gate
    at all. Container only: there is no shell, the root is read-only (a symlink in /tmp to /etc is made,
    writing through it fails), only lo exists, the uid is 1001."""
    out = output_of(run_py(RAW_FORK_EXEC))
    assert expected_probe(python_runtime) in out, out
    assert "child 0 b''" in out, out


ARRAY_INTERFACE_WRITE = """
import os, sys
import numpy
# The gate's policy strings are the runner's PROCESS_EVENTS, found through the caller's frame; a
# compact ASCII str keeps its bytes 48 bytes past id() on 64-bit CPython 3.11.
policy = sys._getframe(1).f_globals["PROCESS_EVENTS"]
name = policy[policy.index("os.system")]
class Raw:
    pass
raw = Raw()
raw.__array_interface__ = {"shape": (len(name),), "typestr": "|u1", "data": (id(name) + 48, False), "version": 3}
numpy.asarray(raw)[-1] = ord("X")  # the gate now lists "os.systeX" instead
print("gate defeated:", name)
print("os.system status", os.system("echo ESCAPED"))
"""


def test_a_numpy_array_over_raw_memory_defeats_the_gate_and_exec_finds_no_shell(run_py: RunJs) -> None:
    """Gate defeated: an object whose __array_interface__ names an address becomes a writable array over
    it (no audit event, no ctypes); overwriting one byte of the gate's "os.system" makes the event unknown
    to it. Container only: os.system runs and finds no /bin/sh (status 127 << 8)."""
    out = output_of(run_py(ARRAY_INTERFACE_WRITE))
    assert "gate defeated: os.systeX" in out, out
    assert f"os.system status {127 << 8}" in out, out


CTYPES_MEMMOVE = """
import os, sys
import numpy
ctypes = numpy.core._internal.ctypes  # imported before the gate locked; its module stays in numpy's
policy = sys._getframe(1).f_globals["PROCESS_EVENTS"]
name = policy[policy.index("os.posix_spawn")]
ctypes.memmove(id(name) + 48, b"X", 1)  # calling a ctypes function pointer raises no event
print("gate defeated:", name)
try:
    os.posix_spawn("/bin/sh", ["sh", "-c", "echo ESCAPED"], {})
except FileNotFoundError as exc:
    print("no shell:", exc.errno == 2)
"""


def test_ctypes_memmove_through_numpys_ctypes_defeats_the_gate_and_exec_finds_no_shell(run_py: RunJs) -> None:
    """Gate defeated: `import ctypes` is refused, but numpy (imported before the lock) keeps the module,
    and memmove is a function pointer whose calls raise no event; one byte of the gate's "os.posix_spawn"
    overwritten lets the spawn through. Container only: /bin/sh does not exist."""
    out = output_of(run_py(CTYPES_MEMMOVE))
    assert "gate defeated: Xs.posix_spawn" in out, out
    assert "no shell: True" in out, out


# --- runner: the deadline from outside ---------------------------------------------------------------

SIGNALS_IGNORED_FOREVER = """
import signal
signal.signal(signal.SIGTERM, lambda *args: print("SIGTERM ignored", flush=True))
signal.signal(signal.SIGINT, lambda *args: print("SIGINT ignored", flush=True))
while True:
    pass
"""


def test_signal_handlers_and_an_endless_loop_end_at_the_deadline(run_py: RunJs) -> None:
    """signal.signal raises no event; the deadline is node's runner's, enforced outside the program."""
    result = run_py(SIGNALS_IGNORED_FOREVER, timeout_s=1)
    assert result.status == 200, result.body
    assert result.timed_out is True, result.body


def test_a_session_call_that_ignores_its_interrupt_ends_the_session_at_the_deadline(py_sessions: Sessions) -> None:
    sid = python_session(py_sessions)
    answer = py_sessions.run(sid, SIGNALS_IGNORED_FOREVER, timeout_s=1)
    assert answer["timed_out"] is True, answer
    assert answer["session_ended"] is True, answer
    assert py_sessions.request("GET", f"/sessions/{sid}").status_code == 410


# --- the container's limits ----------------------------------------------------------------------------


def test_a_deep_repr_after_raising_the_recursion_limit_crashes_and_ends_the_session(py_sessions: Sessions) -> None:
    """sys.setrecursionlimit raises no event: the repr of a 10^6-deep list overflows the C stack."""
    sid = python_session(py_sessions)
    answer = py_sessions.run(
        sid,
        "import sys\nsys.setrecursionlimit(10**7)\nnested = []\nfor _ in range(10**6):\n    nested = [nested]\nnested",
    )
    assert answer["session_ended"] is True, answer
    assert answer["exit_code"] == 139, answer
    gone = py_sessions.request("POST", f"/sessions/{sid}/execute", json={"code": "1"})
    assert gone.status_code == 410, gone.text


def test_an_answer_of_millions_of_values_ends_the_program_not_the_supervisor(py_sessions: Sessions) -> None:
    """Any frame on fd 3 is parsed before its token is checked: 8 MiB of `[],` made JSON.parse exhaust the
    supervisor's 48 MiB heap, and V8 aborted it (134). Now such an answer breaks the protocol: the
    supervisor kills the program (137) and says why."""
    sid = python_session(py_sessions)
    answer = py_sessions.run(
        sid,
        "import os\n"
        "body = b'[' + b'[],' * 2_700_000 + b'[]]'\n"
        "view = memoryview(b'r' + len(body).to_bytes(4, 'big') + body)\n"
        "while view:\n"
        "    view = view[os.write(3, view):]\n"
        "import time\n"
        "time.sleep(3)",
    )
    assert answer["session_ended"] is True, answer
    assert answer["exit_code"] == 137, answer
    assert "the program broke its protocol (an answer of too many values)" in answer["stderr"], answer


THREAD_BOMB = """
import threading, time
started = 0
try:
    while started < 10_000:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        started += 1
except RuntimeError as exc:
    print("stopped after", started, "threads:", exc)
"""


def test_a_thread_bomb_stops_at_the_process_limit(run_py: RunJs) -> None:
    out = output_of(run_py(THREAD_BOMB))
    assert "threads: can't start new thread" in out, out
    started = int(out.split("stopped after ")[1].split()[0])
    assert started < 64, out


INODE_FLOOD = """
import errno
made = 0
try:
    while made < 10**6:
        open(f"/tmp/f{made}", "w").close()
        made += 1
    print("ESCAPED: a million files")
except OSError as exc:
    print("stopped after", made, "files:", errno.errorcode[exc.errno])
"""


def test_a_million_files_in_tmp_stop_at_the_inode_cap(run_py: RunJs, python_runtime: Runtime) -> None:
    result = run_py(INODE_FLOOD, timeout_s=60)
    if python_runtime is RUNC:
        assert "files: ENOSPC" in output_of(result), result.body
    else:
        # gVisor's tmpfs has no inode cap: its inodes fill the memory limit instead (SECURITY.md, 4).
        assert "ESCAPED" not in result.stdout, result.body
        assert "files: ENOSPC" in result.stdout or result.exit_code == 137, result.body


def test_a_two_gib_allocation_is_killed_at_the_memory_limit(run_py: RunJs, python_runtime: Runtime) -> None:
    result = run_py('filled = b"x" * (2 << 30)\nprint("ESCAPED", len(filled))')
    assert "ESCAPED" not in result.stdout, result.body
    assert result.exit_code == 137, result.body
    assert result.body["oom_killed"] is True, result.body


# --- benign: no false refusals ---------------------------------------------------------------------------

DATA_WORK = """
import pathlib
import numpy as np
import pandas as pd
import matplotlib.pyplot as plt
folder = FOLDER
pd.DataFrame({"x": [1, 2, 3], "y": [4, 5, 6]}).to_csv(f"{folder}/frame.csv", index=False)
frame = pd.read_csv(f"{folder}/frame.csv")
np.save(f"{folder}/values.npy", np.arange(5))
values = np.load(f"{folder}/values.npy")
figure, axes = plt.subplots()
axes.plot(frame.x, frame.y)
figure.savefig(f"{folder}/plot.png")
plt.close(figure)
png = pathlib.Path(f"{folder}/plot.png").read_bytes()
print("benign", int(frame.y.sum()), int(values.sum()), png[:4] == b"\\x89PNG")
"""


def test_csv_npy_and_png_files_work_in_tmp_in_a_run(run_py: RunJs) -> None:
    result = run_py(DATA_WORK.replace("FOLDER", "'/tmp'"))
    assert result.exit_code == 0, result.body
    assert "benign 15 10 True" in result.stdout, result.body


def test_csv_npy_and_png_files_work_in_the_workspace_and_tmp_in_a_session(py_sessions: Sessions) -> None:
    sid = python_session(py_sessions)
    for folder in ("'/workspace'", "'/tmp'", "'.'"):  # '.': the session's cwd is /workspace
        answer = py_sessions.run(sid, DATA_WORK.replace("FOLDER", folder))
        assert answer["error"] is None, answer
        assert "benign 15 10 True" in answer["stdout"], answer
