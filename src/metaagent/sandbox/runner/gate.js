'use strict';
// metaagent module gate: refuses, inside the sandboxed node process, the modules and process APIs that
// reach files, programs, raw sockets, workers or the debugger (NODE_HARDENING.md, "the in-process
// gate"). The container is the boundary; this gate is depth, and it turns attempts into clear errors
// with stable codes (ERR_METAAGENT_BLOCKED_MODULE, ERR_METAAGENT_BLOCKED_API).
//
// What the gate relies on once user code runs, and why user code cannot reach or change it:
// - The bindings captured below and in policy.js and imports.js, when the runner loads them: before any
//   payload byte arrives, so before any user code exists. User code may replace globals and prototype
//   methods afterwards; these bindings keep pointing at the originals. Decisions look names up in
//   null-prototype tables and call captured functions through the captured Reflect.apply. Every options
//   object handed to node is a null-prototype literal, so a property planted on Object.prototype
//   (`cachedData`, `path`...) cannot ride along.
// - The loader's choke points, which node's own loader looks up on `Module` at call time: `_load`,
//   `_resolveFilename`, `_findPath`, the `_extensions` loaders and `Module.prototype._compile`. install()
//   replaces each with a gated version and locks it (non-writable, non-configurable), so user code can
//   neither restore nor replace them. The originals are held only in this file's scope.
// - import(): every function user code can ever run is compiled by the gated `_compile` (the user's
//   module, packages, a fresh `Module#_compile`), with an `importModuleDynamically` callback
//   (imports.js). V8 routes the import() of eval, `new Function` and nested code to the callback of the
//   script they came from. So import() is decided on this thread, with captured built-ins; there is no
//   ESM loader in use, no hooks thread, and no message port to forge replies on.
// - The path-probing internals (`Module._stat`, `_readPackage`, `_initPaths`, `_preloadModules`,
//   `runMain`, `register`) are replaced by refusals; `_findPath`, which node's resolver needs, only
//   looks inside the allowed folders, whatever `paths` it is given.
// - Handles: `process._getActiveHandles` and `_getActiveRequests` are refused, and user code's
//   async_hooks has no `createHook` or `executionAsyncResource` (they hand out the runner's own handles
//   and requests); node's own modules keep the real ones.
//   The runner's stdio never becomes a node stream (stdio.js), so no stdio object holds a handle.
// - Native handle classes (handles.js): every one node's bindings hold, found when the runner loads, is
//   gated as a class: no constructor from an instance, no `open(fd)`, no byte moved by a stream handle on
//   descriptors 0, 1 or 2. tty's ReadStream and WriteStream (a TTY handle on any descriptor) are refused.
//
// Not closed here, and why that is acceptable (SECURITY.md): http and https stay, and net's Socket and
// Server classes are reachable through their prototype chains (http.Server, tty.ReadStream). Their
// Unix-socket and file-descriptor forms of connect and listen are refused below; what remains is TCP
// on the container's loopback, which reaches nothing outside the container.

const Module = require('module');
const vm = require('vm');
const net = require('net');
const asyncHooks = require('async_hooks');
const crypto = require('crypto');
const tls = require('tls');
const tty = require('tty');
// Loaded now because node's worker module wraps process.chdir when it first loads (fetch loads it):
// after install() that property is locked.
require('worker_threads');
const policy = require('./policy.js');
const imports = require('./imports.js');
// Node's native handle classes, found in its bindings as this file loads and gated by install().
const handles = require('./handles.js');

const ReflectApply = Reflect.apply;
const ObjectDefineProperty = Object.defineProperty;
const ObjectGetOwnPropertyDescriptor = Object.getOwnPropertyDescriptor;
const ObjectGetPrototypeOf = Object.getPrototypeOf;
const ObjectSetPrototypeOf = Object.setPrototypeOf;
const ObjectKeys = Object.keys;
const ObjectCreate = Object.create;
const ObjectFreeze = Object.freeze;
const ArrayIsArray = Array.isArray;
const NumberIsNaN = Number.isNaN;
const vmCompileFunction = vm.compileFunction;
const processOn = process.on;

const {
  refusedBuiltin, builtinName, isBuiltinName, isAllowedPath, isRelativeRequest, resolveFrom, dirname,
  builtinBlockedError, pathBlockedError, apiBlockedError, requireString,
} = policy;

