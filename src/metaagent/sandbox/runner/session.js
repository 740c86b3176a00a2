'use strict';
// metaagent session program: the untrusted half of a session container. One long-lived program context
// behind the same module gate as a one-shot run, in a child of the session's supervisor
// (supervisor.js), which owns the wire to the service and the workspace's file service.
//
// Its fds are pipes to the supervisor and nothing else: calls come on fd 0 as `x {id, code}` frames (the
// id a token the supervisor made for the call)
// (one type byte, a 32-bit big-endian length, the JSON), answers leave on fd 3 as `r {id, status,
// result, result_bytes, result_incomplete, error}` frames, and the program's stdout and stderr are its fds 1 and 2, raw. The
// program can write anything anywhere it reaches: the supervisor checks every answer and frames every
// output byte itself, so a forged frame is only ever output, or a broken answer that ends this process.
//
// An interrupt is SIGINT: it stops the call that runs (a synchronous loop included, through vm's
// breakOnSigint, or an await that has not settled) and the session lives on, as after Ctrl-C in the
// Node.js REPL. The display of the call's value or error runs under the same interrupt: it is
// util.inspect, synchronous, over a value (and getters, Proxies, custom inspectors) that the program made.

const fs = require('fs');
const util = require('util');
const vm = require('vm');
const crypto = require('crypto');
const bufferModule = require('buffer');
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
const StringPrototypeSlice = String.prototype.slice;
const StringPrototypeEndsWith = String.prototype.endsWith;
const ReflectDefineProperty = Reflect.defineProperty;
const ReflectDeleteProperty = Reflect.deleteProperty;
const ScriptPrototypeRunInThisContext = vm.Script.prototype.runInThisContext;
const isNativeError = util.types.isNativeError;
const ErrorConstructor = Error;
const NumberIsFinite = Number.isFinite;

