"""The in-process module gate (runner/gate.js): every spelling of a blocked module or process API fails
with a stable code and a message that names it, and ordinary programs keep working.

The container is the boundary (test_container.py proves it without the runner); the gate is depth.
Each hostile program tries its escape and prints ESCAPED if it got file, program, worker or debugger
powers, so a test fails on an escape even if the expected error also shows up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import docker
import httpx2
import pytest

pytestmark = [pytest.mark.docker, pytest.mark.security]

RunJs = Callable[..., Any]

BLOCKED_MODULE = "ERR_METAAGENT_BLOCKED_MODULE"
BLOCKED_API = "ERR_METAAGENT_BLOCKED_API"
PASSWD_LINE = "root:x:0:0"  # the first line of the image's /etc/passwd: seeing it means a file was read
SANDBOX_PASSWD_LINE = "sandbox:x:1001"


def output_of(result: Any) -> str:
    assert not result.timed_out, result
    out = f"{result.stdout}\n{result.stderr}"
    assert "ESCAPED" not in out, out
    assert PASSWD_LINE not in out, out
    assert SANDBOX_PASSWD_LINE not in out, out
    assert "Debugger listening" not in out, out
    return out


def module_message(name: str) -> str:
    return f'{BLOCKED_MODULE}: Module "{name}" is blocked in the sandbox (node:{name})'


def path_message(request: str) -> str:
    return f'{BLOCKED_MODULE}: Module "{request}" is blocked in the sandbox (only files under /app/ can be loaded)'


def api_message(api: str) -> str:
    return f"{BLOCKED_API}: {api} is blocked in the sandbox"


# --- every blocked built-in, in the four spellings of a name ------------------------------------------

BLOCKED_BUILTINS = [
    "fs",
    "fs/promises",
    "child_process",
    "cluster",
    "worker_threads",
    "inspector",
    "repl",
    "v8",
    "vm",
    "wasi",
    "trace_events",
    "net",
    "tls",
    "dgram",
    "http2",
    "_tls_wrap",
]

# Loading the module at all counts as an escape here: each of them is refused as a whole.
FOUR_SPELLINGS = """
const name = NAME;
const report = (label, e) => console.log(`${label} -> ${e && e.code}: ${e && e.message}`);
try { require(name); console.log('ESCAPED require'); } catch (e) { report('require', e); }
try { require('node:' + name); console.log('ESCAPED require node:'); } catch (e) { report('require node:', e); }
(async () => {
  for (const specifier of [name, 'node:' + name]) {
    try { await import(specifier); console.log('ESCAPED import ' + specifier); } catch (e) { report('import', e); }
  }
})();
"""


@pytest.mark.parametrize("name", BLOCKED_BUILTINS)
def test_blocked_builtin_is_refused_by_require_and_import_with_and_without_scheme(run_js: RunJs, name: str) -> None:
    result = run_js(FOUR_SPELLINGS.replace("NAME", json.dumps(name)), timeout_s=5)
    out = output_of(result)
    assert result.exit_code == 0, out
    assert out.count(module_message(name)) == 4, out


# --- other spellings, one program each ----------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    id: str
    code: str
    expect: str
    exit_nonzero: bool = False


# Prints a caught error as "<label> -> <code>: <message>".
REPORT = "const report = (label, e) => console.log(`${label} -> ${e && e.code}: ${e && e.message}`);\n"

READ_PASSWD = "console.log('ESCAPED', require('fs').readFileSync('/etc/passwd', 'utf8'))"

HOSTILE = [
    Hostile("require-uncaught", READ_PASSWD, "Error: " + module_message("fs").split(": ", 1)[1], exit_nonzero=True),
    Hostile(
        "import-uncaught",
        "import('node:child_process').then(cp => console.log('ESCAPED', cp.execFileSync(process.execPath, "
        "['-e', 'console.log(1)']).toString()))",
        'Error: Module "child_process" is blocked in the sandbox (node:child_process)',
        exit_nonzero=True,
    ),
    Hostile(
        "node-test-runner",
        REPORT + "try { require('node:test'); console.log('ESCAPED'); } catch (e) { report('test', e); }",
        module_message("test"),
    ),
    Hostile(
        "import-uppercase-scheme",
        REPORT + "import('NODE:fs').then(() => console.log('ESCAPED'), e => report('import', e));",
        module_message("fs"),
    ),
    Hostile(
        "import-data-url",
        REPORT
        + 'import(\'data:text/javascript,import fs from "fs"; console.log(fs.readFileSync("/etc/passwd", "utf8"))\')'
        ".then(() => console.log('ESCAPED'), e => report('import', e));",
        "is blocked in the sandbox (data: URLs cannot be imported)",
    ),
    Hostile(
        "import-file-url",
        REPORT + "import('file:///etc/passwd').then(() => console.log('ESCAPED'), e => report('import', e));",
        path_message("file:///etc/passwd"),
    ),
    Hostile(
        "import-absolute-path",
        REPORT + "import('/etc/passwd').then(() => console.log('ESCAPED'), e => report('import', e));",
        path_message("/etc/passwd"),
    ),
    Hostile(
        "import-from-new-function",
        REPORT + "new Function('return import(\"fs\")')().then(() => console.log('ESCAPED'), e => report('fn', e));",
        module_message("fs"),
    ),
    Hostile(
        "import-from-eval",
        REPORT + "eval('import(\"child_process\")').then(() => console.log('ESCAPED'), e => report('eval', e));",
        module_message("child_process"),
    ),
    Hostile(
        "import-from-a-module-compiled-at-run-time",
        REPORT
        + """
        const m = new module.constructor('/app/late.js', null);
        m._compile("module.exports = import('node:fs/promises')", '/app/late.js');
        m.exports.then(() => console.log('ESCAPED'), e => report('late', e));
        """,
        module_message("fs/promises"),
    ),
    Hostile(
        "module-create-require",
        REPORT + "try { require('module').createRequire('/app/x.js')('fs'); console.log('ESCAPED'); }"
        " catch (e) { report('createRequire', e); }",
        module_message("fs"),
    ),
    Hostile(
        "create-require-outside-app",
        REPORT + "try { console.log('ESCAPED', require('module').createRequire('/etc/x.js')('./passwd')); }"
        " catch (e) { report('createRequire', e); }",
        path_message("./passwd"),
    ),
    Hostile(
        "module-constructor-load",
        REPORT + "try { module.constructor._load('child_process'); console.log('ESCAPED'); }"
        " catch (e) { report('_load', e); }",
        module_message("child_process"),
    ),
    Hostile(
        "process-main-module-require",
        REPORT + "try { process.mainModule.require('fs'); console.log('ESCAPED'); } catch (e) { report('main', e); }",
        module_message("fs"),
    ),
    Hostile(
        "require-main-require",
        REPORT + "try { require.main.require('fs/promises'); console.log('ESCAPED'); }"
        " catch (e) { report('main', e); }",
        module_message("fs/promises"),
    ),
    Hostile(
        "module-cache-and-parent-chain",
        REPORT
        + """
        const keys = Object.keys(require.cache);
        if (keys.length !== 1 || keys[0] !== '/app/main.js') console.log('ESCAPED runner modules cached', keys);
        let top = module; while (top.parent) top = top.parent;
        for (const m of [top, ...Object.values(require.cache), ...module.children]) {
          try { m.require('fs'); console.log('ESCAPED'); } catch (e) { report(m.id, e); }
        }
        """,
        module_message("fs"),
    ),
    Hostile(
        "fresh-module-compile",
        REPORT
        + """
        const m = new module.constructor('/app/other.js', null);
        try { m._compile("module.exports = require('fs')", '/app/other.js'); console.log('ESCAPED'); }
        catch (e) { report('_compile', e); }
        """,
        module_message("fs"),
    ),
    Hostile(
        "require-absolute-path",
        REPORT + "try { require('/etc/passwd'); console.log('ESCAPED'); } catch (e) { report('require', e); }",
        path_message("/etc/passwd"),
    ),
    Hostile(
        "require-relative-path-out-of-app",
        REPORT + "try { require('../etc/passwd'); console.log('ESCAPED'); } catch (e) { report('require', e); }",
        path_message("../etc/passwd"),
    ),
    Hostile(
        "require-the-runners-own-files",
        REPORT + "try { require('/opt/metaagent/gate.js'); console.log('ESCAPED'); } catch (e) { report('r', e); }",
        path_message("/opt/metaagent/gate.js"),
    ),
    Hostile(
        "require-debian-global-package-is-not-found",
        # Resolution probes only the allowed folders: Debian's /usr/share/nodejs is not even looked at.
        REPORT + "try { require('undici'); console.log('ESCAPED'); } catch (e) { report('require', e); }",
        "require -> MODULE_NOT_FOUND: Cannot find module 'undici'",
    ),
    Hostile(
        "node-path-at-run-time",
        REPORT
        + """
        process.env.NODE_PATH = '/etc';
        try { require('module')._initPaths(); console.log('ESCAPED'); } catch (e) { report('initPaths', e); }
        module.paths.push('/etc');
        try { require('passwd'); console.log('ESCAPED'); } catch (e) { report('require', e); }
        """,
        api_message("module._initPaths"),
    ),
    Hostile(
        "require-extensions-js-reads-any-file",
        REPORT
        + """
        const fake = { _compile: (text) => console.log('ESCAPED', text) };
        try { require.extensions['.js'](fake, '/etc/passwd'); } catch (e) { report('extensions', e); }
        """,
        path_message("/etc/passwd"),
    ),
    Hostile(
        "require-extensions-json-reads-any-file",
        REPORT
        + """
        const fake = {};
        try { module.constructor._extensions['.json'](fake, '/etc/passwd'); console.log('ESCAPED', fake); }
        catch (e) { report('extensions', e); }
        """,
        path_message("/etc/passwd"),
    ),
    Hostile(
        "module-load-any-file",
        REPORT
        + """
        const m = new module.constructor('x');
        m._compile = (text) => console.log('ESCAPED', text);
        try { m.load('/etc/passwd'); } catch (e) { report('load', e); }
        """,
        path_message("/etc/passwd"),
    ),
    Hostile(
        "module-run-main",
        # runMain loads an ES module main through node's ESM loader, outside the gate: refused outright.
        REPORT + "process.argv[1] = '/etc/passwd';"
        " try { require('module').runMain(); console.log('ESCAPED'); } catch (e) { report('runMain', e); }",
        api_message("module.runMain"),
    ),
    Hostile(
        "module-preload-modules",
        REPORT + "try { require('module')._preloadModules(['child_process']); console.log('ESCAPED'); }"
        " catch (e) { report('preload', e); }",
        api_message("module._preloadModules"),
    ),
    Hostile(
        "request-object-that-changes-its-name",
        REPORT
        + """
        let calls = 0;
        const request = { toString() { return calls++ ? 'fs' : 'path'; } };
        try { const m = module.constructor._load(request); if (m.readFileSync) console.log('ESCAPED'); }
        catch (e) { report('_load', e); }
        """,
        'ERR_INVALID_ARG_TYPE: The "request" argument must be of type string',
    ),
    Hostile(
        "process-binding-fs",
        REPORT + "try { console.log('ESCAPED', process.binding('fs')); } catch (e) { report('binding', e); }",
        api_message("process.binding"),
    ),
    Hostile(
        "process-binding-spawn-sync",
        REPORT + "try { console.log('ESCAPED', process.binding('spawn_sync')); } catch (e) { report('binding', e); }",
        api_message("process.binding"),
    ),
    Hostile(
        "process-linked-binding",
        REPORT + "try { console.log('ESCAPED', process._linkedBinding('fs')); } catch (e) { report('linked', e); }",
        api_message("process._linkedBinding"),
    ),
    Hostile(
        "process-dlopen",
        REPORT + "try { process.dlopen({ exports: {} }, '/usr/lib/x86_64-linux-gnu/libz.so.1');"
        " console.log('ESCAPED'); } catch (e) { report('dlopen', e); }",
        api_message("process.dlopen"),
    ),
    Hostile(
        "process-report-writes-a-file",
        REPORT + "try { process.report.writeReport('/tmp/report.json'); console.log('ESCAPED'); }"
        " catch (e) { report('report', e); }",
        api_message("process.report.writeReport"),
    ),
    Hostile(
        "source-maps-read-any-file",
        # With source maps on, node reads the file a map names and prints its line in the trace.
        REPORT
        + """
        try { process.setSourceMapsEnabled(true); } catch (e) { report('sourcemaps', e); }
        const map = { version: 3, sources: ['file:///etc/passwd'], names: [], mappings: 'AAAA;AACA' };
        const url = 'data:application/json;base64,' + Buffer.from(JSON.stringify(map)).toString('base64');
        new module.constructor('/app/x.js')._compile('\\nthrow new Error("probe")\\n//# sourceMappingURL=' + url,
          '/app/x.js');
        """,
        api_message("process.setSourceMapsEnabled"),
        exit_nonzero=True,
    ),
    Hostile(
        "module-register-user-hooks",
        REPORT + "try { require('module').register('data:text/javascript,export const resolve = (s, c, n) => n(s, c)');"
        " console.log('ESCAPED'); } catch (e) { report('register', e); }",
        api_message("module.register"),
    ),
    Hostile(
        "esm-facades-show-the-hardened-exports",
        REPORT
        + """
        (async () => {
          const mod = await import('node:module'), proc = await import('node:process');
          try { mod.register('data:text/javascript,'); console.log('ESCAPED'); } catch (e) { report('register', e); }
          try { proc.binding('fs'); console.log('ESCAPED'); } catch (e) { report('binding', e); }
          try { mod._load('fs'); console.log('ESCAPED'); } catch (e) { report('_load', e); }
        })();
        """,
        api_message("process.binding"),
    ),
    Hostile(
        "crypto-set-engine-dlopens",
        REPORT + "try { require('crypto').setEngine('dynamic'); console.log('ESCAPED'); }"
        " catch (e) { report('setEngine', e); }",
        api_message("crypto.setEngine"),
    ),
    Hostile(
        "tls-engine-option-dlopens",
        REPORT + "try { require('https').request({ host: '127.0.0.1', port: 9, privateKeyIdentifier: 'x',"
        " privateKeyEngine: '/usr/lib/x86_64-linux-gnu/libz.so.1' }); console.log('ESCAPED'); }"
        " catch (e) { report('engine', e); }",
        api_message("the privateKeyEngine TLS option"),
    ),
    Hostile(
        "debug-process",
        REPORT
        + "try { process._debugProcess(process.pid); console.log('ESCAPED'); } catch (e) { report('debug', e); }",
        api_message("process._debugProcess"),
    ),
    Hostile(
        "worker-event-of-the-hooks-thread",
        # register() announces its internal Worker on process 'worker': the gate registers long before.
        "process.on('worker', w => console.log('ESCAPED worker', w.constructor.name));"
        "setTimeout(() => console.log('no worker event'), 300);",
        "no worker event",
    ),
    Hostile(
        "stdin-constructor",
        """
        const Stdin = process.stdin.constructor;
        console.log('stdin is a', Stdin.name);
        const s = new Stdin({ path: '/etc/passwd', fd: 0 });
        s.on('data', d => console.log('ESCAPED', String(d))).on('error', () => {});
        """,
        "stdin is a Readable",
    ),
    Hostile(
        "function-constructor-process-is-the-gated-one",
        REPORT
        + """
        const p = this.constructor.constructor('return process')();
        if (p !== process) console.log('ESCAPED: another process object');
        try { p.binding('fs'); console.log('ESCAPED'); } catch (e) { report('binding', e); }
        try { p.mainModule.require('fs'); console.log('ESCAPED'); } catch (e) { report('require', e); }
        """,
        api_message("process.binding"),
    ),
    Hostile(
        "fetch-file-url",
        "fetch('file:///etc/passwd').then(r => r.text()).then(t => console.log('ESCAPED', t),"
        " e => console.log('fetch refused:', e.message, e.cause && e.cause.message));",
        "fetch refused: fetch failed",
    ),
]

SIGUSR1 = """
// SIGUSR1 starts node's inspector on 127.0.0.1:9229, and http can speak to it without a network.
process.kill(PID, 'SIGUSR1');
setTimeout(() => {
  require('http').get('http://127.0.0.1:9229/json/list', res => {
    let body = ''; res.on('data', d => body += d).on('end', () => console.log('ESCAPED inspector', body));
  }).on('error', e => console.log('inspector:', e.code));
}, 300);
"""
HOSTILE += [
    Hostile("sigusr1-to-self-starts-no-inspector", SIGUSR1.replace("PID", "process.pid"), "inspector: ECONNREFUSED"),
    Hostile("sigusr1-to-pid-1-starts-no-inspector", SIGUSR1.replace("PID", "1"), "inspector: ECONNREFUSED"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[case.id for case in HOSTILE])
def test_hostile_spelling_is_refused(run_js: RunJs, case: Hostile) -> None:
    result = run_js(case.code, timeout_s=5)
    out = output_of(result)
    assert case.expect in out
    if case.exit_nonzero:
        assert result.exit_code != 0, out
        assert BLOCKED_MODULE in out or BLOCKED_API in out
    else:
        assert result.exit_code == 0, out


# --- the classes of the gate's review: forged replies, reachable handles, probes without fs ----------

# Every method a hooks thread's channel would use, replaced by one that answers any request with fs, as a
# forged reply from a hooks thread would. With import() decided on this thread, none of them is called.
FORGED_REPLIES = """
const forged = { status: 'success', body: { format: 'builtin', responseURL: 'node:fs', source: null } };
let calls = 0;
const targets = [MessagePort.prototype, EventTarget.prototype, BroadcastChannel.prototype, MessageChannel.prototype];
for (const target of targets) {
  for (const key of Reflect.ownKeys(target)) {
    const d = Object.getOwnPropertyDescriptor(target, key);
    if (key === 'constructor' || typeof d.value !== 'function' || !d.configurable) continue;
    Object.defineProperty(target, key, { value: function (...args) {
      calls++;
      if (args[0] && typeof args[0] === 'object') Object.assign(args[0], forged);
      return forged;
    }, configurable: true, writable: true });
  }
}
for (const key of ['wait', 'notify', 'waitAsync', 'load', 'store']) Atomics[key] = () => { calls++; return 'ok'; };
(async () => {
  const decoder = await import('node:string_decoder');
  const { StringDecoder, readFileSync } = decoder;
  console.log('string_decoder:', typeof StringDecoder, typeof readFileSync, typeof decoder.default.readFileSync);
  for (const s of ['node:fs', 'fs/promises', 'child_process', 'node:net', 'worker_threads']) {
    await import(s).then(() => console.log('ESCAPED', s), e => console.log(s, '->', e.code));
  }
  console.log('channel calls:', calls);
})();
"""


def test_import_answers_come_from_the_gate_not_a_channel_user_code_can_forge(run_js_both: RunJs) -> None:
    result = run_js_both(FORGED_REPLIES)
    out = output_of(result)
    assert result.exit_code == 0, out
    assert "string_decoder: function undefined undefined" in out
    for name in ("node:fs", "fs/promises", "child_process", "node:net", "worker_threads"):
        assert f"{name} -> {BLOCKED_MODULE}" in out
    assert "channel calls: 0" in out


HANDLES = (
    REPORT
    + """