// The originals, captured before user code exists and never handed out.
const originalLoad = Module._load;
const originalResolveFilename = Module._resolveFilename;
const originalFindPath = Module._findPath;
const originalResolveLookupPaths = Module._resolveLookupPaths;
const originalRequire = Module.prototype.require;
const originalGetBuiltinModule = process.getBuiltinModule; // Node >= 20.16 only; undefined on 18
const extensions = Module._extensions;
const extensionNames = ['.js', '.json', '.node'];
const originalExtensions = { __proto__: null };
for (const name of extensionNames) originalExtensions[name] = extensions[name];
const moduleCache = Module._cache;
const originalConnect = net.Socket.prototype.connect;
const originalListen = net.Server.prototype.listen;
// The native Pipe class behind every Unix-socket and descriptor stream. User code can reach it as any
// such socket's `_handle.constructor` (`new net.Socket({fd: 0})`, a tunnel socket), and its methods take
// paths and descriptors past net's gated connect and listen, so they are gated themselves.
const PipePrototype = process.binding('pipe_wrap').Pipe.prototype;
const originalPipeConnect = PipePrototype.connect;
// The native SecureContext behind tls, https and fetch: its engine methods dlopen() a path.
const SecureContextPrototype = ObjectGetPrototypeOf(tls.createSecureContext().context);
const ownFiles = [
  __filename, require.resolve('./policy.js'), require.resolve('./imports.js'), require.resolve('./handles.js'),
];

const WRAPPER_PARAMETERS = ObjectFreeze(['exports', 'require', 'module', '__filename', '__dirname']);

function lock(object, key, value) {
  ObjectDefineProperty(object, key, {
    __proto__: null, value, writable: false, enumerable: true, configurable: false,
  });
}

// An own, writable data property, as an assignment would make it, but never through a setter that
// user code may have put on a prototype.
function setOwn(object, key, value) {
  ObjectDefineProperty(object, key, {
    __proto__: null, value, writable: true, enumerable: true, configurable: true,
  });
}

function blockedApi(name) {
  return function blocked() {
    throw apiBlockedError(name, blocked);
  };
}

// Built-ins whose exports user code gets a copy of, with some functions refused: node's own modules
// keep the real exports (they load built-ins through the internal loader, never through _load).
// async_hooks: a hook sees every async resource the process creates from then on, the runner's own
// included, and executionAsyncResource hands out the current one.
const facades = ObjectCreate(null);
facades.async_hooks = facadeOf(asyncHooks, {
  createHook: blockedApi('async_hooks.createHook'),
  executionAsyncResource: blockedApi('async_hooks.executionAsyncResource'),
});
// tty: its streams are native TTY handles on any descriptor the caller names, the runner's 0, 1 and 2
// included (the program's stdio is process.stdin, stdout and stderr, from stdio.js). isatty stays.
// The refusals keep the streams' place in the class tree: each is a net.Socket subclass, as node's are.
facades.tty = facadeOf(tty, {
  ReadStream: refusedSubclass(function ReadStream() {
    throw apiBlockedError('tty.ReadStream', ReadStream);
  }),
  WriteStream: refusedSubclass(function WriteStream() {
    throw apiBlockedError('tty.WriteStream', WriteStream);
  }),
});

function refusedSubclass(refusal) {
  ObjectSetPrototypeOf(refusal, net.Socket);
  const prototype = ObjectCreate(net.Socket.prototype);
  ObjectDefineProperty(prototype, 'constructor', {
    __proto__: null, value: refusal, writable: true, enumerable: false, configurable: true,
  });
  ObjectDefineProperty(refusal, 'prototype', { __proto__: null, value: prototype, writable: false });
  return refusal;
}

function facadeOf(exports, refusals) {
  const facade = ownOptions(exports);
  ObjectSetPrototypeOf(facade, ObjectGetPrototypeOf(exports));
  const names = ObjectKeys(refusals);
  for (let i = 0; i < names.length; i++) setOwn(facade, names[i], refusals[names[i]]);
  return facade;
}

// The refused built-in a request names, if any: a built-in with a facade (a session's fs) is not refused.
function refusedRequest(request) {
  if (facades[builtinName(request)] !== undefined) return undefined;
  return refusedBuiltin(request);
}

// Module._load: every require() spelling ends here. "node:x" requests never reach _resolveFilename, so
// built-ins are decided here first; the rest goes through the gated _resolveFilename below.
function gatedLoad(request, parent, isMain) {
  requireString(request, 'request');
  const refused = refusedRequest(request);
  if (refused !== undefined) throw builtinBlockedError(refused, gatedLoad);
  const facade = facades[builtinName(request)];
  if (facade !== undefined) return facade;
  return ReflectApply(originalLoad, Module, [request, parent, isMain]);
}

