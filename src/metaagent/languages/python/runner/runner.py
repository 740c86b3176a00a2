"""metaagent Python runner: the program in every Python container, a child of node's trusted runner.

node's runner (/opt/metaagent/runner.js) starts this file as soon as the container starts, with pipes for
its stdin, stdout, stderr and fd 3, and nothing else:

    python3.11 -I -S /opt/metaagent/python/runner.py

Here, in order: numpy, pandas, matplotlib (Agg) and scipy are imported, so that no call pays for them;
the ready line goes out on stderr (node's runner waits for it, and only then tells the service that the
container is ready); then the header comes on stdin, as node's runner protocol has it:

    {"code_bytes": N, "stdin_bytes": M}\\n   one-shot: N bytes of code, then M bytes of the program's stdin
    {"session": true, "program": true}\\n    a session's program: `x {id, code}` frames on fd 0 (one
                                            type byte, a 32-bit big-endian length, the JSON), answers as
                                            `r {...}` frames on fd 3, stdout and stderr raw

Then the gate (the audit hook below) is installed, and only then does any user code exist. One-shot code
runs as `__main__` and exits as `python3 main.py` would (an uncaught exception prints its traceback and
exits 1). A session keeps one namespace across calls; an interrupt is SIGINT (KeyboardInterrupt).

Nothing this process sends is trusted: node's supervisor checks every answer and frames every output
byte, and the container (gVisor where it runs) is the boundary. The gate is defence in depth that makes
refusals legible (PYTHON_HARDENING.md; SECURITY.md has the table of what it stops and what only the
container stops).
"""

import sys

sys.path.append("/usr/lib/python3/dist-packages")  # -S leaves Debian's dist-packages off the path

import ast
import asyncio
import atexit
import base64
import builtins
import contextlib
import errno
import io
import json
import linecache
import os
import posix
import signal
import socket
import threading
import time
import traceback
import types

os.environ["MPLCONFIGDIR"] = "/tmp/matplotlib"  # the font cache: /tmp is the only writable place
os.environ["MPLBACKEND"] = "Agg"

import matplotlib
import matplotlib.pyplot as pyplot
import numpy  # noqa: F401
import pandas  # noqa: F401

# scipy's subpackages import ctypes as they load (scipy._lib._ccallback, scipy.stats), and ctypes is
# refused once the gate holds: they load here (0.25 s of CPU and 40 MB a container, measured).
import scipy.integrate
import scipy.interpolate
import scipy.io
import scipy.linalg
import scipy.optimize
import scipy.signal
import scipy.sparse
import scipy.special
import scipy.stats  # noqa: F401

RUNNER_FILE = __file__
ASYNCIO_DIR = os.path.dirname(asyncio.__file__) + "/"
READY = b"metaagent-runner: ready\n"  # RUNNER_READY in sandbox/execute.py
EXIT_BAD_PAYLOAD = 70
HEADER = 5
MAX_HEADER_BYTES = 1024
MAX_INPUT_FRAME = 2 * 1024 * 1024  # a call's code (1 MiB) in JSON, with room
ANSWERS = 3
MAX_RESULT_BYTES = 64 * 1024  # the service keeps 50 KiB of it
MAX_ERROR_FIELD = 4096
MAX_IMAGES = 8
MAX_IMAGE_BYTES = 4 * 1024 * 1024  # of PNG, all of a call's images together
WORKSPACE = "/workspace"
EGRESS_FIELDS = ("egress_socket", "egress_max_tunnels", "extra_ca_bytes")
EGRESS_SOCKET_DIR = "/run/metaagent/"
USER_FILENAME = "/app/main.py"

# What the gate lets code read besides where it may write: the interpreter's own libraries and data.
LIBRARY_ROOTS = (
    "/usr/lib/python3.11",
    "/usr/lib/python3/dist-packages",
    "/usr/share/matplotlib",
    "/usr/share/fonts",
    "/usr/share/zoneinfo",
    "/etc/matplotlibrc",
    "/etc/localtime",
)
# The trees the program writes, where it can make no link (os.symlink and os.link are refused): only
# there may a path's '..' be resolved lexically. The same in a one-shot run as in a session.
LINK_FREE_ROOTS = ("/tmp", "/workspace")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
# Modules that give native code, new processes or a second interpreter (whose audit hooks are its own):
# refused when imported by any dotted name (foo._ctypes too), and dropped from sys.modules so that an
# `import` reaches the gate even where a library imported them first.
REFUSED_MODULES = frozenset(
    {
        "ctypes",
        "_ctypes",
        "_posixsubprocess",
        "readline",
        "pty",
        "_testcapi",
        "_testinternalcapi",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_tkinter",
    }
)


PROCESS_EVENTS = (
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "subprocess.Popen",
    "pty.spawn",
    "os.startfile",
)
INTROSPECTION_EVENTS = (
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "sys.addaudithook",
    "sys.settrace",
    "sys.setprofile",
    "sys._current_frames",
)
PATH_WRITE_EVENTS = ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate")
# Every event the gate looks at (besides socket.* and ctypes.*); the others cost it one set lookup.
HANDLED_EVENTS = frozenset(
    {
        "open",
        "import",
        "os.listdir",
        "os.scandir",
        "os.chdir",
        "os.rename",
        "os.link",
        "os.symlink",
        "os.kill",
        "os.killpg",
        "resource.prlimit",
        "urllib.Request",
        *PROCESS_EVENTS,
        *INTROSPECTION_EVENTS,
        *PATH_WRITE_EVENTS,
    }
)


