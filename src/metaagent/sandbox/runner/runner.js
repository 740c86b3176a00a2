'use strict';
// metaagent trusted runner: the first and only script node loads in a one-shot sandbox container.
//
// Protocol on the real stdin (sent by the host through the attach socket):
//   {"code_bytes": N, "stdin_bytes": M}\n   one UTF-8 JSON header line
//   N bytes                                 the user's JavaScript (UTF-8)
//   M bytes                                 the user's standard input
//   K bytes                                 extra CA certificates (PEM), only with egress (below)
// An execution with network adds "egress_socket" (the tunnel's Unix socket in the container),
// "egress_max_tunnels" and "extra_ca_bytes" (K) to the header; egress.js then routes http, https and
// fetch through that socket. The host may keep stdin open afterwards, so we count bytes and never wait
// for EOF.
//
// A session's header is {"session": true, ...} (with the same egress fields, and no code or stdin):
// the runner then becomes the session's supervisor (supervisor.js), which starts this same runner again
// as its child with {"session": true, "program": true, ...}: that one runs the session's program
// (session.js), and no user code ever runs in the supervisor.
//
// Everything the runner and the gate use once user code runs is captured while this file and the ones
// it requires load, before any payload byte is read: user code can replace globals and prototypes, but
// not these bindings (gate.js lists what the gate relies on).

const Module = require('module');
const fs = require('fs');
const { Buffer } = require('buffer');

// `runner.js --program <command...>`: the container runs that language's program (program.js) as this
// process's child, and no user code ever runs in this process; without it, JavaScript runs here.
const PROGRAM_FLAG = process.argv.indexOf('--program');
const PROGRAM_COMMAND = PROGRAM_FLAG === -1 ? null : process.argv.slice(PROGRAM_FLAG + 1);
const RUNS_JAVASCRIPT = PROGRAM_COMMAND === null;

// The program's stdio and the runner's own reads and writes of fds 0-2; loaded first, as it captures fs.
const stdio = require('./stdio.js');
// What JavaScript's code needs, loaded only where it runs here:
// the module gate (gate.js, with policy.js and imports.js);
const gate = RUNS_JAVASCRIPT ? require('./gate.js') : null;
// egress through the execution's tunnel (it captures net and tls, which the gate refuses to user code);
const egress = RUNS_JAVASCRIPT ? require('./egress.js') : null;
// the session's program loop (session.js; it loads fsgate.js and await.js when a session starts).
const session = RUNS_JAVASCRIPT ? require('./session.js') : null;
// The session's supervisor (supervisor.js): the wire, the workspace's files, the program's output.
const supervisor = require('./supervisor.js');
// A language's program as this process's child (program.js): the other languages' containers.
const program = require('./program.js');
// Out of the CommonJS cache at once: require.cache leads to nothing of the runner's (as for the gate).
for (const file of ['./egress.js', './stdio.js', './session.js', './supervisor.js', './program.js']) {
  delete Module._cache[require.resolve(file)];
}

const processExit = process.exit.bind(process);
const jsonParse = JSON.parse;
const isSafeInteger = Number.isSafeInteger;
const defer = setImmediate;

const USER_FILENAME = '/app/main.js';
const USER_DIRNAME = '/app';
const MAX_HEADER_BYTES = 1024;
const READ_CHUNK = 65536;
const EXIT_BAD_PAYLOAD = 70; // EX_SOFTWARE: tells the host the runner, not the user's code, gave up.
const COUNT_FIELDS = ['code_bytes', 'stdin_bytes', 'extra_ca_bytes'];
const SESSION_FIELD = 'session';
const PROGRAM_FIELD = 'program';
const EGRESS_FIELDS = ['egress_socket', 'egress_max_tunnels', 'extra_ca_bytes'];
const EGRESS_SOCKET_DIR = '/run/metaagent/';
// A one-shot's end token (program.js tells the program's end with it): only where a program is this
// process's child, as only then does this process know when the program has ended.
const END_TOKEN_FIELD = 'end_token';
const END_TOKEN = /^[0-9a-f]{32}$/;
// A session's wire (wire_socket.py): the supervisor's one connection, by a name of 128 random bits.
const WIRE_SOCKET_FIELD = 'wire_socket';
const WIRE_SOCKET = /^\/run\/metaagent-wire\/[A-Za-z0-9_-]{22}\.sock$/;