// The folder a relative request of `parent` is resolved against, read once (parent may be any object).
function parentFolder(parent) {
  const filename = parent !== null && typeof parent === 'object' ? parent.filename : undefined;
  return typeof filename === 'string' && filename[0] === '/' ? dirname(filename) : process.cwd();
}

// Module._resolveFilename: refuses, before any probing, absolute and relative requests that point out
// of the allowed folders; resolution itself probes only inside them (gatedFindPath). Then it checks
// what resolution produced (realpaths come back, so a symbolic link cannot lead out either).
function gatedResolveFilename(request, parent, isMain, options) {
  requireString(request, 'request');
  const refused = refusedRequest(request);
  if (refused !== undefined) throw builtinBlockedError(refused, gatedResolveFilename);
  if (request[0] === '/' && !isAllowedPath(request)) throw pathBlockedError(request, gatedResolveFilename);
  if (options === undefined && isRelativeRequest(request) && !isAllowedPath(resolveFrom(parentFolder(parent), request))) {
    throw pathBlockedError(request, gatedResolveFilename);
  }
  const filename = ReflectApply(originalResolveFilename, Module, [request, parent, isMain, options]);
  if (isBuiltinName(filename)) {
    const refusedResult = refusedRequest(filename);
    if (refusedResult !== undefined) throw builtinBlockedError(refusedResult, gatedResolveFilename);
    return filename;
  }
  if (!isAllowedPath(filename)) throw pathBlockedError(request, gatedResolveFilename);
  return filename;
}