# --- the gate -------------------------------------------------------------------------------------------


def make_gate(write_roots, tunnel_path=None):
    """The audit hook of this process (PEP 578): installed before any user code exists and, like every
    audit hook, unremovable from Python. It holds no mutable state and calls nothing user code can
    replace: every callable it uses is bound here as a default argument, policy is tuples and frozensets
    of exact strings, and an argument counts only if its type is exactly str, bytes or int (no method of
    an argument runs). It has no try/except: an error inside it refuses the operation.

    With `tunnel_path` (an execution with network), IPv4 and IPv6 sockets may be made too, and a socket
    may connect to that path alone: the execution's tunnel, which the service guards (`Tunnel` below
    takes ordinary code there). The resolver's events pass: no resolver here reaches anything (names
    resolve in the service)."""
    read_roots = (*write_roots, *LIBRARY_ROOTS)

    def gate(
        event,
        args,
        *,
        _type=type,
        _str=str,
        _bytes=bytes,
        _int=int,
        _len=len,
        _tuple=tuple,
        _startswith=str.startswith,
        _split=str.split,
        _join=str.join,
        _decode=bytes.decode,
        _getcwd=posix.getcwd,
        _getpid=posix.getpid,
        _permission=PermissionError,
        _import_error=ImportError,
        _eacces=errno.EACCES,
        _eperm=errno.EPERM,
        _write_roots=write_roots,
        _read_roots=read_roots,
        _devices=DEVICES,
        _refused_modules=REFUSED_MODULES,
        _write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
        _library_roots=LIBRARY_ROOTS,
        _handled=HANDLED_EVENTS,
        _process_events=PROCESS_EVENTS,
        _introspection_events=INTROSPECTION_EVENTS,
        _path_write_events=PATH_WRITE_EVENTS,
        _dotdot="ERR_METAAGENT_PATH_REFUSED: a relative path with '..' is refused here; use an absolute path",
        _dotdot_outside=(
            "ERR_METAAGENT_PATH_REFUSED: '..' is refused here outside /tmp and /workspace (links in the "
            "image make it lead elsewhere); write the path without '..'"
        ),
        _link_free=LINK_FREE_ROOTS,
        _tunnel_path=tunnel_path,
        _tunnel_families=(socket.AF_INET, socket.AF_INET6),
        _name_events=("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"),
    ):
        if event not in _handled and not _startswith(event, "socket.") and not _startswith(event, "ctypes."):
            return

        # The path an event names, made absolute against the real cwd and normalised lexically ('.' and
        # '..' resolved, no symlink followed). That is sound only because the program can make no
        # symlink (os.symlink and os.link are refused below: with a link /tmp/a/b/L -> /tmp, the lexical
        # /tmp/a/b/L/../../proc/self/mem is /tmp/a/proc/self/mem) and can change its cwd only to where it
        # may read (else a thread that flips the cwd to / between this check and the open makes a
        # relative path checked against /tmp open /proc/self/mem). None for an open file descriptor.
        def checked_path(path, writing):
            if _type(path) is _int:
                return None
            if _type(path) is _bytes:
                path = _decode(path, "utf-8", "surrogateescape")
            if _type(path) is not _str:
                raise _permission(_eacces, "ERR_METAAGENT_PATH_REFUSED: a path must be a str or bytes here")
            relative = not _startswith(path, "/")
            parts = []
            for part in _split(path, "/"):
                if part == "" or part == ".":
                    continue
                if part == "..":
                    if relative:  # its base may be a dir_fd, which the event does not name
                        raise _permission(_eacces, _dotdot, path)
                    # '..' means lexically what it means to the kernel only where no component can be a
                    # link: in the trees the program writes (it can make no link there). The image's own
                    # links lead elsewhere: /usr/share/zoneinfo/posix/Europe -> ../Europe, repeated, makes
                    # a path that reads as /usr/share/zoneinfo/... open /, and so, through a dir_fd, any
                    # file (another process's /proc/N/mem, read-write).
                    here = "/" + _join("/", parts)
                    inside = False
                    for root in _link_free:
                        if here == root or _startswith(here, root + "/"):
                            inside = True
                    if not inside:
                        raise _permission(_eacces, _dotdot_outside, path)
                    parts.pop()
                    continue
                parts.append(part)
            if relative:
                parts = [part for part in _split(_getcwd(), "/") if part != ""] + parts
            absolute = "/" + _join("/", parts)
            if absolute in _devices:
                return absolute
            roots = _write_roots if writing else _read_roots
            for root in roots:
                if absolute == root or _startswith(absolute, root + "/"):
                    return absolute
            where = " and ".join(_write_roots)
            if writing:
                rule = f"files can be written only in {where}"
            else:
                rule = f"files can be read only in {where} and the interpreter's own libraries"
            raise _permission(_eacces, f"ERR_METAAGENT_PATH_REFUSED: {rule}", absolute)

        if event == "open":
            path, mode, flags = args
            writing = False
            if _type(flags) is _int and flags & _write_flags:
                writing = True
            if _type(mode) is _str:
                for letter in mode:
                    if letter in "wax+":
                        writing = True
            checked_path(path, writing)
            return
        if event == "import":
            name, filename = args[0], args[1]
            if _type(name) is not _str:
                raise _import_error("ERR_METAAGENT_BLOCKED_MODULE: an import by a name that is not a str")
            for part in _split(name, "."):
                if part in _refused_modules:
                    raise _import_error(
                        f"ERR_METAAGENT_BLOCKED_MODULE: the module {name!r} is refused in this sandbox "
                        "(native code or new processes); compute with the standard library, numpy, pandas "
                        "or scipy instead",
                        name=name,
                    )
            if filename is not None:
                if _type(filename) is not _str:
                    raise _import_error("ERR_METAAGENT_BLOCKED_MODULE: an import from a path that is not a str")
                if ".so" in filename:  # native code loads only from the interpreter's own libraries
                    for root in _library_roots:
                        if _startswith(filename, root + "/"):
                            return
                    raise _import_error(
                        f"ERR_METAAGENT_BLOCKED_MODULE: native modules load only from the interpreter's "
                        f"libraries, not {filename!r}",
                        name=name,
                    )
                checked_path(filename, False)
            return
        if event in ("os.listdir", "os.scandir"):
            checked_path(args[0] if _len(args) and args[0] is not None else ".", False)
            return
        if event == "os.chdir":  # os.fchdir names a descriptor, which was opened through this gate
            checked_path(args[0], False)
            return
        if event in _path_write_events:
            checked_path(args[0], True)
            return
        if event == "os.rename":
            checked_path(args[0], True)
            checked_path(args[1], True)
            return
        if event == "os.link" or event == "os.symlink":
            raise _permission(
                _eperm,
                f"ERR_METAAGENT_BLOCKED_API: {event} is refused here: paths are checked as written, so no "
                "link may change where one leads; copy the file instead",
            )
        if event == "os.kill" or event == "os.killpg":
            if event == "os.kill" and args[0] == _getpid():
                return
            raise _permission(_eperm, f"ERR_METAAGENT_BLOCKED_API: {event} is refused here: signal only this process")
        if event == "resource.prlimit":  # another process's limits: a CPU limit of 0 kills the supervisor
            if args[0] == 0 or args[0] == _getpid():
                return
            raise _permission(_eperm, "ERR_METAAGENT_BLOCKED_API: resource.prlimit is refused here for another process")
        if event == "socket.__new__":
            if _len(args) > 1 and args[1] == 1:  # AF_UNIX: socketpair, which asyncio's event loop needs
                return
            if _tunnel_path is not None and _type(args[1]) is _int and args[1] in _tunnel_families:
                return  # its connect goes to the tunnel (the runner patched it), or to the refusal below
            raise _permission(
                _eperm, "ERR_METAAGENT_BLOCKED_API: socket.__new__ is refused: this execution has no network"
            )
        if event == "socket.gethostname":
            return
        if _tunnel_path is not None:
            if event == "socket.connect" and _len(args) > 1 and _type(args[1]) is _str and args[1] == _tunnel_path:
                return
            if event in _name_events or event == "urllib.Request":
                return
            if event == "socket.connect":
                raise _permission(
                    _eperm,
                    "ERR_METAAGENT_BLOCKED_API: socket.connect is refused here except through the execution's "
                    "tunnel: connect with socket.socket.connect or socket.create_connection (urllib and "
                    "http.client do), which go through it",
                )
        if _startswith(event, "socket.") or event == "urllib.Request":
            raise _permission(_eperm, f"ERR_METAAGENT_BLOCKED_API: {event} is refused: this execution has no network")
        if event in _process_events:
            raise _permission(
                _eperm,
                f"ERR_METAAGENT_BLOCKED_API: {event} is refused: code runs in one process here, with no "
                "programs to start; compute in Python instead",
            )
        if _startswith(event, "ctypes."):
            raise _permission(_eperm, f"ERR_METAAGENT_BLOCKED_API: {event} is refused: no native code here")
        if event in _introspection_events:
            raise _permission(_eperm, f"ERR_METAAGENT_BLOCKED_API: {event} is refused in this sandbox")

    return gate


