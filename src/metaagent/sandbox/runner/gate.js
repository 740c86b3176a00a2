'use strict';
// metaagent module gate: refuses, inside the sandboxed node process, the modules and process APIs that
// reach files, programs, raw sockets, workers or the debugger (NODE_HARDENING.md, "the in-process
// gate"). The container is the boundary; this gate is depth, and it turns attempts into clear errors
// with stable codes (ERR_METAAGENT_BLOCKED_MODULE, ERR_METAAGENT_BLOCKED_API).
//
// Two stages:
// 1. Loading this file (at the runner's start, long before the payload arrives) captures every
//    built-in the hooks use and registers the ESM hooks (gate-hooks.mjs) on their own thread. This must
//    happen before user code exists: register() starts an internal Worker and announces it with
//    process.emit('worker') on the next tick, and a listener of that event could construct a fresh,
//    ungated Worker from its class.
// 2. install() (from the runner's installGate, after the payload is read and before the user's module is
//    compiled) hooks the CommonJS loader at its choke points and neuters the process APIs.
//
// Spellings covered, because they all end in Module._load / Module._resolveFilename / the extension
// loaders or the ESM resolver: require(), require('node:...'), module.createRequire, module.constructor
// ._load, process.mainModule.require, require.main.require, a fresh Module#_compile, Module.runMain,
// Module._preloadModules, require.extensions[...](), Module#load, import(), import() of data: and file:
// URLs, from CommonJS, eval and new Function code alike.

const Module = require('module');
const policy = require('./policy.js');
const { pathToFileURL } = require('url');
const crypto = require('crypto');
const tls = require('tls');

const ReflectApply = Reflect.apply;
const ObjectDefineProperty = Object.defineProperty;
const ObjectGetOwnPropertyDescriptor = Object.getOwnPropertyDescriptor;
const ObjectFreeze = Object.freeze;
const ObjectGetPrototypeOf = Object.getPrototypeOf;
const processOn = process.on;
const processExit = process.exit;
const stderrWrite = process.stderr.write;
const stderr = process.stderr;

const {
  refusedBuiltin, isBuiltinName, isAllowedPath, builtinBlockedError, pathBlockedError, apiBlockedError,
  requireString,
} = policy;

const EXIT_GATE_UNAVAILABLE = 70; // EX_SOFTWARE, as the runner's bad payload: the runner gave up, not the user

function gateUnavailable(reason) {
  ReflectApply(stderrWrite, stderr, [`metaagent-runner: the module gate cannot start: ${reason}\n`]);
  ReflectApply(processExit, process, [EXIT_GATE_UNAVAILABLE]);
}

// The originals, captured before user code exists and never handed out.
const originalLoad = Module._load;
const originalResolveFilename = Module._resolveFilename;
const originalRegister = Module.register;
const originalGetBuiltinModule = process.getBuiltinModule; // Node >= 20.16 only; undefined on 18
const extensions = Module._extensions;
const extensionNames = ['.js', '.json', '.node'];
const originalExtensions = { __proto__: null };
for (const name of extensionNames) originalExtensions[name] = extensions[name];
const ownFiles = [__filename, require.resolve('./policy.js')];
// The native SecureContext behind tls, https and fetch: its engine methods dlopen() a path.
const SecureContextPrototype = ObjectGetPrototypeOf(tls.createSecureContext().context);

// Stage 1: the ESM hooks, now. Without them import('fs') would reach the built-in untouched.
if (typeof originalRegister !== 'function') {
  gateUnavailable(`module.register is missing in node ${process.version} (it needs 18.19 or later)`);
}
try {
  ReflectApply(originalRegister, Module, ['./gate-hooks.mjs', pathToFileURL(__filename).href]);
} catch (error) {
  gateUnavailable(`registering the ESM hooks failed (${error && error.message})`);
}

function lock(object, key, value) {
  ObjectDefineProperty(object, key, {
    __proto__: null, value, writable: false, enumerable: true, configurable: false,
  });
}

function blockedApi(name) {
  return function blocked() {
    throw apiBlockedError(name, blocked);
  };
}

// Module._load: every require() spelling ends here. "node:x" requests never reach _resolveFilename, so
// built-ins are decided here first; the rest goes through the gated _resolveFilename below.
function gatedLoad(request, parent, isMain) {
  requireString(request, 'request');
  const refused = refusedBuiltin(request);
  if (refused !== undefined) throw builtinBlockedError(refused, gatedLoad);
  return ReflectApply(originalLoad, Module, [request, parent, isMain]);
}