// Module._findPath: node's resolver probes the file system here (stat, package.json, realpath). Only
// candidates inside the allowed folders are probed, whatever folders the caller passes (module.paths,
// require.resolve's `paths`, NODE_PATH), so no answer says anything about a path outside them.
function gatedFindPath(request, paths, isMain) {
  requireString(request, 'request');
  let allowed;
  if (request[0] === '/') {
    if (!isAllowedPath(request)) return false;
    allowed = [''];
  } else {
    allowed = [];
    const count = ArrayIsArray(paths) ? paths.length : 0;
    for (let i = 0; i < count; i++) {
      const base = paths[i];
      if (typeof base === 'string' && isAllowedPath(resolveFrom(base, request))) {
        setOwn(allowed, allowed.length, base);
      }
    }
    if (allowed.length === 0) return false;
  }
  const found = ReflectApply(originalFindPath, Module, [request, allowed, isMain]);
  return typeof found === 'string' && !isAllowedPath(found) ? false : found;
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

// The `require` a module's code gets, as node's makeRequireFunction makes it.
function makeRequire(module) {
  const require = function require(id) {
    return ReflectApply(originalRequire, module, [id]);
  };
  const resolve = function resolve(request, options) {
    requireString(request, 'request');
    return gatedResolveFilename(request, module, false, options);
  };
  const paths = function paths(request) {
    requireString(request, 'request');
    return ReflectApply(originalResolveLookupPaths, Module, [request, module]);
  };
  setOwn(resolve, 'paths', paths);
  setOwn(require, 'resolve', resolve);
  setOwn(require, 'main', process.mainModule);
  setOwn(require, 'extensions', extensions);
  setOwn(require, 'cache', moduleCache);
  return require;
}

// Module.prototype._compile: compiles every CommonJS module (the user's, packages, one made at run
// time) with the import() gate as its dynamic-import callback, then runs it as node would.
function gatedCompile(content, filename) {
  requireString(content, 'content');
  requireString(filename, 'filename');
  const module = this;
  const compiled = ReflectApply(vmCompileFunction, vm, [content, WRAPPER_PARAMETERS, {
    __proto__: null,
    filename,
    importModuleDynamically: importerFor(module),
  }]);
  const exports = module.exports;
  return ReflectApply(compiled, exports, [exports, makeRequire(module), module, filename, dirname(filename)]);
}

function gatedGetBuiltinModule(id) {
  requireString(id, 'id');
  const refused = refusedBuiltin(id);
  if (refused !== undefined) throw builtinBlockedError(refused, gatedGetBuiltinModule);
  return ReflectApply(originalGetBuiltinModule, process, [id]);
}

// process.report: getReport (a JSON diagnostic, used to tell glibc from musl) keeps working; nothing
// can write a report file or arm one for a signal or a crash. The settings stay assignable (node's own
// code assigns reportOnUncaughtException, for domains) but are plain values that arm nothing.
function safeReport(original) {
  const getReport = original.getReport;
  const report = {
    __proto__: null,
    directory: '',
    filename: '',
    compact: false,
    signal: 'SIGUSR2',
    reportOnFatalError: false,
    reportOnUncaughtException: false,
    reportOnSignal: false,
  };
  lock(report, 'getReport', function getReport_(error) {
    return ReflectApply(getReport, original, [error]);
  });
  lock(report, 'writeReport', blockedApi('process.report.writeReport'));
  return report;
}

// A copy of a caller's options object: own enumerable properties only (each getter read once), on a
// null prototype, so that what is checked is what node then reads.
function ownOptions(options) {
  const copy = ObjectCreate(null);
  const keys = ObjectKeys(options);
  for (let i = 0; i < keys.length; i++) setOwn(copy, keys[i], options[keys[i]]);
  return copy;
}

function isPortLike(value) {
  return typeof value === 'number' || (typeof value === 'string' && value !== '' && !NumberIsNaN(Number(value)));
}

const UNIX_SOCKET_REFUSED = 'Connecting to a Unix socket';
const LISTEN_REFUSED = 'Listening on a Unix socket or a file descriptor';

// net.Socket#connect (behind http, https, fetch and tls): TCP only. A Unix socket path is refused,
// except the ones the runner names (the execution's egress tunnel), so no connect can tell whether a
// path exists. Node's own callers pass their normalised arguments as an array: its first item is the
// options object, checked the same way.
function connectGate(allowedSocketPaths) {
  function checkedOptions(options) {
    const copy = ownOptions(options);
    if (copy.path !== undefined && copy.path !== null && allowedSocketPaths[copy.path] !== true) {
      throw apiBlockedError(UNIX_SOCKET_REFUSED, connect);
    }
    return copy;
  }
  function connect(...args) {
    const first = args[0];
    if (ArrayIsArray(first)) {
      if (first[0] !== null && typeof first[0] === 'object') setOwn(first, 0, checkedOptions(first[0]));
      else if (typeof first[0] === 'string' && !isPortLike(first[0]) && allowedSocketPaths[first[0]] !== true) {
        throw apiBlockedError(UNIX_SOCKET_REFUSED, connect);
      }
    } else if (first !== null && typeof first === 'object') {
      args[0] = checkedOptions(first);
    } else if (typeof first === 'string' && !isPortLike(first) && allowedSocketPaths[first] !== true) {
      throw apiBlockedError(UNIX_SOCKET_REFUSED, connect);
    }
    return ReflectApply(originalConnect, this, args);
  }
  return connect;
}

// net.Server#listen (behind http.Server): a TCP port only. A path (a socket file) or a file descriptor
// is refused; an object is passed on as a copy of its own properties, so a handle loses its handle.
function gatedListen(...args) {
  const first = args[0];
  if (first !== null && typeof first === 'object') {
    const options = ownOptions(first);
    if (options.path !== undefined || options.fd !== undefined) throw apiBlockedError(LISTEN_REFUSED, gatedListen);
    args[0] = options;
  } else if (typeof first === 'string' && !isPortLike(first)) {
    throw apiBlockedError(LISTEN_REFUSED, gatedListen);
  }
  return ReflectApply(originalListen, this, args);
}

// The Pipe handle's own methods, for whoever holds one: connect only to the runner's sockets (what
// net's connect let through ends here too); bind, listen and open (a socket file, a descriptor) never.
function pipeConnectGate(allowedSocketPaths) {
  return function connect(request, path, ...rest) {
    if (typeof path !== 'string' || allowedSocketPaths[path] !== true) {
      throw apiBlockedError(UNIX_SOCKET_REFUSED, connect);
    }
    return ReflectApply(originalPipeConnect, this, [request, path, ...rest]);
  };
}

// import() of user code: decided by imports.js with the same gated loader.
const importerFor = imports.importerFactory(gatedLoad, gatedResolveFilename, refusedRequest);

function ignoreSignal() {}

let installed = false;

// Puts the gate in place; throws (before any user code runs) if any piece cannot be. `unixSockets` lists
// the socket paths the runner itself connects to (the egress tunnel), which connect() may reach. A
// session passes its confined file system (fsgate.js): `builtins` (fs and fs/promises facades) and
// `chdir`; without them fs stays refused and chdir too.
function install({ unixSockets = [], builtins = {}, chdir = blockedApi('process.chdir') } = {}) {
  if (installed) return;
  installed = true;

  // The CommonJS loader's choke points, locked so that user code can neither restore nor replace them.
  lock(Module, '_load', gatedLoad);
  lock(Module, '_resolveFilename', gatedResolveFilename);
  lock(Module, '_findPath', gatedFindPath);
  lock(Module.prototype, '_compile', gatedCompile);
  for (const name of extensionNames) lock(extensions, name, gatedExtension(name));
  // Path probes and loaders that read or run what they are given, outside the choke points; user
  // registered loader hooks would run on a hooks thread, outside this gate.
  lock(Module, '_stat', blockedApi('module._stat'));
  lock(Module, '_readPackage', blockedApi('module._readPackage'));
  lock(Module, '_initPaths', blockedApi('module._initPaths'));
  lock(Module, '_preloadModules', blockedApi('module._preloadModules'));
  lock(Module, 'runMain', blockedApi('module.runMain'));
  lock(Module, 'register', blockedApi('module.register'));

  // Process APIs that reach native bindings, shared objects, report files, the debugger, source maps or
  // the runner's own handles.
  lock(process, 'binding', blockedApi('process.binding'));
  lock(process, '_linkedBinding', blockedApi('process._linkedBinding'));
  lock(process, 'dlopen', blockedApi('process.dlopen'));
  lock(process, '_debugProcess', blockedApi('process._debugProcess'));
  lock(process, '_debugEnd', blockedApi('process._debugEnd'));
  lock(process, '_getActiveHandles', blockedApi('process._getActiveHandles'));
  lock(process, '_getActiveRequests', blockedApi('process._getActiveRequests'));
  // chdir answers differently for a missing folder, a file and a folder: a probe of any path.
  lock(process, 'chdir', chdir);
  for (const name of ObjectKeys(builtins)) facades[name] = builtins[name];
  // Source maps make node read the files a map names (any path) and print their lines in stack traces.
  lock(process, 'setSourceMapsEnabled', blockedApi('process.setSourceMapsEnabled'));
  const report = ObjectGetOwnPropertyDescriptor(process, 'report');
  if (report !== undefined) lock(process, 'report', safeReport(process.report));
  if (typeof originalGetBuiltinModule === 'function') lock(process, 'getBuiltinModule', gatedGetBuiltinModule);
  // SIGUSR1 starts the inspector on 127.0.0.1:9229 (reachable through http even without a network),
  // whether user code signals itself or pid 1 (dumb-init forwards it). A listener replaces node's
  // handler; should user code remove it, the signal's default action ends the process instead.
  ReflectApply(processOn, process, ['SIGUSR1', ignoreSignal]);

  // Sockets: TCP only (see the header).
  const sockets = ObjectCreate(null);
  for (let i = 0; i < unixSockets.length; i++) sockets[unixSockets[i]] = true;
  lock(net.Socket.prototype, 'connect', connectGate(ObjectFreeze(sockets)));
  lock(net.Server.prototype, 'listen', gatedListen);
  lock(PipePrototype, 'connect', pipeConnectGate(ObjectFreeze(sockets)));
  lock(PipePrototype, 'bind', blockedApi('a Unix socket handle\'s bind'));
  lock(PipePrototype, 'listen', blockedApi('a Unix socket handle\'s listen'));
  // Every native handle class (handles.js): no constructor from an instance, no `open(fd)`, and no
  // stream handle on the runner's descriptors 0, 1 and 2 moves a byte.
  handles.install();

  // OpenSSL's dynamic engine dlopen()s the path it is given: crypto.setEngine, and the privateKeyEngine
  // and clientCertEngine options that tls, https and fetch (undici) pass on to the native SecureContext.
  lock(crypto, 'setEngine', blockedApi('crypto.setEngine'));
  lock(SecureContextPrototype, 'setEngineKey', blockedApi('the privateKeyEngine TLS option'));
  lock(SecureContextPrototype, 'setClientCertEngine', blockedApi('the clientCertEngine TLS option'));

  // The gate's own modules leave the CommonJS cache: require.cache leads to nothing of the runner's.
  for (const file of ownFiles) delete moduleCache[file];
}

// A session call's code: a script in the main context (its declarations persist, as in the REPL),
// with the import() gate for `referrer`, the session's module.
function scriptFor(code, filename, referrer) {
  return new vm.Script(code, { __proto__: null, filename, importModuleDynamically: importerFor(referrer) });
}

module.exports = ObjectFreeze({ __proto__: null, install, requireFor: makeRequire, scriptFor });
