'use strict';
// metaagent module policy: which modules user code may load, and the errors that refuse the others.
//
// Shared by gate.js (the CommonJS loader and the process object) and imports.js (import()), so that
// both refuse the same things with the same codes and messages.
//
// Everything this file needs at decision time is captured when it loads, which is before any user
// code exists: user code may later replace Array.prototype.includes, String.prototype.startsWith,
// Function.prototype.call, Reflect.apply, Object.defineProperty, path.normalize and the like, but not
// these bindings. Decisions look names up in null-prototype tables (no inherited keys, no methods)
// and call captured functions through the captured Reflect.apply only.

const ReflectApply = Reflect.apply;
const ObjectCreate = Object.create;
const ObjectDefineProperty = Object.defineProperty;
const ObjectFreeze = Object.freeze;
const StringPrototypeStartsWith = String.prototype.startsWith;
const StringPrototypeSlice = String.prototype.slice;
const ErrorCtor = Error;
const ErrorCaptureStackTrace = Error.captureStackTrace;
const TypeErrorCtor = TypeError;
const { normalize: pathNormalize, resolve: pathResolve, dirname: pathDirname } = require('path').posix;
const builtinModules = require('module').builtinModules;

const CODE_BLOCKED_MODULE = 'ERR_METAAGENT_BLOCKED_MODULE';
const CODE_BLOCKED_API = 'ERR_METAAGENT_BLOCKED_API';

// Folders user code may load files from: the user's own folder (its main module is /app/main.js, and
// installed packages, when there are any, belong in /app/node_modules). Nothing else: not the runner's
// folder, not Debian's /usr/share/nodejs, not /tmp, not /etc.
const ALLOWED_ROOTS = ObjectFreeze(['/app/']);

// Built-ins user code may load, without or with the node: prefix. Deny by default: every other
// built-in, including any a later Node adds, is refused. None of these reaches files or programs.
// http and https stay, although they reach sockets (their Agent creates net sockets): programs use
// them, and the container has no network and no socket to reach.
const ALLOWED_BUILTINS = ObjectFreeze([
  'assert', 'assert/strict', 'async_hooks', 'buffer', 'console', 'constants', 'crypto',
  'diagnostics_channel', 'dns', 'dns/promises', 'domain', 'events', 'http', 'https',
  'module', // hardened by gate.js: _load, _resolveFilename, _extensions locked, register refused
  'os', 'path', 'path/posix', 'path/win32', 'perf_hooks',
  'process', // the same, hardened process object as the global
  'punycode', 'querystring', 'readline', 'readline/promises', 'stream', 'stream/consumers',
  'stream/promises', 'stream/web', 'string_decoder', 'sys', 'timers', 'timers/promises', 'tty', 'url',
  'util', 'util/types', 'zlib',
]);

// Why the notable refused built-ins are refused (for readers and the docs; the message does not say).
const BLOCKED_BUILTINS = ObjectFreeze({
  __proto__: null,
  fs: 'reads and writes files',
  'fs/promises': 'reads and writes files',
  child_process: 'runs programs',
  cluster: 'forks processes (child_process underneath)',
  worker_threads: 'a Worker gets a fresh module system without this gate',
  inspector: 'the debugger protocol evaluates code inside internal modules, where fs is in scope',
  repl: 'a REPL context preloads every built-in through the internal loader',
  v8: 'setFlagsFromString undoes hardening at run time; heap snapshots write files',
  // Not a boundary either way (a context escape only gives back the same gated process), but
  // vm.Script and compileFunction accept cachedData: a V8 code cache that V8 takes without verifying
  // it (a flipped payload byte is accepted), so forged bytecode would run below any JavaScript gate.
  vm: 'cachedData feeds V8 unverified bytecode',
  wasi: 'WASI preopens give WebAssembly file access',
  trace_events: 'writes trace files',
  test: 'the test runner spawns child processes',
  net: 'raw TCP and Unix sockets',
  tls: 'raw TLS sockets over net',
  dgram: 'UDP sockets',
  http2: 'raw HTTP/2 sessions over net and tls; programs do not need it',
  _tls_wrap: 'tls under a legacy name',
  _tls_common: 'tls under a legacy name',
});

function nullTable(names) {
  const table = ObjectCreate(null);
  for (let i = 0; i < names.length; i++) table[names[i]] = true;
  return ObjectFreeze(table);
}

const allowed = nullTable(ALLOWED_BUILTINS);
const builtin = nullTable(builtinModules);