def drop_refused_modules(names):
    """Drops the modules of `names` that the gate refuses from sys.modules, so that an import of them
    reaches the gate even where a library imported them first."""
    for name in names:
        if name.split(".")[-1] in REFUSED_MODULES:
            sys.modules.pop(name, None)


def imported_since_ready():
    """The names sys.modules gained after the ready line: the entries after the last one it had then (a
    dict keeps the order of insertion, and the runner drops no module between the ready line and `lock`)."""
    since = []
    for name in reversed(sys.modules):
        if name == LAST_MODULE_AT_READY:
            break
        since.append(name)
    return since


def lock(write_roots, tunnel=None):
    """From here on, the gate holds. Every module was looked at once before the ready line, so only those
    imported since are looked at here: a pass over all 1,350 of them, their memory gone cold while the
    runner waited, took 0.3-1.1 ms of a one-shot run (under runc and runsc, measured in the runner)."""
    drop_refused_modules(imported_since_ready())
    import subprocess

    subprocess._fork_exec = refused_fork_exec  # what Popen would call, reached past Popen's event
    subprocess._posixsubprocess = None
    sys.addaudithook(make_gate(tuple(write_roots), None if tunnel is None else tunnel.path))


def refused_fork_exec(*_args, **_kwargs):
    raise PermissionError(errno.EPERM, "ERR_METAAGENT_BLOCKED_API: subprocess.Popen is refused here")


# --- bytes in and out ----------------------------------------------------------------------------------


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def bad_payload(reason):
    write_all(2, f"metaagent-runner: bad payload: {reason}\n".encode())
    os._exit(EXIT_BAD_PAYLOAD)