function badPayload(reason) {
  stdio.writeStderr(`metaagent-runner: bad payload: ${reason}\n`);
  processExit(EXIT_BAD_PAYLOAD);
}

function parseHeader(line) {
  let header;
  try {
    header = jsonParse(line.toString('utf8'));
  } catch (err) {
    return badPayload(`header is not JSON (${err.message})`);
  }
  if (header === null || typeof header !== 'object' || Array.isArray(header)) {
    return badPayload('header is not a JSON object');
  }
  for (const key of Object.keys(header)) {
    if (key !== 'code_bytes' && key !== 'stdin_bytes' && key !== SESSION_FIELD && key !== PROGRAM_FIELD
      && key !== END_TOKEN_FIELD && key !== WIRE_SOCKET_FIELD && !EGRESS_FIELDS.includes(key)) {
      return badPayload(`unknown header field ${key}`);
    }
  }
  const isSession = header[SESSION_FIELD] === true;
  if (SESSION_FIELD in header && !isSession) return badPayload('session must be true when given');
  const isProgram = header[PROGRAM_FIELD] === true;
  if (PROGRAM_FIELD in header && !(isProgram && isSession)) return badPayload('program must be true, in a session');
  const wireSocket = header[WIRE_SOCKET_FIELD];
  if (isSession && !isProgram) {
    if (typeof wireSocket !== 'string' || !WIRE_SOCKET.test(wireSocket)) {
      return badPayload(`a session's ${WIRE_SOCKET_FIELD} must be a path under /run/metaagent-wire/`);
    }
  } else if (WIRE_SOCKET_FIELD in header) {
    return badPayload(`${WIRE_SOCKET_FIELD} is for a session's supervisor`);
  }
  const endToken = header[END_TOKEN_FIELD];
  if (END_TOKEN_FIELD in header) {
    if (RUNS_JAVASCRIPT || isSession) return badPayload('end_token is for a one-shot run of a program');
    if (typeof endToken !== 'string' || !END_TOKEN.test(endToken)) return badPayload('end_token must be 32 hex digits');
  }
  for (const key of COUNT_FIELDS) {
    if (key === 'extra_ca_bytes' && !('egress_socket' in header)) continue;
    if (isSession && key !== 'extra_ca_bytes') {
      if (key in header) return badPayload(`a session takes no ${key}`);
      continue;
    }
    if (!isSafeInteger(header[key]) || header[key] < 0) {
      return badPayload(`${key} must be a non-negative integer`);
    }
  }
  let egressConfig = null;
  if (EGRESS_FIELDS.some((key) => key in header)) {
    const socket = header.egress_socket;
    if (typeof socket !== 'string' || !socket.startsWith(EGRESS_SOCKET_DIR) || socket.length > 200) {
      return badPayload(`egress_socket must be a path under ${EGRESS_SOCKET_DIR}`);
    }
    if (!isSafeInteger(header.egress_max_tunnels) || header.egress_max_tunnels < 1) {
      return badPayload('egress_max_tunnels must be a positive integer');
    }
    egressConfig = { socketPath: socket, maxTunnels: header.egress_max_tunnels };
  }
  return {
    session: isSession,
    program: isProgram,
    codeBytes: isSession ? 0 : header.code_bytes,
    stdinBytes: isSession ? 0 : header.stdin_bytes,
    extraCaBytes: egressConfig === null ? 0 : header.extra_ca_bytes,
    egress: egressConfig,
    endToken: END_TOKEN_FIELD in header ? endToken : null,
    wireSocket: isSession && !isProgram ? wireSocket : null,
  };
}

