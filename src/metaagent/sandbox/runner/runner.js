'use strict';
// metaagent trusted runner: the first and only script node loads in a sandbox container.
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
// Built-ins are captured below, before any user code exists: user code can replace globals and
// prototypes, but not these bindings, so anything that runs later (the module gate's hooks above all)
// must use them rather than the live globals.

const Module = require('module');
const { Readable } = require('stream');
const { Buffer } = require('buffer');
// The module gate (gate.js, with policy.js and gate-hooks.mjs): loaded here, before any payload byte
// arrives, so that it captures built-ins and starts its ESM hooks thread while no user code exists.
const gate = require('./gate.js');
// Egress through the execution's tunnel: loaded now for the same reason, it captures net and tls, which
// the gate refuses to user code.
const egress = require('./egress.js');
// Out of the CommonJS cache at once: require.cache leads to nothing of the runner's (as for the gate).
delete Module._cache[require.resolve('./egress.js')];

const realStdin = process.stdin;
const realStderr = process.stderr;
const processExit = process.exit.bind(process);
const jsonParse = JSON.parse;
const defineProperty = Object.defineProperty;
const isSafeInteger = Number.isSafeInteger;
const defer = setImmediate;

const USER_FILENAME = '/app/main.js';
const USER_DIRNAME = '/app';
const MAX_HEADER_BYTES = 1024;
const EXIT_BAD_PAYLOAD = 70; // EX_SOFTWARE: tells the host the runner, not the user's code, gave up.
const COUNT_FIELDS = ['code_bytes', 'stdin_bytes', 'extra_ca_bytes'];
const EGRESS_FIELDS = ['egress_socket', 'egress_max_tunnels', 'extra_ca_bytes'];
const EGRESS_SOCKET_DIR = '/run/metaagent/';

function badPayload(reason) {
  realStderr.write(`metaagent-runner: bad payload: ${reason}\n`);
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
    if (key !== 'code_bytes' && key !== 'stdin_bytes' && !EGRESS_FIELDS.includes(key)) {
      return badPayload(`unknown header field ${key}`);
    }
  }
  for (const key of COUNT_FIELDS) {
    if (key === 'extra_ca_bytes' && !('egress_socket' in header)) continue;
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
    codeBytes: header.code_bytes,
    stdinBytes: header.stdin_bytes,
    extraCaBytes: egressConfig === null ? 0 : header.extra_ca_bytes,
    egress: egressConfig,
  };
}

// Reads header, code, stdin and extra CAs from the real stdin, then calls done(code, stdinBuffer, egress)
// exactly once; egress is null, or {socketPath, maxTunnels, extraCa} for an execution with network.
function readPayload(done) {
  let pending = Buffer.alloc(0); // bytes received but not yet attributed to the header
  let header = null;
  const body = [];
  let bodyLength = 0;
  let finished = false;

  function finish() {
    finished = true;
    realStdin.removeListener('data', onData);
    realStdin.removeListener('end', onEnd);
    realStdin.removeListener('error', onError);
    // Closing the real handle keeps it from holding the event loop open and leaves user code no way
    // to read past the payload.
    realStdin.pause();
    realStdin.destroy();
    const all = Buffer.concat(body, bodyLength);
    const code = all.subarray(0, header.codeBytes).toString('utf8');
    const stdinEnd = header.codeBytes + header.stdinBytes;
    const input = all.subarray(header.codeBytes, stdinEnd);
    let egressConfig = null;
    if (header.egress !== null) {
      const extraCa = all.subarray(stdinEnd, stdinEnd + header.extraCaBytes).toString('ascii');
      egressConfig = { ...header.egress, extraCa };
    }
    done(code, Buffer.from(input), egressConfig); // a copy, so the user's stdin does not share the code's memory
  }

  function onData(chunk) {
    if (finished) return;
    if (header === null) {
      pending = Buffer.concat([pending, chunk]);
      const newline = pending.indexOf(0x0a);
      if (newline === -1 ? pending.length > MAX_HEADER_BYTES : newline > MAX_HEADER_BYTES) {
        return badPayload(`no header line in the first ${MAX_HEADER_BYTES} bytes`);
      }
      if (newline === -1) return; // wait for the rest of the header
      header = parseHeader(pending.subarray(0, newline));
      chunk = pending.subarray(newline + 1);
      pending = null;
    }
    body.push(chunk);
    bodyLength += chunk.length;
    if (bodyLength >= header.codeBytes + header.stdinBytes + header.extraCaBytes) finish();
  }

  function onEnd() {
    if (finished) return;
    if (header === null) return badPayload('stdin ended before the header line');
    badPayload(`stdin ended after ${bodyLength} of ${header.codeBytes + header.stdinBytes + header.extraCaBytes} body bytes`);
  }

  function onError(err) {
    if (!finished) badPayload(`cannot read stdin (${err.message})`);
  }

  realStdin.on('data', onData);
  realStdin.on('end', onEnd);
  realStdin.on('error', onError);
}

// The user's process.stdin: a plain Readable holding exactly the bytes the host sent, then EOF.
// It is not an fs.ReadStream or net.Socket, so its constructor leads to no file or socket API.
function installStdin(input) {
  const stream = new Readable({
    read() {
      if (input.length > 0) this.push(input);
      this.push(null);
    },
  });
  defineProperty(process, 'stdin', { value: stream, enumerable: true, writable: false, configurable: false });
}

// MODULE GATE: hardening of the module system and process (see NODE_HARDENING.md, "the in-process
// gate", and gate.js). It runs after the payload is read and before the user's module is compiled; the
// gate decides only with bindings it captured when it was loaded at the top of this file.
function installGate() {
  gate.install();
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

// EGRESS: with network, node's http, https and fetch go through the execution's tunnel (egress.js).
function installEgress(config) {
  try {
    egress.install(config);
  } catch (err) {
    realStderr.write(`metaagent-runner: egress cannot start: ${err && err.message}\n`);
    processExit(EXIT_BAD_PAYLOAD);
  }
}

// Node and the gate are loaded: tell the host, which starts the execution's clock (and, for a warm
// container, hands it out) only now. No user code exists yet, so no user code can forge this line.
// The same bytes are RUNNER_READY in sandbox/execute.py.
realStderr.write('metaagent-runner: ready\n');

readPayload((code, input, egressConfig) => {
  // A fresh macrotask, so the user's stack traces do not start inside the stdin stream's internals.
  defer(() => {
    installStdin(input);
    if (egressConfig !== null) installEgress(egressConfig);
    installGate();
    runUserModule(code);
  });
});