const pending = import('node:path');
const resources = process.getActiveResourcesInfo();
console.log('while import() is pending:', resources.filter(r => /Port|Worker|Message/.test(r)).join(',') || 'no port');
for (const [label, call] of [
  ['activeHandles', () => process._getActiveHandles()],
  ['activeRequests', () => process._getActiveRequests()],
  ['createHook', () => require('async_hooks').createHook({ init() {} }).enable()],
  ['executionAsyncResource', () => require('async_hooks').executionAsyncResource()],
]) {
  try { const got = call(); console.log('ESCAPED', label, got); } catch (e) { report(label, e); }
}
pending.then(async () => {
  const hooks = await import('node:async_hooks');
  try { hooks.createHook({}); console.log('ESCAPED import'); } catch (e) { report('import createHook', e); }
  for (const name of ['stdin', 'stdout', 'stderr']) {
    const stream = process[name];
    console.log(name, typeof stream._handle, stream.constructor.name);
  }
  // domain, which node builds on createHook, still works.
  const d = require('domain').create();
  d.on('error', (e) => console.log('domain caught', e.message));
  d.run(() => setTimeout(() => { throw new Error('in a domain'); }, 1));
});
"""
)


def test_no_handle_of_the_runner_is_reachable(run_js_both: RunJs) -> None:
    result = run_js_both(HANDLES)
    out = output_of(result)
    assert result.exit_code == 0, out
    assert "while import() is pending: no port" in out
    for api in (
        "process._getActiveHandles",
        "process._getActiveRequests",
        "async_hooks.createHook",
        "async_hooks.executionAsyncResource",
    ):
        assert api_message(api) in out
    assert f"import createHook -> {api_message('async_hooks.createHook')}" in out
    for name, kind in (("stdin", "Readable"), ("stdout", "Writable"), ("stderr", "Writable")):
        assert f"{name} undefined {kind}" in out
    assert "domain caught in a domain" in out


# Each probe runs twice: on a path that exists and on one that does not. The answers must be the same
# (the path's name aside): a difference would tell user code that the path exists.
PROBES = """
const M = require('module');
const http = require('http');
const Socket = Object.getPrototypeOf(require('tty').ReadStream);
const probes = {
  findPath: (p) => M._findPath(p, ['']),
  findPathIn: (p) => M._findPath(require('path').basename(p), [require('path').dirname(p)]),
  findPathRelative: (p) => M._findPath('../..' + p, ['/app/node_modules']),
  stat: (p) => M._stat(p),
  readPackage: (p) => M._readPackage(p),
  resolvePaths: (p) => require.resolve(require('path').basename(p), { paths: [require('path').dirname(p)] }),
  modulePaths: (p) => {
    module.paths.unshift(require('path').dirname(p));
    return require(require('path').basename(p));
  },
  requireRelative: (p) => require('../..' + p),
  requireAbsolute: (p) => require(p),
  chdir: (p) => process.chdir(p),
  socketConnect: (p) => new Socket().connect(p),
  httpSocketPath: (p) => http.get({ socketPath: p, path: '/' }),
  listenPath: (p) => new http.Server().listen(p),
};
const answer = (fn, path) => {
  try { const v = fn(path); return 'returned ' + (typeof v === 'object' && v ? v.constructor.name : String(v)); }
  catch (e) {
    const message = String(e.message).split('\\n')[0];
    return `${e.code}: ${message.split(path).join('<path>').split(require('path').basename(path)).join('<name>')}`;
  }
};
for (const [name, fn] of Object.entries(probes)) {
  for (const [existing, missing] of [['/etc/passwd', '/etc/no-such-file'], ['/proc/self/fd/1', '/proc/self/fd/999']]) {
    const a = answer(fn, existing), b = answer(fn, missing);
    console.log(a === b ? 'same' : 'DIFFERENT', name, existing, '|', a, '|', b);
  }
}
"""


def test_no_probe_tells_whether_a_path_exists(run_js_both: RunJs) -> None:
    result = run_js_both(PROBES)
    out = output_of(result)
    assert result.exit_code == 0, out
    lines = result.stdout.splitlines()
    assert len(lines) == 26, out
    assert [line for line in lines if not line.startswith("same ")] == []
    # And each probe is a refusal or a not-found, never an answer about the file.
    assert all(
        f"{BLOCKED_API}:" in line
        or f"{BLOCKED_MODULE}:" in line
        or "returned false" in line
        or "MODULE_NOT_FOUND" in line
        for line in lines
    ), out


# net.Socket is reachable (through tty's prototype chain) and a socket made on a descriptor holds a native
# Pipe handle. The handle's class makes more, whose bind() takes any path: a Unix socket file made where
# the gated listen() refuses one, and an answer that differs between a folder that exists and one that does not.
RAW_PIPE_BIND = """
const Socket = Object.getPrototypeOf(require('tty').ReadStream);
let Handle;
try { Handle = new Socket({ fd: 0, readable: true, writable: false })._handle.constructor; } catch (e) { Handle = e; }
const answer = (path) => {
  try {
    const status = new Handle(0).bind(path);
    return status === 0 ? 'bound' : require('util').getSystemErrorName(status);
  } catch (e) { return e.code || e.name; }
};
const answers = { existing: answer('/etc/x'), missing: answer('/no-such-folder/x'), tmp: answer('/tmp/s.sock') };
console.log(JSON.stringify(answers));
process.exit(0);
"""


@pytest.mark.security
def test_no_raw_pipe_handle_binds_a_path(run_js_both: RunJs) -> None:
    result = run_js_both(RAW_PIPE_BIND)
    assert result.exit_code == 0, output_of(result)
    answers = json.loads(result.stdout.splitlines()[-1])
    assert "bound" not in answers.values(), answers
    assert answers["existing"] == answers["missing"], answers


# Properties planted on Object.prototype ride along with every options object made as a literal: the gate
# hands node only null-prototype options, so a forged V8 code cache or import callback is never used.
PLANTED_OPTIONS = (
    REPORT
    + """
