'use strict';
// metaagent trusted runner: the first and only script node loads in a sandbox container.
//
// Protocol on the real stdin (sent by the host through the attach socket):
//   {"code_bytes": N, "stdin_bytes": M}\n   one UTF-8 JSON header line
//   N bytes                                 the user's JavaScript (UTF-8)
//   M bytes                                 the user's standard input
// The host may keep stdin open afterwards, so we count bytes and never wait for EOF.
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
    if (key !== 'code_bytes' && key !== 'stdin_bytes') return badPayload(`unknown header field ${key}`);
  }
  for (const key of ['code_bytes', 'stdin_bytes']) {
    if (!isSafeInteger(header[key]) || header[key] < 0) {
      return badPayload(`${key} must be a non-negative integer`);
    }
  }
  return { codeBytes: header.code_bytes, stdinBytes: header.stdin_bytes };
}

// Reads header, code and stdin from the real stdin, then calls done(code, stdinBuffer) exactly once.
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
    const input = all.subarray(header.codeBytes, header.codeBytes + header.stdinBytes);
    done(code, Buffer.from(input)); // a copy, so the user's stdin does not share the code's memory
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
    if (bodyLength >= header.codeBytes + header.stdinBytes) finish();
  }

  function onEnd() {
    if (finished) return;
    if (header === null) return badPayload('stdin ended before the header line');
    badPayload(`stdin ended after ${bodyLength} of ${header.codeBytes + header.stdinBytes} body bytes`);
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

// Node and the gate are loaded: tell the host, which starts the execution's clock (and, for a warm
// container, hands it out) only now. No user code exists yet, so no user code can forge this line.
// The same bytes are RUNNER_READY in sandbox/execute.py.
realStderr.write('metaagent-runner: ready\n');

readPayload((code, input) => {
  // A fresh macrotask, so the user's stack traces do not start inside the stdin stream's internals.
  defer(() => {
    installStdin(input);
    installGate();
    runUserModule(code);
  });
});