class Input:
    """fd 0, read in counted pieces: a header line, then frames or a body of known size."""

    def __init__(self):
        self.pending = b""

    def fill(self):
        chunk = os.read(0, 65536)
        self.pending += chunk
        return len(chunk) > 0

    def line(self):
        while b"\n" not in self.pending[: MAX_HEADER_BYTES + 1]:
            if len(self.pending) > MAX_HEADER_BYTES:
                bad_payload(f"no header line in the first {MAX_HEADER_BYTES} bytes")
            if not self.fill():
                bad_payload("stdin ended before the header line")
        line, _, self.pending = self.pending.partition(b"\n")
        return line

    def exactly(self, size, what):
        while len(self.pending) < size:
            if not self.fill():
                bad_payload(f"stdin ended within {what}")
        data, self.pending = self.pending[:size], self.pending[size:]
        return data

    def frame(self):
        """(type, payload) of the next frame; None once the supervisor has closed stdin."""
        while len(self.pending) < HEADER:
            if not self.fill():
                return None
        length = int.from_bytes(self.pending[1:HEADER], "big")
        if length > MAX_INPUT_FRAME:
            bad_payload(f"a frame of {length} bytes")
        head = self.exactly(HEADER + length, "a frame")
        return chr(head[0]), head[HEADER:]


def read_header(source):
    """The header as a dict: a session's (`session` and `program` true) or a one-shot run's (`code_bytes`,
    `stdin_bytes`), either with the egress fields of an execution with network (`egress_socket`,
    `egress_max_tunnels`, `extra_ca_bytes`: the CA certificates, after the one-shot's code and stdin)."""
    try:
        header = json.loads(source.line())
    except ValueError as exc:
        bad_payload(f"header is not JSON ({exc})")
    if not isinstance(header, dict):
        bad_payload("header is not a JSON object")
    fields = set(header) - set(EGRESS_FIELDS)
    if fields == {"session", "program"}:
        if header["session"] is not True or header["program"] is not True:
            bad_payload("session and program must be true")
    elif fields == {"code_bytes", "stdin_bytes"}:
        for key in ("code_bytes", "stdin_bytes"):
            if type(header[key]) is not int or header[key] < 0:
                bad_payload(f"{key} must be a non-negative integer")
    else:
        bad_payload(f"unexpected header fields {sorted(header)}")
    if any(key in header for key in EGRESS_FIELDS):
        if set(EGRESS_FIELDS) - set(header):
            bad_payload(f"an execution with network gives all of {list(EGRESS_FIELDS)}")
        path = header["egress_socket"]
        if type(path) is not str or not path.startswith(EGRESS_SOCKET_DIR) or len(path) > 200:
            bad_payload(f"egress_socket must be a path under {EGRESS_SOCKET_DIR}")
        if type(header["egress_max_tunnels"]) is not int or header["egress_max_tunnels"] < 1:
            bad_payload("egress_max_tunnels must be a positive integer")
        if type(header["extra_ca_bytes"]) is not int or header["extra_ca_bytes"] < 0:
            bad_payload("extra_ca_bytes must be a non-negative integer")
    return header