Object.prototype.cachedData = Buffer.from('forged bytecode');
Object.prototype.produceCachedData = true;
Object.prototype.importModuleDynamically = () => { console.log('ESCAPED planted callback'); return {}; };
Object.prototype.path = '/etc/passwd';
const m = new module.constructor('/app/x.js', null);
m._compile("module.exports = { value: 6 * 7, fs: import('fs') }", '/app/x.js');
console.log('compiled', m.exports.value);
m.exports.fs.then(() => console.log('ESCAPED'), e => report('import', e));
require('http').get('http://127.0.0.1:9/').on('error', e => console.log('http', e.code));
"""
)


def test_properties_planted_on_object_prototype_do_not_reach_the_gate(run_js_both: RunJs) -> None:
    result = run_js_both(PLANTED_OPTIONS)
    out = output_of(result)
    assert result.exit_code == 0, out
    assert "compiled 42" in out
    assert f"import -> {module_message('fs')}" in out
    assert "http ECONNREFUSED" in out  # a TCP connection, not the planted Unix socket path


# --- native handles, as a class (runner/handles.js) ------------------------------------------------

# Every way from user code to a native handle on a descriptor: tty's streams (a TTY handle on the number
# given), net.Socket on a descriptor (a Pipe or TCP handle's open(fd)), the class behind a live handle and
# its bases, and process.binding. Each must be refused; any raw byte it got out would say FORGED.
NATIVE_HANDLES = (
    REPORT
    + """