// Reads header, code, stdin and extra CAs from the real stdin, blocking (a warm runner waits here, idle,
// for its payload). Returns {session, program, code, input, egress, rest, endToken}; egress is null, or {socketPath, maxTunnels,
// extraCa}; rest holds the bytes read past the payload (a session's first requests).
function readPayload(first = Buffer.alloc(0)) {
  let pending = first; // bytes received up to the end of the header line
  let header = null;
  for (;;) {
    const newline = pending.indexOf(0x0a);
    if (newline === -1 ? pending.length > MAX_HEADER_BYTES : newline > MAX_HEADER_BYTES) {
      return badPayload(`no header line in the first ${MAX_HEADER_BYTES} bytes`);
    }
    if (newline !== -1) {
      header = parseHeader(pending.subarray(0, newline));
      pending = pending.subarray(newline + 1);
      break;
    }
    const chunk = Buffer.alloc(READ_CHUNK);
    const size = stdio.readStdin(chunk);
    if (size === 0) return badPayload('stdin ended before the header line');
    pending = Buffer.concat([pending, chunk.subarray(0, size)]);
  }
  const total = header.codeBytes + header.stdinBytes + header.extraCaBytes;
  const body = Buffer.alloc(total);
  let received = Math.min(pending.length, total);
  pending.copy(body, 0, 0, received);
  const rest = Buffer.from(pending.subarray(received));
  while (received < total) {
    const size = stdio.readStdin(body.subarray(received));
    if (size === 0) return badPayload(`stdin ended after ${received} of ${total} body bytes`);
    received += size;
  }
  const codeBytes = Buffer.from(body.subarray(0, header.codeBytes));
  const code = codeBytes.toString('utf8');
  const stdinEnd = header.codeBytes + header.stdinBytes;
  const input = Buffer.from(body.subarray(header.codeBytes, stdinEnd)); // a copy: not sharing the code's memory
  let egressConfig = null;
  if (header.egress !== null) {
    egressConfig = { ...header.egress, extraCa: body.subarray(stdinEnd, total).toString('ascii') };
  }
  return {
    session: header.session, program: header.program, code, codeBytes, input, egress: egressConfig, rest,
    endToken: header.endToken, wireSocket: header.wireSocket,
  };
}

// EGRESS: with network, node's http, https and fetch go through the execution's tunnel (egress.js).
function installEgress(config) {
  try {
    egress.install(config);
  } catch (err) {
    stdio.writeStderr(`metaagent-runner: egress cannot start: ${err && err.message}\n`);
    processExit(EXIT_BAD_PAYLOAD);
  }
}

// Runs the user's code as its own CommonJS main module, exactly as `node /app/main.js` would, so that
// require.main and process.mainModule point at the user's module, never at this runner.
function runUserModule(code) {
  const userModule = new Module('.', null);
  userModule.filename = USER_FILENAME;
  userModule.paths = Module._nodeModulePaths(USER_DIRNAME);
  process.mainModule = userModule;
  process.argv[1] = USER_FILENAME;
  delete Module._cache[__filename];
  Module._cache[USER_FILENAME] = userModule;
  // No try/catch: a synchronous throw reaches node's own uncaught-exception handler, which prints the
  // stack and exits 1 like plain node; unhandled rejections keep node's default (throw, exit 1) too.
  userModule._compile(code, USER_FILENAME);
  userModule.loaded = true;
}

// A program's header line with `fields`, and with network the egress fields; the CA certificates that
// `extra_ca_bytes` counts go last, after whatever else the header announces.
function headerFor(fields, egressConfig) {
  const header = { ...fields };
  let extraCa = Buffer.alloc(0);
  if (egressConfig !== null) {
    extraCa = Buffer.from(egressConfig.extraCa, 'ascii');
    header.egress_socket = egressConfig.socketPath;
    header.egress_max_tunnels = egressConfig.maxTunnels;
    header.extra_ca_bytes = extraCa.length;
  }
  return { line: Buffer.from(`${JSON.stringify(header)}\n`, 'utf8'), extraCa };
}

// The header that starts a session's program: the session's own, in the program's role.
function programHeader(egressConfig) {
  const { line, extraCa } = headerFor({ session: true, program: true }, egressConfig);
  return Buffer.concat([line, extraCa]);
}