function startsWith(string, prefix) {
  return ReflectApply(StringPrototypeStartsWith, string, [prefix]);
}

function slice(string, start, end) {
  return ReflectApply(StringPrototypeSlice, string, [start, end]);
}

// `callee`, when given, is the gate function the user's call entered: the stack then starts at the
// user's own call rather than inside the gate.
function blockedError(code, message, callee) {
  const error = new ErrorCtor(message);
  if (typeof callee === 'function') ErrorCaptureStackTrace(error, callee);
  // defineProperty, not assignment: user code may have put a `code` setter on Object.prototype.
  ObjectDefineProperty(error, 'code', {
    __proto__: null, value: code, enumerable: true, writable: true, configurable: true,
  });
  return error;
}

function shorten(text) {
  return text.length > 80 ? `${slice(text, 0, 77)}...` : text;
}

// The built-in a request names, if it is a refused one, else undefined. "node:x" always names the
// built-in x (refused unless allowed, even an unknown one); a bare name only if x is a built-in.
function refusedBuiltin(request) {
  if (typeof request !== 'string') return undefined;
  const schemed = startsWith(request, 'node:');
  const name = schemed ? slice(request, 5) : request;
  if (allowed[name] === true) return undefined;
  if (schemed || builtin[name] === true) return name;
  return undefined;
}

// The built-in a request names, without the node: scheme, or undefined when it names none.
function builtinName(request) {
  if (typeof request !== 'string') return undefined;
  if (startsWith(request, 'node:')) return slice(request, 5);
  return builtin[request] === true ? request : undefined;
}

function isBuiltinName(name) {
  return typeof name === 'string' && (startsWith(name, 'node:') || builtin[name] === true);
}

// True when an absolute path, once normalised ("..", "//"), lies in an allowed folder.
function isAllowedPath(path) {
  if (typeof path !== 'string' || !startsWith(path, '/')) return false;
  const normal = pathNormalize(path);
  for (let i = 0; i < ALLOWED_ROOTS.length; i++) {
    if (startsWith(normal, ALLOWED_ROOTS[i])) return true;
  }
  return false;
}

// The absolute path a request names relative to `base` (a folder), normalised: where a loader would look.
function resolveFrom(base, request) {
  return pathResolve(base, request);
}

function isRelativeRequest(request) {
  return request === '.' || request === '..' || startsWith(request, './') || startsWith(request, '../');
}

function builtinBlockedError(name, callee) {
  return blockedError(CODE_BLOCKED_MODULE, `Module "${name}" is blocked in the sandbox (node:${name})`, callee);
}

function pathBlockedError(request, callee) {
  return blockedError(
    CODE_BLOCKED_MODULE,
    `Module "${shorten(request)}" is blocked in the sandbox (only files under ${ALLOWED_ROOTS[0]} can be loaded)`,
    callee,
  );
}

function urlBlockedError(specifier, scheme) {
  return blockedError(
    CODE_BLOCKED_MODULE,
    `Module "${shorten(specifier)}" is blocked in the sandbox (${scheme} URLs cannot be imported)`,
  );
}

function blockedModuleError(message, callee) {
  return blockedError(CODE_BLOCKED_MODULE, message, callee);
}

function apiBlockedError(api, callee) {
  return blockedError(CODE_BLOCKED_API, `${api} is blocked in the sandbox`, callee);
}

// Throws unless `request` is a string; a TypeError like Module.prototype.require's own check. Objects
// are refused rather than converted: their toString could answer differently at each call.
function requireString(request, what) {
  if (typeof request !== 'string') {
    const error = new TypeErrorCtor(`The "${what}" argument must be of type string`);
    ObjectDefineProperty(error, 'code', {
      __proto__: null, value: 'ERR_INVALID_ARG_TYPE', enumerable: true, writable: true, configurable: true,
    });
    throw error;
  }
}

module.exports = ObjectFreeze({
  __proto__: null,
  CODE_BLOCKED_MODULE,
  CODE_BLOCKED_API,
  ALLOWED_ROOTS,
  ALLOWED_BUILTINS,
  BLOCKED_BUILTINS,
  refusedBuiltin,
  builtinName,
  isBuiltinName,
  isAllowedPath,
  isRelativeRequest,
  resolveFrom,
  dirname: pathDirname,
  builtinBlockedError,
  pathBlockedError,
  urlBlockedError,
  blockedModuleError,
  apiBlockedError,
  requireString,
});