const tty = require('tty');
const Socket = Object.getPrototypeOf(tty.ReadStream);
const attempts = [
  ['tty.WriteStream(1)', () => new tty.WriteStream(1).write('FORGED raw bytes on fd 1\\n')],
  ['tty.WriteStream(2)', () => new tty.WriteStream(2).write('FORGED raw bytes on fd 2\\n')],
  ['tty.WriteStream(1) called', () => tty.WriteStream(1).write('FORGED\\n')],
  ['tty.ReadStream(0)', () => new tty.ReadStream(0).on('data', (d) => console.log('ESCAPED read', d.length))],
  ['node:tty', () => new (require('node:tty').WriteStream)(1).write('FORGED\\n')],
  ['Module._load tty', () => new (module.constructor._load('tty').WriteStream)(1).write('FORGED\\n')],
  ['net.Socket(1)', () => new Socket(1).write('FORGED\\n')],
  ['process.binding', () => process.binding('tty_wrap')],
];
for (let fd = 0; fd < 12; fd++) {
  attempts.push([`net.Socket fd ${fd}`, () => new Socket({ fd, readable: true, writable: true }).write('FORGED\\n')]);
}
// A live TCP handle with a descriptor: a server listening on the loopback.
const server = require('http').createServer().listen(0);
const handle = server._handle;
attempts.push(['TCP class', () => new handle.constructor(0)]);
let depth = 0;
for (let p = Object.getPrototypeOf(handle); p !== null && p !== Object.prototype; p = Object.getPrototypeOf(p)) {
  const base = p.constructor;
  attempts.push([`TCP base ${depth++}`, () => new base(1)]);
}
attempts.push(['TCP open(1)', () => handle.open(1)]);
attempts.push(['net.Socket on its own TCP descriptor', () => new Socket({ fd: handle.fd })]);
for (const [label, attempt] of attempts) {
  try { attempt(); console.log('ESCAPED', label); } catch (e) { report(label, e); }
}
server.close();
console.log('real output after', attempts.length, 'attempts');
"""
)


def assert_native_handles_refused(out: str) -> None:
    assert "FORGED" not in out, out
    for label, api in (
        ("tty.WriteStream(1)", "tty.WriteStream"),
        ("tty.WriteStream(2)", "tty.WriteStream"),
        ("tty.WriteStream(1) called", "tty.WriteStream"),
        ("tty.ReadStream(0)", "tty.ReadStream"),
        ("node:tty", "tty.WriteStream"),
        ("Module._load tty", "tty.WriteStream"),
        ("net.Socket(1)", "A handle on a file descriptor (pipe_wrap.Pipe#open)"),
        ("process.binding", "process.binding"),
        ("net.Socket fd 0", "A handle on a file descriptor (pipe_wrap.Pipe#open)"),
        ("net.Socket fd 1", "A handle on a file descriptor (pipe_wrap.Pipe#open)"),
        ("net.Socket fd 2", "A handle on a file descriptor (pipe_wrap.Pipe#open)"),
        ("TCP class", "The native handle class tcp_wrap.TCP"),
        ("TCP open(1)", "A handle on a file descriptor (tcp_wrap.TCP#open)"),
        ("net.Socket on its own TCP descriptor", "A handle on a file descriptor (tcp_wrap.TCP#open)"),
    ):
        assert f"{label} -> {api_message(api)}" in out, (label, out)
    # The TCP handle's prototype chain (TCP, LibuvStreamWrap, HandleWrap, AsyncWrap, BaseObject): each
    # prototype's constructor is a refusal.
    bases = [line for line in out.splitlines() if line.startswith("TCP base ")]
    assert len(bases) == 5, out
    assert all(f"-> {BLOCKED_API}: The native handle class " in line for line in bases), out
    # Descriptors 3 and up are node's own (its event loop's) or none: refused, or not a stream at all.
    for fd in range(3, 12):
        line = next(line for line in out.splitlines() if line.startswith(f"net.Socket fd {fd} -> "))
        assert f"-> {BLOCKED_API}: " in line or "-> ERR_INVALID_FD_TYPE: " in line, line
    assert "real output after" in out


def test_no_native_handle_reaches_a_descriptor_in_a_run(run_js_both: RunJs) -> None:
    result = run_js_both(NATIVE_HANDLES)
    out = output_of(result)
    assert result.exit_code == 0, out
    assert_native_handles_refused(out)


def session_call(service: Any, session_id: str, code: str) -> dict[str, Any]:
    response = httpx2.post(
        f"{service.base_url}/sessions/{session_id}/execute", json={"code": code, "timeout_s": 10}, timeout=120
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_no_native_handle_reaches_a_descriptor_in_a_session_and_its_wire_stays_intact(sandbox_service: Any) -> None:
    created = httpx2.post(f"{sandbox_service.base_url}/sessions", json={}, timeout=120)
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    try:
        first = session_call(sandbox_service, session_id, NATIVE_HANDLES + "\n'first done'")
        out = output_of(SimpleNamespace(timed_out=first["timed_out"], stdout=first["stdout"], stderr=first["stderr"]))
        assert first["session_ended"] is False, first
        assert first["result"] == "'first done'", first
        assert_native_handles_refused(out)
        # The wire is the runner's still: the next calls run, and what they answer is their own.
        for n in (1, 2):
            later = session_call(sandbox_service, session_id, f"console.log('later call {n}'); {n} * 21")
            assert later["session_ended"] is False, later
            assert later["exit_code"] == 0, later
            assert later["stdout"] == f"later call {n}\n", later
            assert later["result"] == str(n * 21), later
    finally:
        httpx2.delete(f"{sandbox_service.base_url}/sessions/{session_id}", timeout=120)


# Below the gate's own wrappers: a stream handle that node's constructors made on descriptor 0, 1 or 2
# (as the runner could, through process.binding) refuses every method of its stream base, so that no
# JavaScript wrapper nobody thought of can move a byte on the runner's stdio. And the classes handles.js
# gates are the ones node's bindings hold, found by the runner from node itself.
HANDLE_BASE = """
const fs = require('fs');
const say = (line) => fs.writeSync(2, line + '\\n');
const handles = require('/opt/metaagent/handles.js');
say('classes ' + handles.labels().join(' '));
handles.install();
const report = (label, call) => {
  try { call(); say('ESCAPED ' + label); } catch (e) { say(`${label} -> ${e.code}: ${e.message}`); }
};
const { TTY } = process.binding('tty_wrap');
for (const fd of [0, 1, 2]) {
  const made = {};
  const tty = new TTY(fd, made);
  if (made.code !== undefined) {
    say(`TTY(${fd}) not made: ${made.code}`); // not a pipe here (fd 0 is /dev/null)
    continue;
  }
  report(`TTY(${fd}).writeUtf8String`, () => tty.writeUtf8String({}, 'FORGED\\n'));
  report(`TTY(${fd}).readStart`, () => tty.readStart());
  report(`TTY(${fd}).setBlocking`, () => tty.setBlocking(true));
}
const { FileHandle } = process.binding('fs');
report('FileHandle(1).close', () => new FileHandle(1).close());
report('FileHandle(1).writeBuffer', () => new FileHandle(1).writeBuffer({}, Buffer.from('FORGED\\n')));
say('done');
process.exit(0);
"""


def test_a_stream_handle_on_the_runners_stdio_moves_no_byte(
    sandbox_service: Any, docker_client: docker.DockerClient
) -> None:
    tag = sandbox_service.get("/health").json()["checks"]["sandbox_image"]["tag"]
    err = docker_client.containers.run(
        tag,
        ["/usr/bin/node", "-e", HANDLE_BASE],
        network_disabled=True,
        network_mode="none",
        user="1001:1001",
        read_only=True,
        remove=True,
        stdout=False,
        stderr=True,
    ).decode()
    assert "ESCAPED" not in err, err
    assert "FORGED" not in err, err
    classes = next(line for line in err.splitlines() if line.startswith("classes ")).split()[1:]
    for label in (
        "tty_wrap.TTY",
        "pipe_wrap.Pipe",
        "tcp_wrap.TCP",
        "udp_wrap.UDP",
        "fs.FileHandle",
        "process_wrap.Process",
    ):
        assert label in classes, classes
    for fd in (1, 2):  # pipes to the engine, as in a run (fd 0 here is /dev/null, where no TTY is made)
        refusal = api_message(f"A LibuvStreamWrap handle on descriptor {fd} (the runner's stdio)")
        for method in ("writeUtf8String", "readStart", "setBlocking"):
            assert f"TTY({fd}).{method} -> {refusal}" in err, (method, err)
    for method in ("close", "writeBuffer"):
        assert f"FileHandle(1).{method} -> {BLOCKED_API}: A FileHandle handle on descriptor 1" in err, err
    assert err.rstrip().endswith("done"), err


# --- prototype poisoning ------------------------------------------------------------------------------

POISON_ATTEMPTS = """
const M = module.constructor;
const log = console.log.bind(console);
const gopd = Object.getOwnPropertyDescriptor;
const field = (e, key) => { const d = e && gopd(e, key); return d ? d.value : 'none'; };
const report = (label, e) => log(`${label} -> ${field(e, 'code')}: ${field(e, 'message')}`);
POISON
const attempts = [
  ['require', () => require('fs')],
  ['require node:', () => require('node:fs')],
  ['require child_process', () => require('child_process')],
  ['_load', () => M._load('fs')],
  ['createRequire', () => M.createRequire('/app/x.js')('fs/promises')],
  ['path', () => require('/etc/passwd')],
  ['extensions', () => require.extensions['.js']({ _compile: (t) => log('ESCAPED ' + t) }, '/etc/passwd')],
  ['binding', () => process.binding('fs')],
];
for (let k = 0; k < attempts.length; k++) {
  const label = attempts[k][0], attempt = attempts[k][1];
  try { attempt(); log('ESCAPED', label); } catch (e) { report(label, e); }
}
import('fs').then(() => log('ESCAPED import'), (e) => report('import', e));
"""

# What a guard written with the live built-ins would call: each made to answer "not blocked".
POISON_GATE_HELPERS = """
const no = () => false;
Array.prototype.includes = no; Array.prototype.indexOf = () => -1; Array.prototype.some = no;
String.prototype.startsWith = no; String.prototype.endsWith = no; String.prototype.slice = () => 'path';
String.prototype.includes = no; String.prototype.toLowerCase = () => 'path';
Set.prototype.has = no; Map.prototype.get = () => undefined; Map.prototype.has = no;
Object.prototype.hasOwnProperty = no; Object.hasOwn = no;
Object.defineProperty(Object.prototype, 'code', { set(v) {}, get() { return 'POISONED'; }, configurable: true });
RegExp.prototype.test = () => true; RegExp.prototype.exec = () => null;
Reflect.apply = () => ({}); Reflect.has = no; Object.defineProperty = (o) => o; Object.freeze = (o) => o;
Function.prototype.call = function () { return {}; };
Function.prototype.apply = function () { return {}; };
"""

# Poisoning of iterators and of Object.prototype, which node's own plumbing reads: every spelling, import()
# included (decided on this thread with captured built-ins), is still refused with the gate's errors.
POISON_DEEPER = (
    POISON_GATE_HELPERS
    + """