// Node and the gate are loaded (and the program, when there is one): tell the host, which starts the
// execution's clock (and, for a warm container, hands it out) only now. No user code exists yet, so no
// user code can forge this line. The same bytes are RUNNER_READY in sandbox/execute.py.
function ready() {
  stdio.writeStderr('metaagent-runner: ready\n');
}

function serveJavaScript(payload) {
  if (payload.session && !payload.program) {
    if (payload.rest.length > 0) return badPayload('a session\'s requests come on its wire, not stdin');
    supervisor.runSupervisor({ stdio, programHeader: programHeader(payload.egress), wirePath: payload.wireSocket });
    return;
  }
  if (payload.egress !== null) installEgress(payload.egress);
  const unixSockets = payload.egress === null ? [] : [payload.egress.socketPath];
  if (payload.session) {
    session.runSession({ stdio, gate, initial: payload.rest, unixSockets });
    return;
  }
  stdio.install(payload.input);
  // The module gate: hardening of the module system and process (NODE_HARDENING.md, gate.js), after
  // the payload is read and before the user's module is compiled.
  gate.install({ unixSockets });
  runUserModule(payload.code);
}

// What another language's program verifies TLS against, with network: node's own CA bundle (Python's
// image has none) and the operator's extra CAs. Its tunnel is the same socket as JavaScript's.
function programEgress(egressConfig) {
  if (egressConfig === null) return null;
  const roots = require('tls').rootCertificates.join('\n');
  return { ...egressConfig, extraCa: `${roots}\n${egressConfig.extraCa}` };
}

// Another language's program, started with the container and ready: the payload goes to it.
function serveProgram(child, payload) {
  if (child.exitCode !== null || child.signalCode !== null) { // it died while the container waited
    stdio.writeStderr('metaagent-runner: the program ended before its payload came\n');
    return processExit(program.exitCodeOf(child.exitCode, child.signalCode));
  }
  if (payload.program) return badPayload('program must not be given to this runner');
  const egressConfig = programEgress(payload.egress);
  if (payload.session) {
    if (payload.rest.length > 0) return badPayload('a session\'s requests come on its wire, not stdin');
    supervisor.runSupervisor({ stdio, programHeader: programHeader(egressConfig), wirePath: payload.wireSocket, program: child });
    return undefined;
  }
  const { line, extraCa } = headerFor({ code_bytes: payload.codeBytes.length, stdin_bytes: payload.input.length }, egressConfig);
  const body = Buffer.concat([line, payload.codeBytes, payload.input, extraCa]);
  program.relayOnce(child, { stdio, header: body, endToken: payload.endToken });
  return undefined;
}

if (RUNS_JAVASCRIPT) {
  ready();
  const payload = readPayload();
  // A fresh macrotask, so the user's stack traces do not start inside the runner.
  defer(() => serveJavaScript(payload));
} else {
  program.startProgram(PROGRAM_COMMAND, {
    stdio,
    onReady: (child) => {
      ready();
      // The wait for the payload's first bytes is a read on the thread pool, so that the event loop sees
      // the program if it dies while the container waits: then this process goes at once (SIGKILL, as
      // a thread blocked in that read would hold up an exit), and the pool sees a dead runner and
      // replaces it, rather than hand out a container whose program is gone.
      const died = () => {
        stdio.writeStderr('metaagent-runner: the program ended while the container waited\n');
        process.kill(process.pid, 'SIGKILL');
      };
      child.once('exit', died);
      const first = Buffer.alloc(READ_CHUNK);
      const waitForPayload = () => fs.read(0, first, 0, READ_CHUNK, null, (error, size) => {
        if (error && error.code === 'EAGAIN') return setTimeout(waitForPayload, 5); // a non-blocking stdin
        child.removeListener('exit', died);
        if (error) return badPayload(`stdin cannot be read (${error.code})`);
        if (size === 0) return badPayload('stdin ended before the header line');
        const payload = readPayload(Buffer.from(first.subarray(0, size)));
        return defer(() => serveProgram(child, payload));
      });
      waitForPayload();
    },
  });
}
