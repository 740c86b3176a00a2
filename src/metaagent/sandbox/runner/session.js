'use strict';
// metaagent session program: the untrusted half of a session container. One long-lived program context
// behind the same module gate as a one-shot run, in a child of the session's supervisor
// (supervisor.js), which owns the wire to the service and the workspace's file service.
//
// Its fds are pipes to the supervisor and nothing else: calls come on fd 0 as `x {id, code}` frames (the
// id a token the supervisor made for the call)
// (one type byte, a 32-bit big-endian length, the JSON), answers leave on fd 3 as `r {id, status,
// result, result_bytes}` frames, and the program's stdout and stderr are its fds 1 and 2, raw. The
// program can write anything anywhere it reaches: the supervisor checks every answer and frames every
// output byte itself, so a forged frame is only ever output, or a broken answer that ends this process.
//
// An interrupt is SIGINT: it stops the call that runs (a synchronous loop included, through vm's
// breakOnSigint, or an await that has not settled) and the session lives on, as after Ctrl-C in the
// Node.js REPL.

const fs = require('fs');
const util = require('util');
const Module = require('module');
const { Buffer } = require('buffer');

const ReflectApply = Reflect.apply;
const JSONStringify = JSON.stringify;
const JSONParse = JSON.parse;
const PromisePrototypeThen = Promise.prototype.then;
const inspect = util.inspect;
const processOn = process.on;
const processChdir = process.chdir;
const BufferAlloc = Buffer.alloc;
const BufferConcat = Buffer.concat;
const BufferFrom = Buffer.from;
const StringPrototypeIncludes = String.prototype.includes;
const fsRead = fs.read;
// What the request loop uses on the supervisor's bytes, captured: the program can replace the
// prototypes' versions (a replaced Buffer#toString rewrote every later call's code before it ran).
const BufferPrototypeToString = Buffer.prototype.toString;
const BufferPrototypeReadUInt32BE = Buffer.prototype.readUInt32BE;
const TypedArrayPrototypeSubarray = Uint8Array.prototype.subarray;
const StringFromCharCode = String.fromCharCode;

const WORKSPACE = '/workspace';
const ROOTS = [WORKSPACE, '/tmp'];
const SESSION_FILENAME = '/app/session.js';
const HEADER = 5;
const MAX_INPUT_FRAME = 2 * 1024 * 1024; // a call's code (1 MiB) in JSON, with room
const CHUNK = 64 * 1024;
const ANSWERS = 3; // the pipe of the answers to the supervisor
const MAX_RESULT_BYTES = 64 * 1024; // the service keeps 50 KiB of it
const EXIT_BAD_FRAME = 70;

function frame(type, payload) {
  const header = BufferAlloc(HEADER);
  header[0] = type.charCodeAt(0);
  header.writeUInt32BE(payload.length, 1);
  return BufferConcat([header, payload]);
}

// The parts only a session needs (the await rewrite loads acorn), loaded when a session starts, before
// its gate is installed, and then dropped from the CommonJS cache like the rest of the runner.
function loadSessionParts() {
  const parts = { ...require('./await.js'), ...require('./fsgate.js') };
  for (const key of Object.keys(Module._cache)) {
    if (key.startsWith('/opt/metaagent/') || key.startsWith('/usr/share/nodejs/')) delete Module._cache[key];
  }
  return parts;
}