def text_stream(fd, errors):
    """A stream on fd `fd` that writes through at every newline and at every flush (its output is
    streamed to the caller as it comes)."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors=errors, line_buffering=True)


# --- network --------------------------------------------------------------------------------------------

MAX_TUNNEL_REPLY = 1024
TUNNEL_LOOK_AGAIN_S = 0.05
MAX_OPENER_THREADS = 8
MAX_STAND_INS = 1 << 17  # 198.18.0.0/15, RFC 2544's benchmarking block: no host an execution reaches has one
SERVICES = {"http": 80, "https": 443}


def egress_from(source, header):
    """The tunnel of an execution with network, installed; None without network. Its CA certificates are
    the last bytes the header announced."""
    if "egress_socket" not in header:
        return None
    pem = source.exactly(header["extra_ca_bytes"], "the CA certificates").decode("ascii")
    tunnel = Tunnel(header["egress_socket"], pem, header["egress_max_tunnels"])
    tunnel.install()
    return tunnel


def is_address(host):
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except (OSError, ValueError):
            continue
        return True
    return False


class Tunnel:
    """Ordinary Python code's connections, through the execution's tunnel, as node's egress.js takes
    JavaScript's: connect to its Unix socket, write `host:port\\n`, read `OK\\n` (or `ERR <code>
    <message>\\n`), and from then on that socket carries the connection's bytes. The service resolves
    names, so `getaddrinfo` answers a stand-in address for a name and a connect to it sends the name.
    TLS runs here, end to end, against node's CA bundle and the operator's extra CAs (the image has no
    bundle of its own).

    Nothing here is a boundary: the container has no network and the service decides every tunnel; code
    that undoes these patches only loses its connections. The gate lets sockets connect to the tunnel's
    path alone."""

    def __init__(self, path, pem, max_tunnels):
        self.path = path
        self.pem = pem
        # The service's limit of open tunnels, kept here as node's runner keeps it: a connect past it
        # waits for a tunnel to close. Asking the service anyway would be refused, and each refusal
        # counts towards the execution's cap, past which no tunnel opens at all. A tunnel is open while
        # a descriptor it was opened or attached on still refers to it, whoever closes that descriptor,
        # however (close, collection, ssl's detach, os.close): the kernel says so, not object tracking.
        self.max_tunnels = max_tunnels
        self.held = {}  # descriptor -> (identity of the tunnel socket it refers to, the peer's address)
        self.opening = 0
        # `with self.guard`, not `with self.changed`: an RLock's exit is C, so an interrupt (a session's
        # SIGINT) cannot land between the block's end and the release; re-entrant for a close that a
        # collection runs inside a block.
        self.guard = threading.RLock()
        self.changed = threading.Condition(self.guard)
        self.names = {}  # stand-in address -> name
        self.stand_ins = {}  # name -> stand-in address
        self.lock = threading.Lock()
        self.opener = None  # the threads of asyncio's connects (made at the first)

    def install(self):
        import asyncio.selector_events
        import ssl

        real_connect = socket.socket.connect
        real_setsockopt = socket.socket.setsockopt
        real_close = socket.socket._real_close
        real_dup = socket.socket.dup
        real_getpeername = socket.socket.getpeername
        real_getsockname = socket.socket.getsockname
        real_getaddrinfo = socket.getaddrinfo
        real_sock_connect = asyncio.selector_events.BaseSelectorEventLoop.sock_connect
        tunnel = self

        def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
            name = host.decode("ascii", "replace") if isinstance(host, bytes) else host
            if name is None or is_address(name):
                return real_getaddrinfo(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)
            if family not in (0, socket.AF_INET):
                raise socket.gaierror(socket.EAI_FAMILY, "a name resolves to an IPv4 stand-in here (AF_INET)")
            if type not in (0, socket.SOCK_STREAM):
                raise socket.gaierror(socket.EAI_SOCKTYPE, "only TCP over the execution's tunnel reaches hosts")
            address = (tunnel.stand_in(name), port_of(port))
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)]

        def gethostbyname(host):
            return host if is_address(host) else tunnel.stand_in(host)

        def gethostbyname_ex(host):
            return (host, [], [gethostbyname(host)])

        def connect(sock, address):
            if not tunneled(sock):
                return real_connect(sock, address)  # the gate refuses it, unless it is the tunnel's path
            tunnel.refuse_if_connected(sock)
            through = tunnel.open(address, sock.gettimeout() or None, real_connect)
            tunnel.attach(sock, through)
            return None

        def connect_ex(sock, address):
            try:
                connect(sock, address)
            except OSError as exc:
                return exc.errno or errno.ECONNREFUSED
            return 0

        def setsockopt(sock, level, option, *value):
            try:
                return real_setsockopt(sock, level, option, *value)
            except OSError as exc:
                # A tunnel's descriptor is a Unix socket's: TCP's own options (http.client's and asyncio's
                # TCP_NODELAY) are the service's connection's, and the kernel refuses them here.
                if level == socket.IPPROTO_TCP and exc.errno == errno.EOPNOTSUPP and tunneled(sock):
                    return None
                raise

        def getpeername(sock):
            peer = tunnel.peer(sock) if tunneled(sock) else None
            if peer is None:
                return real_getpeername(sock)
            if sock.family == socket.AF_INET:
                return peer
            host, port = peer
            return (host if ":" in host else f"::ffff:{host}", port, 0, 0)

        def getsockname(sock):
            if not tunneled(sock) or tunnel.peer(sock) is None:
                return real_getsockname(sock)
            # The connection's own end is the service's: on this side there is no TCP address.
            if sock.family == socket.AF_INET:
                return ("0.0.0.0", 0)  # noqa: S104 -- an address reported, none bound
            return ("::", 0, 0, 0)

        def dup(sock):
            copy = real_dup(sock)
            tunnel.copied(sock.fileno(), copy.fileno())
            return copy

        def _real_close(sock, *args):
            descriptor = sock.fileno()
            try:
                return real_close(sock, *args)
            finally:
                tunnel.forget(descriptor)

        async def sock_connect(loop, sock, address):
            """asyncio's connect: the tunnel opens in a thread, so the event loop runs on meanwhile and
            `wait_for` can give up on it (a connect it gave up on is closed when it opens)."""
            if not tunneled(sock):
                return await real_sock_connect(loop, sock, address)
            tunnel.refuse_if_connected(sock)
            if tunnel.opener is None:
                import concurrent.futures

                # A thread only opens (the tunnels it opened are held elsewhere), and each counts against
                # the container's 32 processes and threads.
                threads = min(tunnel.max_tunnels, MAX_OPENER_THREADS)
                tunnel.opener = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="metaagent-tunnel")
            abandoned = threading.Event()
            opening = tunnel.opener.submit(tunnel.open, address, None, real_connect, abandoned)
            try:
                through = await asyncio.wrap_future(opening)
            except BaseException:
                # Given up on: a thread that waits for a free tunnel stops (or the program could not
                # exit, as its exit waits for the thread); one that opened it meanwhile closes it.
                abandoned.set()
                with tunnel.guard:
                    tunnel.changed.notify_all()
                opening.add_done_callback(close_what_opened)
                raise
            tunnel.attach(sock, through)
            return None

        def load_default_certs(context, purpose=ssl.Purpose.SERVER_AUTH):
            if tunnel.pem:
                context.load_verify_locations(cadata=tunnel.pem)

        socket.getaddrinfo = getaddrinfo
        socket.gethostbyname = gethostbyname
        socket.gethostbyname_ex = gethostbyname_ex
        socket.socket.connect = connect
        socket.socket.connect_ex = connect_ex
        socket.socket.setsockopt = setsockopt
        socket.socket._real_close = _real_close
        socket.socket.dup = dup
        socket.socket.getpeername = getpeername
        socket.socket.getsockname = getsockname
        asyncio.selector_events.BaseSelectorEventLoop.sock_connect = sock_connect
        ssl.SSLContext.load_default_certs = load_default_certs

    def stand_in(self, name):
        name = host_name(name)
        with self.lock:
            address = self.stand_ins.get(name)
            if address is None:
                count = len(self.stand_ins) + 1
                if count >= MAX_STAND_INS:
                    raise socket.gaierror(socket.EAI_MEMORY, "too many host names in one execution")
                address = f"198.{18 + (count >> 16)}.{(count >> 8) & 0xFF}.{count & 0xFF}"
                self.stand_ins[name] = address
                self.names[address] = name
        return address

    def open(self, address, timeout, real_connect, abandoned=None):
        """A connected tunnel to `address` (host, port): the socket that carries its bytes. With all the
        execution's tunnels open, this waits for one to close (within the socket's timeout, if any, and
        until `abandoned` is set)."""
        host, port = address[0], address[1]
        name = self.names.get(host) or (host if is_address(host) else host_name(host))
        line = f"{f'[{name}]' if ':' in name else name}:{port}\n".encode("ascii")
        peer = (host if is_address(host) else self.stand_in(name), port)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.reserve(deadline, abandoned)
        through = None
        try:
            through = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            through.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.001))
            real_connect(through, self.path)
            # The service may answer a refusal before it reads the line: the answer says why.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                through.sendall(line)
            code, message = tunnel_answer(through)
            if code is not None:
                raise tunnel_error(code, message)
            with self.guard:
                self.held[through.fileno()] = (identity(through.fileno()), peer)
        except BaseException:
            if through is not None:
                through.close()
            raise
        finally:
            with self.guard:
                self.opening -= 1
                self.changed.notify_all()
        return through

    def attach(self, sock, through):
        """Puts the tunnel's descriptor in place of the socket's, in the socket's blocking mode."""
        descriptor = sock.fileno()
        try:
            with self.guard:  # no sweep sees the socket's descriptor counted before it refers to the tunnel
                self.held[descriptor] = self.held[through.fileno()]
                try:
                    os.dup2(through.fileno(), descriptor, inheritable=False)
                except BaseException:
                    self.forget(descriptor)
                    raise
        finally:
            through.close()
        sock.settimeout(sock.gettimeout())  # the descriptor's mode is the tunnel's now: set it again

    def reserve(self, deadline, abandoned):
        """Counts a tunnel about to open, once fewer than the limit are."""
        with self.guard:
            while self.in_use() >= self.max_tunnels:
                if abandoned is not None and abandoned.is_set():
                    raise ConnectionAbortedError(errno.ECONNABORTED, "the connect was given up")
                # A close through the socket wakes this at once; a descriptor that went another way
                # (collected unclosed, os.close) is found by looking again a moment later.
                for descriptor in list(self.held):
                    self.forget(descriptor)
                if self.in_use() < self.max_tunnels:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(errno.ETIMEDOUT, f"all {self.max_tunnels} tunnels of the execution stayed open")
                self.changed.wait(TUNNEL_LOOK_AGAIN_S if remaining is None else min(remaining, TUNNEL_LOOK_AGAIN_S))
            self.opening += 1

    def forget(self, descriptor):
        """After a socket's close, or when looking again: a descriptor that no longer refers to its tunnel
        no longer holds it."""
        with self.guard:
            if descriptor in self.held and identity(descriptor) != self.held[descriptor][0]:
                del self.held[descriptor]
                self.changed.notify_all()

    def copied(self, descriptor, copy):
        """A tunnel's descriptor was duplicated (`socket.dup`): the tunnel stays open while either is."""
        with self.guard:
            if descriptor in self.held:
                self.held[copy] = self.held[descriptor]

    def in_use(self):
        """Tunnels open or opening (a tunnel on two descriptors is one)."""
        return len({refers_to for refers_to, _ in self.held.values()}) + self.opening

    def refuse_if_connected(self, sock):
        if self.peer(sock) is not None:
            raise OSError(errno.EISCONN, os.strerror(errno.EISCONN))

    def peer(self, sock):
        """The address a socket's tunnel was opened to; None if it holds none."""
        descriptor = sock.fileno()
        with self.guard:
            refers_to, peer = self.held.get(descriptor, (None, None))
        return peer if refers_to is not None and identity(descriptor) == refers_to else None


def tunneled(sock):
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def close_what_opened(opening):
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def host_name(name):
    if isinstance(name, bytes):
        name = name.decode("ascii", "replace")
    try:
        return name.encode("idna").decode("ascii")
    except UnicodeError:
        raise socket.gaierror(socket.EAI_NONAME, f"{name!r} is not a host name") from None


def tunnel_answer(through):
    """(None, None) for `OK`, else the refusal's (code, message). Read a byte at a time: what follows
    the answer is the connection's."""
    reply = b""
    while not reply.endswith(b"\n"):
        byte = through.recv(1)
        if not byte or len(reply) > MAX_TUNNEL_REPLY:
            return "ERR_METAAGENT_TUNNEL", "the egress tunnel did not answer"
        reply += byte
    line = reply[:-1].decode("utf-8", "replace")
    if line == "OK":
        return None, None
    code, _, message = line[4:].partition(" ")
    if not line.startswith("ERR ") or not message:
        return "ERR_METAAGENT_TUNNEL", f"the egress tunnel answered {line[:100]!r}"
    return code, message


def tunnel_error(code, message):
    """The exception a refused tunnel raises: what the same failure raises on a real network."""
    text = f"{code}: {message}"
    if code in ("ENOTFOUND", "EAI_AGAIN"):
        return socket.gaierror(socket.EAI_NONAME if code == "ENOTFOUND" else socket.EAI_AGAIN, text)
    if code == "ETIMEDOUT":
        return TimeoutError(errno.ETIMEDOUT, text)
    if code == "ECONNRESET":
        return ConnectionResetError(errno.ECONNRESET, text)
    return ConnectionRefusedError(errno.ECONNREFUSED, text)


def port_of(port):
    if port is None:
        return 0
    if isinstance(port, int):
        return port
    text = port.decode("ascii", "replace") if isinstance(port, bytes) else str(port)
    if text.isdigit():
        return int(text)
    if text in SERVICES:
        return SERVICES[text]
    raise socket.gaierror(socket.EAI_SERVICE, f"unknown service {text!r}")


# --- one-shot -------------------------------------------------------------------------------------------


def run_once(source, header):
    code = source.exactly(header["code_bytes"], "the code").decode("utf-8", "surrogateescape")
    given = source.exactly(header["stdin_bytes"], "the program's stdin")
    sys.stdin = io.TextIOWrapper(io.BytesIO(given), encoding="utf-8")
    sys.argv = [USER_FILENAME]
    main = types.ModuleType("__main__")
    main.__file__ = USER_FILENAME
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    linecache.cache[USER_FILENAME] = (len(code), None, code.splitlines(True), USER_FILENAME)
    lock(["/tmp"], egress_from(source, header))
    try:
        compiled = compile(code, USER_FILENAME, "exec", dont_inherit=True)
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        leave(exit_status(exc), tell_end=True)
    except BaseException as exc:
        sys.stderr.write(printed(exc))
        leave(1, tell_end=True)
    leave(0, tell_end=True)


def exit_status(exc):
    """The status python3 leaves with at SystemExit, writing what it writes (the code, when not an int)."""
    code = exc.code
    if code is None:
        return 0
    if type(code) is int:
        return code & 0xFF
    with contextlib.suppress(BaseException):  # a __str__ that raises: python3 prints nothing either
        sys.stderr.write(f"{code}\n")
    return 1


def leave(status, tell_end=False):
    """Ends the process as the interpreter's own exit does, but without its teardown of every module,
    which takes seconds with numpy, pandas, matplotlib and scipy loaded under gVisor on a busy machine:
    threads that are not daemons are waited for and atexit functions run (they are the program's, as at
    any exit), the output is flushed, and then the process is gone.

    With `tell_end` (a one-shot run), node's runner is told `ended <status>` on fd 3 once the output is
    flushed, and this process stops (SIGSTOP: every thread of it, at once) rather than exit. node then
    relays the last output, tells the service, and only then kills it (program.js): the kernel's taking
    apart of an address space that holds numpy, pandas and scipy (under gVisor, 5-8 ms of its CPU here)
    comes after the answer, not before it. Where fd 3 is no longer the pipe to node, node would never
    kill it, and a stopped process would wait for the execution's timeout: then it exits instead."""
    steps = (threading._shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush, stdout.flush, stderr.flush)
    for step in steps:
        with contextlib.suppress(BaseException):  # the program's exit functions and streams: nothing to add
            step()
    told = False
    with contextlib.suppress(BaseException):
        told = tell_end and identity(ANSWERS) == ANSWERS_PIPE
    if told:
        try:
            write_all(ANSWERS, b"ended %d\n" % status)
        except BaseException:  # noqa: S110 (the pipe is gone: node sees the exit instead)
            pass
        else:
            signal.raise_signal(signal.SIGSTOP)
    os._exit(status)


def identity(fd):
    """What fd `fd` is open on, or None: fd 3 is the pipe to node only while it has the identity it had at
    the start (a program may close it, and a file it opens next takes its number); a tunnel is open
    while a descriptor it was opened or attached on refers to it."""
    try:
        found = os.fstat(fd)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


# --- sessions -------------------------------------------------------------------------------------------


class Calls:
    """The session's state: its namespace, the call that runs, the figures it has shown."""

    def __init__(self):
        self.count = 0
        self.running = False
        self.interrupted = False
        self.images = []
        self.image_bytes = 0
        self.images_truncated = False
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        self.loop = asyncio.new_event_loop()  # for top-level await; made before the gate (a socketpair)
        asyncio.set_event_loop(self.loop)

    def on_interrupt(self, _signum, _frame):
        # Once per call: the supervisor sends SIGINT again until the call answers, and a second
        # KeyboardInterrupt could land in the runner's own handling of the first.
        if self.running and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt

    def show_figures(self, *_args, **_kwargs):
        """pyplot.show: each open figure goes to the call's images, and is closed."""
        for number in pyplot.get_fignums():
            figure = pyplot.figure(number)
            if len(self.images) >= MAX_IMAGES:
                self.images_truncated = True
            else:
                buffer = io.BytesIO()
                figure.savefig(buffer, format="png")
                data = buffer.getvalue()
                if self.image_bytes + len(data) > MAX_IMAGE_BYTES:
                    self.images_truncated = True
                else:
                    self.image_bytes += len(data)
                    self.images.append({"mime": "image/png", "data": base64.b64encode(data).decode("ascii")})
            pyplot.close(figure)

    def run(self, code):
        self.count += 1
        filename = f"<cell {self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self.images, self.image_bytes, self.images_truncated = [], 0, False
        self.interrupted = False
        self.running = True
        try:
            try:
                outcome = self._run(code, filename)
            except KeyboardInterrupt as exc:
                if self.interrupted:
                    raise
                outcome = self._threw(exc)
            except SystemExit:
                raise
            except BaseException as exc:
                outcome = self._threw(exc)
            self.show_figures()  # what the call left open, shown as IPython's inline backend shows it
        except KeyboardInterrupt:  # an interrupt while its value, error or figures were being shown
            outcome = {"status": "interrupted"}
            if pyplot.get_fignums():  # figures it had not shown yet: the images are not all there
                self.images_truncated = True
        finally:
            self.running = False
        if self.images or self.images_truncated:
            outcome["images"] = self.images
            outcome["images_truncated"] = self.images_truncated
        return outcome

    def _run(self, code, filename):
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        tree = compile(code, filename, "exec", flags | ast.PyCF_ONLY_AST, dont_inherit=True)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        if tree.body:  # a cell that is one expression has nothing else to compile and run
            self._evaluate(compile(tree, filename, "exec", flags, dont_inherit=True))
        if last is None:
            return {"status": "ok", "result": None}
        value = self._evaluate(compile(last, filename, "eval", flags, dont_inherit=True))
        if value is None:
            return {"status": "ok", "result": None}
        self.namespace["_"] = value
        return {"status": "ok", **shown(value)}

    def _evaluate(self, code):
        value = eval(code, self.namespace)  # the session's own code, in its sandbox
        if code.co_flags & 0x80:  # CO_COROUTINE: top-level await
            value = self.loop.run_until_complete(value)
        return value

    def _threw(self, exc):
        text = printed(exc)
        sys.stderr.write(text)
        sys.stderr.flush()
        try:
            message = str(exc)
        except BaseException:
            message = "an error that cannot be shown"
        name = type(exc).__name__
        return {
            "status": "threw",
            "error": {"name": capped(name), "message": capped(message), "stack": capped(text)},
        }


def shown(value):
    """The value as the session shows it: its repr, whole up to MAX_RESULT_BYTES."""
    try:
        text = repr(value)
        if type(text) is not str:
            raise TypeError("__repr__ returned a non-string")
        incomplete = False
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        text = f"[the value cannot be shown: {capped(safe_str(exc))}]"
        incomplete = True
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_RESULT_BYTES:
        return {"result": data[:MAX_RESULT_BYTES].decode("utf-8", "ignore"), "result_bytes": len(data)}
    answer = {"result": data.decode("utf-8", "replace"), "result_bytes": len(data)}
    if incomplete:
        answer["result_incomplete"] = True
    return answer


def safe_str(exc):
    try:
        return str(exc)
    except BaseException:
        return "an error that cannot be shown"


def capped(text):
    return text[:MAX_ERROR_FIELD]


def without_runner(tb):
    """The traceback without the runner's frames and asyncio's (the calls' code is all the author wrote)."""
    frames = []
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != RUNNER_FILE and not filename.startswith(ASYNCIO_DIR):
            frames.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(frames):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def printed(exc):
    """The exception as python3 prints an uncaught one, without the runner's frames."""
    try:
        return "".join(traceback.format_exception(type(exc), exc, without_runner(exc.__traceback__)))
    except BaseException:
        return f"{type(exc).__name__}: {safe_str(exc)}\n"


def answer(message):
    payload = json.dumps(message).encode("utf-8", "surrogatepass")
    write_all(ANSWERS, bytes([ord("r")]) + len(payload).to_bytes(4, "big") + payload)


def run_session(source, header):
    tunnel = egress_from(source, header)
    os.chdir(WORKSPACE)
    sys.stdin = io.StringIO("")
    sys.argv = [""]
    sys.path.insert(0, WORKSPACE)  # the session's own modules import, as from the cwd of `python3`
    calls = Calls()
    signal.signal(signal.SIGINT, calls.on_interrupt)

    def show(*_args, **_kwargs):
        """pyplot.show in a session: the open figures go to the call's images."""
        calls.show_figures()

    pyplot.show = show
    lock([WORKSPACE, "/tmp"], tunnel)
    answer({"id": 0, "status": "ready"})
    while True:
        frame = source.frame()
        if frame is None:
            leave(0)  # the supervisor closed stdin: the session is over
        kind, payload = frame
        if kind != "x":
            bad_payload(f"unknown request type {kind!r}")
        try:
            request = json.loads(payload)
            token, code = request["id"], request["code"]
        except (ValueError, KeyError, TypeError):
            bad_payload("a request that is not {id, code}")
        try:
            outcome = calls.run(code)
        except SystemExit as exc:  # sys.exit() ends the session, with python3's status
            leave(exit_status(exc))
        stdout.flush()
        stderr.flush()
        answer({"id": token, **outcome})


# --- start ----------------------------------------------------------------------------------------------

ANSWERS_PIPE = identity(ANSWERS)
stdout = sys.stdout = text_stream(1, "surrogateescape")
stderr = sys.stderr = text_stream(2, "backslashreplace")
matplotlib.rcParams["figure.max_open_warning"] = 0
# The backend is chosen, and a figure drawn once, before any call: the first plot then costs only
# itself (no font loading), and pyplot.show can be replaced for good (choosing the backend resets it).
_figure = pyplot.figure()
_figure.savefig(io.BytesIO(), format="png")
pyplot.close(_figure)
# The marker first: a module imported while the others are looked at lands after it, and is looked at again
# by the lock. (Should the marker itself be refused and dropped, the lock looks at every module.)
LAST_MODULE_AT_READY = next(reversed(sys.modules))
drop_refused_modules(list(sys.modules))
write_all(2, READY)
_source = Input()
_header = read_header(_source)
if "session" in _header:
    run_session(_source, _header)
else:
    run_once(_source, _header)