const WORKSPACE = '/workspace';
const ROOTS = [WORKSPACE, '/tmp'];
const SESSION_FILENAME = '/app/session.js';
const HEADER = 5;
const MAX_INPUT_FRAME = 2 * 1024 * 1024; // a call's code (1 MiB) in JSON, with room
const CHUNK = 64 * 1024;
const ANSWERS = 3; // the pipe of the answers to the supervisor
const MAX_RESULT_BYTES = 64 * 1024; // the service keeps 50 KiB of it
const MAX_ERROR_FIELD = 4096; // characters of an error's name, message and stack (the service: 4 KiB each)
// inspect's own abbreviations, each past what the result can hold: more items than MAX_RESULT_BYTES
// (each takes a byte at least), a string longer than that, a Buffer of more bytes than a third of it
// (three characters a byte). No depth limit: inspect catches its own stack overflow (a marker that says
// so, which makes the result incomplete).
const INSPECT_OPTIONS = { __proto__: null, showProxy: true, depth: Infinity, maxArrayLength: MAX_RESULT_BYTES, maxStringLength: MAX_RESULT_BYTES };
const INSPECT_MAX_BYTES = Math.ceil(MAX_RESULT_BYTES / 3);
const STACK_OVERFLOW_MARKER = 'Maximum call stack size exceeded.]';
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
  prepareGuard();
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
    rawWrite(stdio.STDERR, BufferFrom(`Uncaught ${printedError(error)}\n`, 'utf8'));
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
    // The call's value, shown under the interrupt (see `guarded`).
    const completed = (value) => {
      if (settled) return;
      const shown = guarded(() => display(value));
      settle(shown === INTERRUPTED ? { status: 'interrupted' } : { status: 'ok', ...shown });
    };
    // What the call threw, printed on stderr as the REPL prints it, and answered as data.
    const threw = (thrown) => {
      if (settled) return;
      const report = guarded(() => thrownReport(thrown));
      if (report === INTERRUPTED) {
        settle({ status: 'interrupted' });
        return;
      }
      rawWrite(stdio.STDERR, BufferFrom(`Uncaught ${report.printed}\n`, 'utf8'));
      settle({ status: 'threw', error: report.error });
    };
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
      const value = ReflectApply(ScriptPrototypeRunInThisContext, script, [{ __proto__: null, breakOnSigint: true, displayErrors: false }]);
      if (!awaited) {
        completed(value);
        return;
      }
      ReflectApply(PromisePrototypeThen, value, [completed, threw]);
    } catch (error) {
      if (error && error.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') {
        settle({ status: 'interrupted' });
        return;
      }
      threw(error);
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

// --- showing values and errors ---

const INTERRUPTED = Symbol('interrupted');
// `task()` run inside a vm script with breakOnSigint, so that an interrupt stops it as it stops a call's
// own code; INTERRUPTED if it did. The script reaches `task` through a property of the global object
// with an unguessable name, there only while it runs.
let guard = null; // {key, script}, made when a session starts (see prepareGuard)
function prepareGuard() {
  const key = `__metaagent_${crypto.randomBytes(12).toString('hex')}`;
  guard = { key, script: new vm.Script(`this[${JSONStringify(key)}]()`, { filename: 'metaagent-display' }) };
}
function guarded(task) {
  const { key, script } = guard;
  if (!ReflectDefineProperty(globalThis, key, { __proto__: null, value: task, configurable: true })) {
    return task(); // a global object the program froze: shown without the interrupt
  }
  try {
    return ReflectApply(ScriptPrototypeRunInThisContext, script, [{ __proto__: null, breakOnSigint: true, displayErrors: false }]);
  } catch (error) {
    if (error && error.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') return INTERRUPTED;
    throw error;
  } finally {
    ReflectDeleteProperty(globalThis, key);
  }
}

// The call's value as the REPL shows it, whole up to MAX_RESULT_BYTES: {result, result_bytes}, and
// `result_incomplete: true` when the text is not the whole value (inspect cut it short, or it threw)
// though it fits. Once what inspect has shown passes MAX_RESULT_BYTES the text cannot fit whatever
// follows, and inspect is told to stop descending (a value shared a thousand times in a graph would
// otherwise be shown a thousand times over).
function display(value) {
  if (value === undefined) return { result: null };
  let shown = 0;
  let stopped = false;
  let overflowed = false;
  const options = {
    ...INSPECT_OPTIONS,
    stylize(text, styleType) {
      shown += text.length;
      if (styleType === 'special' && ReflectApply(StringPrototypeEndsWith, text, [STACK_OVERFLOW_MARKER])) overflowed = true;
      if (shown > MAX_RESULT_BYTES && this !== null && typeof this === 'object') {
        this.depth = -1; // `this` is inspect's context: what is left is shown as [Object]
        stopped = true;
      }
      return text;
    },
  };
  let text;
  let incomplete = false;
  let maxBytes;
  try {
    maxBytes = bufferModule.INSPECT_MAX_BYTES;
    bufferModule.INSPECT_MAX_BYTES = INSPECT_MAX_BYTES;
  } catch {
    maxBytes = undefined;
  }
  try {
    text = inspect(value, options);
  } catch (error) {
    text = `[the value cannot be shown: ${safeMessage(error)}]`;
    incomplete = true;
  } finally {
    try {
      if (NumberIsFinite(maxBytes)) bufferModule.INSPECT_MAX_BYTES = maxBytes;
    } catch { /* the program's own setting stays as it is */ }
  }
  if (typeof text !== 'string') {
    text = '[the value cannot be shown]';
    incomplete = true;
  }
  const bytes = BufferFrom(text, 'utf8');
  if (bytes.length > MAX_RESULT_BYTES) {
    const cut = ReflectApply(BufferPrototypeToString, ReflectApply(TypedArrayPrototypeSubarray, bytes, [0, MAX_RESULT_BYTES]), ['utf8']);
    return { result: cut, result_bytes: bytes.length };
  }
  if (overflowed || stopped) incomplete = true; // stopped yet within the cap: a custom inspector hid what it showed
  return incomplete ? { result: text, result_bytes: bytes.length, result_incomplete: true } : { result: text, result_bytes: bytes.length };
}

// A thrown value's message, for a text that must not throw again.
function safeMessage(error) {
  try {
    const message = error && error.message;
    if (typeof message === 'string') return capped(message);
  } catch { /* a getter that throws */ }
  return 'an error that cannot be shown';
}

function capped(text) {
  return text.length <= MAX_ERROR_FIELD ? text : ReflectApply(StringPrototypeSlice, text, [0, MAX_ERROR_FIELD]);
}

function printedError(error) {
  try {
    const text = cleanStack(inspect(error)); // the stack, then the error's own fields, as the REPL shows it
    if (typeof text === 'string') return text;
  } catch { /* an inspect that throws */ }
  return '[an error that cannot be shown]';
}

// What a call threw: the text the REPL prints, and {name, message, stack} for the answer. An Error has
// its own name and message and the printed text as its stack; any other value (`throw 5`) is a
// ThrownValue whose message is the value as shown.
function thrownReport(thrown) {
  const printed = printedError(thrown);
  let isError = false;
  try {
    isError = isNativeError(thrown) || thrown instanceof ErrorConstructor;
  } catch { /* a Proxy's trap that throws: a value */ }
  if (!isError) {
    return { printed, error: { name: 'ThrownValue', message: capped(printed), stack: null } };
  }
  let name = 'Error';
  try {
    if (typeof thrown.name === 'string' && thrown.name.length > 0) name = capped(thrown.name);
  } catch { /* a getter that throws */ }
  let message = '';
  try {
    if (typeof thrown.message === 'string') message = capped(thrown.message);
  } catch { /* a getter that throws */ }
  return { printed, error: { name, message, stack: capped(printed) } };
}

// Stack lines inside the runner and node's vm plumbing say nothing to the program's author.
function cleanStack(stack) {
  // A frame of node's or the runner's: `at f (node:...)`, `at f (/opt/metaagent/...)`, or the same without a name.
  const internal = /^\s+at (?:.*\((?:node:|\/opt\/metaagent\/)|node:|\/opt\/metaagent\/)/;
  return stack.split('\n').filter((line) => !internal.test(line)).join('\n');
}

module.exports = Object.freeze({ __proto__: null, runSession });