function runSession({ stdio, gate, initial, unixSockets }) {
  const { processTopLevelAwait, createFsGate } = loadSessionParts();
  const reply = (message) => stdio.writeAll(ANSWERS, frame('r', BufferFrom(JSONStringify(message), 'utf8')));
  const rawWrite = (fd, bytes) => stdio.writeAll(fd, bytes);

  // The workspace is the cwd (with WorkingDir, the cwd would be the folder below the tmpfs).
  ReflectApply(processChdir, process, [WORKSPACE]);
  const files = createFsGate(ROOTS, { write: rawWrite });
  stdio.install(BufferAlloc(0), rawWrite);
  gate.install({ unixSockets, builtins: { fs: files.fs, 'fs/promises': files.promises }, chdir: files.chdir });

  // What a session's code sees as require, module and exports: those of a module in /app, so that
  // require finds the session's packages, as the REPL's require does.
  const sessionModule = new Module(SESSION_FILENAME, null);
  sessionModule.filename = SESSION_FILENAME;
  sessionModule.paths = Module._nodeModulePaths('/app');
  sessionModule.loaded = true;
  const globals = {
    require: gate.requireFor(sessionModule), module: sessionModule, exports: sessionModule.exports,
    __filename: SESSION_FILENAME, __dirname: '/app',
  };
  for (const name of Object.keys(globals)) {
    Object.defineProperty(globalThis, name, { value: globals[name], writable: true, configurable: true, enumerable: false });
  }

  let calls = 0;
  let current = null; // the call that runs: {id, settle}

  const printUncaught = (error) => {
    let text;
    try {
      text = cleanStack(inspect(error)); // as the REPL shows it: the stack, then the error's own fields
    } catch {
      text = '[an error that cannot be shown]';
    }
    rawWrite(stdio.STDERR, BufferFrom(`Uncaught ${text}\n`, 'utf8'));
  };
  // As in the REPL: an error thrown later (by a timer, a rejected promise nobody awaited) is printed and
  // the session lives on. (A program that removes these listeners ends its own session when it throws.)
  ReflectApply(processOn, process, ['uncaughtException', printUncaught]);
  ReflectApply(processOn, process, ['unhandledRejection', printUncaught]);
  ReflectApply(processOn, process, ['SIGINT', () => {
    if (current !== null) current.settle({ status: 'interrupted' });
  }]);

  function finishCall(id, outcome) {
    if (current === null || current.id !== id) return;
    current = null;
    reply({ id, ...outcome });
  }

  function display(value) {
    if (value === undefined) return { result: null };
    let text;
    try {
      text = inspect(value, { showProxy: true });
    } catch (error) {
      text = `[the value cannot be shown: ${error && error.message}]`;
    }
    const bytes = BufferFrom(text, 'utf8');
    if (bytes.length <= MAX_RESULT_BYTES) return { result: text, result_bytes: bytes.length };
    return { result: bytes.subarray(0, MAX_RESULT_BYTES).toString('utf8'), result_bytes: bytes.length };
  }

  function execute(id, code) {
    calls += 1;
    const filename = `REPL${calls}`;
    let settled = false;
    const settle = (outcome) => {
      if (settled) return;
      settled = true;
      finishCall(id, outcome);
    };
    current = { id, settle };
    let source = code;
    let awaited = false;
    try {
      if (ReflectApply(StringPrototypeIncludes, code, ['await'])) {
        const transformed = processTopLevelAwait(code);
        if (transformed !== null) {
          source = transformed;
          awaited = true;
        }
      }
      const script = gate.scriptFor(source, filename, sessionModule);
      const value = script.runInThisContext({ __proto__: null, breakOnSigint: true, displayErrors: false });
      if (!awaited) {
        settle({ status: 'ok', ...display(value) });
        return;
      }
      ReflectApply(PromisePrototypeThen, value, [
        (result) => settle({ status: 'ok', ...display(result) }),
        (error) => {
          if (!settled) printUncaught(error);
          settle({ status: 'threw' });
        },
      ]);
    } catch (error) {
      if (error && error.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') {
        settle({ status: 'interrupted' });
        return;
      }
      printUncaught(error);
      settle({ status: 'threw' });
    }
  }

  // --- the request loop ---

  function handle(type, payload) {
    let request;
    try {
      request = JSONParse(ReflectApply(BufferPrototypeToString, payload, ['utf8']));
    } catch {
      return badFrame('a request is not JSON');
    }
    if (type === 'x') return execute(request.id, request.code);
    return badFrame(`unknown request type ${JSONStringify(type)}`);
  }

  function badFrame(reason) {
    stdio.writeStderr(`metaagent-runner: bad request: ${reason}\n`);
    process.exit(EXIT_BAD_FRAME);
  }

  let pending = initial;
  const readBuffer = BufferAlloc(CHUNK);
  function consume() {
    while (pending.length >= HEADER) {
      const type = StringFromCharCode(pending[0]);
      const length = ReflectApply(BufferPrototypeReadUInt32BE, pending, [1]);
      if (length > MAX_INPUT_FRAME) return badFrame(`a frame of ${length} bytes`);
      if (pending.length < HEADER + length) return undefined;
      const payload = ReflectApply(TypedArrayPrototypeSubarray, pending, [HEADER, HEADER + length]);
      pending = ReflectApply(TypedArrayPrototypeSubarray, pending, [HEADER + length]);
      handle(type, BufferFrom(payload));
    }
    return undefined;
  }
  // fd 0 is read on the thread pool, so the event loop stays free for the program's timers between calls.
  function readMore() {
    ReflectApply(fsRead, fs, [0, readBuffer, 0, CHUNK, null, (error, size) => {
      if (error && error.code === 'EAGAIN') return setTimeout(readMore, 5);
      if (error || size === 0) process.exit(0); // the supervisor closed the program's stdin
      pending = BufferConcat([pending, ReflectApply(TypedArrayPrototypeSubarray, readBuffer, [0, size])]);
      consume();
      return readMore();
    }]);
  }
  reply({ id: 0, status: 'ready' });
  consume();
  readMore();
}

// Stack lines inside the runner and node's vm plumbing say nothing to the program's author.
function cleanStack(stack) {
  // A frame of node's or the runner's: `at f (node:...)`, `at f (/opt/metaagent/...)`, or the same without a name.
  const internal = /^\s+at (?:.*\((?:node:|\/opt\/metaagent\/)|node:|\/opt\/metaagent\/)/;
  return stack.split('\n').filter((line) => !internal.test(line)).join('\n');
}

module.exports = Object.freeze({ __proto__: null, runSession });