// Module._resolveFilename: decides before resolving (so that paths outside /app/ are not even probed),
// then checks what resolution produced (bare names resolved through node_modules or NODE_PATH, a user
// supplied parent or paths option, a replaced Module._findPath...). Realpaths come back, so a symbolic
// link cannot lead out either.
function gatedResolveFilename(request, parent, isMain, options) {
  requireString(request, 'request');
  const refused = refusedBuiltin(request);
  if (refused !== undefined) throw builtinBlockedError(refused, gatedResolveFilename);
  const absolute = request.length > 0 && request[0] === '/';
  if (absolute && !isAllowedPath(request)) throw pathBlockedError(request, gatedResolveFilename);
  const filename = ReflectApply(originalResolveFilename, Module, [request, parent, isMain, options]);
  if (isBuiltinName(filename)) {
    const refusedResult = refusedBuiltin(filename);
    if (refusedResult !== undefined) throw builtinBlockedError(refusedResult, gatedResolveFilename);
    return filename;
  }
  if (!isAllowedPath(filename)) throw pathBlockedError(request, gatedResolveFilename);
  return filename;
}

// require.extensions[...] (the same object as Module._extensions) read any file they are given, and
// Module#load hands them any filename: the reader runs only for files in an allowed folder.
function gatedExtension(name) {
  const original = originalExtensions[name];
  const gated = {
    [name](module, filename) {
      if (!isAllowedPath(filename)) throw pathBlockedError(typeof filename === 'string' ? filename : '?', gated);
      return ReflectApply(original, this, [module, filename]);
    },
  }[name];
  return gated;
}

function gatedGetBuiltinModule(id) {
  requireString(id, 'id');
  const refused = refusedBuiltin(id);
  if (refused !== undefined) throw builtinBlockedError(refused, gatedGetBuiltinModule);
  return ReflectApply(originalGetBuiltinModule, process, [id]);
}

// process.report: getReport (a JSON diagnostic, used to tell glibc from musl) keeps working; nothing
// can write a report file or arm one for a signal or a crash.
function safeReport(original) {
  const getReport = original.getReport;
  return ObjectFreeze({
    __proto__: null,
    getReport: function getReport_(error) {
      return ReflectApply(getReport, original, [error]);
    },
    writeReport: blockedApi('process.report.writeReport'),
    directory: '',
    filename: '',
    compact: false,
    signal: 'SIGUSR2',
    reportOnFatalError: false,
    reportOnSignal: false,
    reportOnUncaughtException: false,
  });
}

function ignoreSignal() {}

let installed = false;

// Stage 2. Throws (before any user code runs) if any piece cannot be put in place.
function install() {
  if (installed) return;
  installed = true;

  // The CommonJS loader's choke points, locked so that user code can neither restore nor replace them.
  lock(Module, '_load', gatedLoad);
  lock(Module, '_resolveFilename', gatedResolveFilename);
  for (const name of extensionNames) lock(extensions, name, gatedExtension(name));
  // User-registered loader hooks would run on the hooks thread, outside this gate.
  lock(Module, 'register', blockedApi('module.register'));

  // Process APIs that reach native bindings, shared objects, report files, the debugger or source maps.
  lock(process, 'binding', blockedApi('process.binding'));
  lock(process, '_linkedBinding', blockedApi('process._linkedBinding'));
  lock(process, 'dlopen', blockedApi('process.dlopen'));
  lock(process, '_debugProcess', blockedApi('process._debugProcess'));
  // Source maps make node read the files a map names (any path) and print their lines in stack traces.
  lock(process, 'setSourceMapsEnabled', blockedApi('process.setSourceMapsEnabled'));
  const report = ObjectGetOwnPropertyDescriptor(process, 'report');
  if (report !== undefined) lock(process, 'report', safeReport(process.report));
  if (typeof originalGetBuiltinModule === 'function') lock(process, 'getBuiltinModule', gatedGetBuiltinModule);
  // SIGUSR1 starts the inspector on 127.0.0.1:9229 (reachable through http even without a network),
  // whether user code signals itself or pid 1 (dumb-init forwards it). A listener replaces node's
  // handler; should user code remove it, the signal's default action ends the process instead.
  ReflectApply(processOn, process, ['SIGUSR1', ignoreSignal]);

  // OpenSSL's dynamic engine dlopen()s the path it is given: crypto.setEngine, and the privateKeyEngine
  // and clientCertEngine options that tls, https and fetch (undici) pass on to the native SecureContext.
  lock(crypto, 'setEngine', blockedApi('crypto.setEngine'));
  lock(SecureContextPrototype, 'setEngineKey', blockedApi('the privateKeyEngine TLS option'));
  lock(SecureContextPrototype, 'setClientCertEngine', blockedApi('the clientCertEngine TLS option'));

  // The gate's own modules leave the CommonJS cache: require.cache leads to nothing of the runner's.
  for (const file of ownFiles) delete Module._cache[file];
  // ESM facades of built-ins snapshot their named exports: make them show the hardened values.
  Module.syncBuiltinESMExports();
}

module.exports = ObjectFreeze({ __proto__: null, install });