Array.prototype[Symbol.iterator] = function* () {};
Object.defineProperty(Object.prototype, 'get', { value: () => ({}), configurable: true, writable: true });
"""
)


@pytest.mark.parametrize(
    "poison", [POISON_GATE_HELPERS, POISON_DEEPER], ids=["gate-helpers-poisoned", "iterators-and-descriptors-poisoned"]
)
def test_prototype_poisoning_does_not_open_the_gate(run_js: RunJs, poison: str) -> None:
    result = run_js(POISON_ATTEMPTS.replace("POISON", poison), timeout_s=5)
    out = output_of(result)
    assert result.exit_code == 0, out
    lines = result.stdout.splitlines()
    blocked = [line for line in lines if f"-> {BLOCKED_MODULE}: " in line or f"-> {BLOCKED_API}: " in line]
    assert len(blocked) == 9, out  # the eight attempts and import()
    assert f'require -> {BLOCKED_MODULE}: Module "fs" is blocked in the sandbox (node:fs)' in lines
    assert f"binding -> {BLOCKED_API}: process.binding is blocked in the sandbox" in lines
    assert f'import -> {BLOCKED_MODULE}: Module "fs" is blocked in the sandbox (node:fs)' in lines


# --- benign programs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Benign:
    id: str
    code: str
    stdout: str
    stdin: str = ""


ALLOWED_BUILTINS = [
    "assert", "assert/strict", "async_hooks", "buffer", "console", "constants", "crypto", "diagnostics_channel",
    "dns", "dns/promises", "domain", "events", "http", "https", "module", "os", "path", "path/posix", "path/win32",
    "perf_hooks", "process", "punycode", "querystring", "readline", "readline/promises", "stream",
    "stream/consumers", "stream/promises", "stream/web", "string_decoder", "sys", "timers", "timers/promises",
    "tty", "url", "util", "util/types", "zlib",
]  # fmt: skip

BENIGN = [
    Benign(
        "every-allowed-builtin-loads-in-every-spelling",
        f"""
        process.noDeprecation = true; // sys is deprecated (DEP0025)
        const names = {json.dumps(ALLOWED_BUILTINS)};
        (async () => {{
          let loaded = 0;
          for (const n of names) {{
            require(n); require('node:' + n); await import(n); await import('node:' + n); loaded++;
          }}
          console.log(loaded);
        }})();
        """,
        f"{len(ALLOWED_BUILTINS)}\n",
    ),
    Benign(
        "crypto",
        "const c = require('crypto'); console.log(c.createHash('sha256').update('abc').digest('hex').slice(0, 16),"
        " c.randomBytes(8).length, typeof c.webcrypto.subtle.digest)",
        "ba7816bf8f01cfea 8 function\n",
    ),
    Benign(
        "zlib",
        "const z = require('zlib'); const data = Buffer.from('hello '.repeat(100));"
        " console.log(z.gunzipSync(z.gzipSync(data)).equals(data), z.inflateRawSync(z.deflateRawSync(data)).length)",
        "true 600\n",
    ),
    Benign(
        "timers-promises",
        "const { setTimeout: sleep } = require('timers/promises');"
        " (async () => { const t = Date.now(); const v = await sleep(20, 'woke');"
        " console.log(v, Date.now() - t >= 15); })();",
        "woke true\n",
    ),
    Benign(
        "path-url-querystring-string-decoder-util",
        """
        const path = require('path'), { URL, fileURLToPath } = require('url'), qs = require('querystring');
        const { StringDecoder } = require('string_decoder'), util = require('util');
        const d = new StringDecoder('utf8');
        console.log(path.join('/a', '../b', 'c.txt'), new URL('https://x.org/p?q=1').searchParams.get('q'),
          fileURLToPath('file:///app/x.js'), qs.stringify({ a: 1, b: 'c d' }),
          d.write(Buffer.from([0xe2, 0x82])) + d.end(Buffer.from([0xac])), util.format('%s=%d', 'n', 42));
        """,
        "/b/c.txt 1 /app/x.js a=1&b=c%20d € n=42\n",
    ),
    Benign(
        "events-stream-buffer",
        """
        const { EventEmitter, once } = require('events');
        const { Readable, Transform } = require('stream'), { pipeline } = require('stream/promises');
        (async () => {
          const e = new EventEmitter(); setTimeout(() => e.emit('go', 7), 5); const [v] = await once(e, 'go');
          const parts = [];
          const upper = new Transform({ transform(c, _, cb) { cb(null, String(c).toUpperCase()); } });
          await pipeline(Readable.from(['a', 'b']), upper,
            async function (src) { for await (const c of src) parts.push(String(c)); });
          console.log(v, parts.join(''), Buffer.from('hi').toString('base64'));
        })();
        """,
        "7 AB aGk=\n",
    ),
    Benign(
        "assert",
        """
        const assert = require('assert'), strict = require('assert/strict');
        assert.deepStrictEqual({ a: [1] }, { a: [1] }); strict.equal(1, 1);
        assert.throws(() => { throw new TypeError('x'); }, TypeError);
        try { assert.strictEqual(1, 2); } catch (e) { console.log(e.code); }
        """,
        "ERR_ASSERTION\n",
    ),
    Benign(
        "os-user-info",
        "const os = require('os'); const u = os.userInfo();"
        " console.log(u.username, u.uid, typeof os.cpus().length, os.platform(), os.EOL === '\\n')",
        "sandbox 1001 number linux true\n",
    ),
    Benign(
        "readline-over-stdin",
        "const rl = require('readline').createInterface({ input: process.stdin }); let n = 0;"
        " rl.on('line', l => { n++; console.log(l.toUpperCase()); }).on('close', () => console.log(n));",
        "ONE\nZWEI ÄÖ\n2\n",
        stdin="one\nzwei äö\n",
    ),
    Benign(
        "http-and-https-load-and-fail-without-network",
        """
        const http = require('http'), https = require('https');
        const codes = [];
        const done = () => codes.length === 2 && console.log(codes.sort().join(' '));
        http.get('http://127.0.0.1:9/').on('error', e => { codes.push('http:' + e.code); done(); });
        https.get('https://127.0.0.1:9/').on('error', e => { codes.push('https:' + e.code); done(); });
        """,
        "http:ECONNREFUSED https:ECONNREFUSED\n",
    ),
    Benign(
        "fetch-is-defined-and-fails-without-network",
        "console.log(typeof fetch, typeof Request, typeof Response);"
        " fetch('http://127.0.0.1:9/').catch(e => console.log(e.name, e.message));",
        "function function function\nTypeError fetch failed\n",
    ),
    Benign(
        "import-node-path",
        "(async () => { const p = await import('node:path'); const t = await import('timers/promises');"
        " await t.setImmediate(); console.log(p.join('a', 'b'), p.default.sep); })();",
        "a/b /\n",
    ),
    Benign(
        "webassembly-in-memory",
        # (module (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add))
        """
        const bytes = new Uint8Array([0,97,115,109,1,0,0,0,1,7,1,96,2,127,127,1,127,3,2,1,0,7,7,1,3,97,100,100,0,0,
          10,9,1,7,0,32,0,32,1,106,11]);
        console.log(WebAssembly.validate(bytes));
        WebAssembly.instantiate(bytes).then(({ instance }) => console.log(instance.exports.add(40, 2)));
        """,
        "true\n42\n",
    ),
    Benign(
        "names-in-strings-and-comments",
        """
        // This program talks about require('fs'), child_process.exec and import('node:fs/promises').
        const words = ["fs", "child_process", "require('fs')", 'worker_threads', "process.binding"];
        /* const cp = require('child_process'); */
        const text = `import fs from 'fs'; ${words.length} words`;
        const fs = { readFileSync: () => 'a local object called fs' };
        console.log(text, fs.readFileSync('/etc/passwd'), words.includes('fs'));
        """,
        "import fs from 'fs'; 5 words a local object called fs true\n",
    ),
    Benign(
        "create-require-resolve-and-builtin-list",
        """
        const m = require('module');
        const r = m.createRequire(__filename);
        console.log(r('path').basename('/a/b.js'), require.resolve('path'), require.resolve('node:url'),
          m.isBuiltin('fs'), m.builtinModules.includes('fs'), typeof m.Module);
        """,
        "b.js path node:url true true function\n",
    ),
    Benign(
        "inspecting-process-and-report",
        "const s = require('util').inspect(process, { depth: 1 });"
        " console.log(s.length > 100, process.report.getReport().header.nodejsVersion, typeof process.binding,"
        " process.listenerCount('SIGUSR1'))",
        "true v18.20.4 function 1\n",
    ),
    Benign(
        "user-errors-keep-their-own-codes",
        "try { require('./missing'); } catch (e) { console.log(e.code); }"
        " try { require('no-such-package'); } catch (e) { console.log(e.code); }"
        " import('./missing.mjs').catch(e => console.log(e.code));",
        "MODULE_NOT_FOUND\nMODULE_NOT_FOUND\nERR_MODULE_NOT_FOUND\n",
    ),
]


@pytest.mark.parametrize("case", BENIGN, ids=[case.id for case in BENIGN])
def test_benign_program_runs(run_js: RunJs, case: Benign) -> None:
    result = run_js(case.code, stdin=case.stdin, timeout_s=5)
    assert not result.timed_out, result
    assert result.stderr == ""
    assert result.exit_code == 0
    assert result.stdout == case.stdout
