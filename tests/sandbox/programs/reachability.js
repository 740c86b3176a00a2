'use strict';
// The reachability walk of tests/sandbox/test_reachability.py, in two modes.
//
// reference(): run in an ungated node of the sandbox image (with --expose-internals). Prints the
// fingerprints of the functions that give file, program, worker, debugger, raw-handle or loader
// powers: every function of the refused modules, node's internal loader and ESM loader, the original
// Module internals and process APIs the gate replaces, and the native handle classes. A JavaScript
// function's fingerprint is a hash of its source text, the same in every process of the image; a
// native one's is its name. It also runs the walk over fs and process in that ungated process, which
// must find fingerprints (the walk's own positive control).
//
// gated(): run as user code behind the gate, with the reference fingerprints on stdin. Walks everything
// reachable from globalThis, require, module, process and every allowed built-in (by require and by
// import()): own properties and symbols, getters (called), setters, prototypes. Prints what it found
// of the reference set (nothing, when the gate holds) and how much it walked.

const crypto = require('crypto');
const LIMIT = 400000;

function fingerprint(fn) {
  let source;
  try {
    source = Function.prototype.toString.call(fn);
  } catch {
    return null;
  }
  if (/\{\s*\[native code\]\s*\}$/.test(source)) return `native:${fn.name}`;
  return crypto.createHash('sha256').update(source).digest('hex').slice(0, 20);
}

// A walk that can be given more roots after it ran: walker.add(value, path), then walker.drain().
function walker(onFunction, onObject, limit = LIMIT) {
  const seen = new Set();
  const queue = [];
  let next = 0;
  const visit = (value, path) => {
    if ((typeof value !== 'object' || value === null) && typeof value !== 'function') return;
    if (seen.has(value) || seen.size >= limit) return;
    seen.add(value);
    queue.push([value, path]);
  };
  const drain = () => {
    for (; next < queue.length; next++) {
      const [object, path] = queue[next];
      if (typeof object === 'function') onFunction(object, path);
      else if (onObject) onObject(object, path);
      let keys;
      try {
        visit(Object.getPrototypeOf(object), `${path}.__proto__`);
        keys = Reflect.ownKeys(object);
      } catch {
        continue;
      }
      for (const key of keys) {
        const name = `${path}.${String(key)}`;
        let descriptor;
        try {
          descriptor = Object.getOwnPropertyDescriptor(object, key);
        } catch {
          continue;
        }
        if (descriptor === undefined) continue;
        if ('value' in descriptor) {
          visit(descriptor.value, name);
          continue;
        }
        if (descriptor.set) visit(descriptor.set, `${name} (setter)`);
        if (descriptor.get) {
          visit(descriptor.get, `${name} (getter)`);
          try {
            const value = Reflect.apply(descriptor.get, object, []);
            if (value instanceof Promise) value.catch(() => {}); // a getter for other receivers may reject
            visit(value, name);
          } catch {
            // a getter for other receivers
          }
        }
      }
    }
    return seen.size;
  };
  return { add: visit, drain, size: () => seen.size };
}

function walk(roots, onFunction, onObject) {
  const w = walker(onFunction, onObject);
  for (const [path, value] of roots) w.add(value, path);
  return w.drain();
}

// Objects that exist only after a call. Every class the walk reaches (a JavaScript function with methods
// on its prototype, or a `class`) is constructed with each of a few benign argument lists, and what it
// returns is walked in turn: the instance, its prototypes, its `_handle` and that handle's constructor,
// and the classes among them, until no new class turns up. `1` stands for a descriptor where a class
// takes one (tty.WriteStream(1), net.Socket(1)): a descriptor the runner holds.
const BENIGN_ARGUMENTS = [[], [1], [{}]];
// Internal classes that hand their arguments to a native constructor unchecked: node aborts on a
// missing one (a failed CHECK, which ends the process). Named by their function's name.
const ABORTS = new Set((typeof process.env.WALK_SKIP === 'string' ? process.env.WALK_SKIP : '').split('|').concat([
  'Zlib',
]));

function isClass(fn) {
  let source;
  try {
    source = Function.prototype.toString.call(fn);
  } catch {
    return false;
  }
  if (/\{\s*\[native code\]\s*\}$/.test(source)) return false; // natives are fingerprinted, never constructed
  if (ABORTS.has(fn.name)) return false;
  if (source.startsWith('class')) return true;
  const prototype = Object.getOwnPropertyDescriptor(fn, 'prototype');
  if (!prototype || !prototype.value || typeof prototype.value !== 'object') return false;
  return Reflect.ownKeys(prototype.value).some((key) => key !== 'constructor');
}

// Walks `roots`, then constructs every class found and walks what that makes. onFunction(fn, path,
// phase) sees each function once, with phase 'static' or 'constructed'. Returns the counts.
function walkWithInstances(roots, onFunction, onObject, trace) {
  let phase = 'static';
  const classes = [];
  const w = walker((fn, path) => {
    if (isClass(fn)) classes.push([fn, path]);
    onFunction(fn, path, phase);
  }, (object, path) => onObject && onObject(object, path, phase), 2 * LIMIT);
  for (const [path, value] of roots) w.add(value, path);
  const objects = w.drain();
  phase = 'constructed';
  // What a constructed object does later (a request's connection error, a stream's) is not the walk's.
  process.on('uncaughtException', () => {});
  process.on('unhandledRejection', () => {});
  let constructed = 0;
  for (let i = 0; i < classes.length; i++) {
    const [Class, path] = classes[i];
    for (const args of BENIGN_ARGUMENTS) {
      let instance;
      if (trace) trace(`${path} ${JSON.stringify(args)}`);
      try {
        instance = Reflect.construct(Class, args);
      } catch {
        continue;
      }
      constructed++;
      w.add(instance, `new ${path}(${args.map((a) => JSON.stringify(a)).join(', ')})`);
    }
    w.drain(); // may push more classes
  }
  return { objects, instances: w.size() - objects, classes: classes.length, constructed };
}

// The own functions of a module's exports, and the own methods of the classes among them (JavaScript
// functions only: a native's name is no identity, except for the handle classes listed by name below).
function ownFunctions(label, exports, into, skip = [], natives = false) {
  const add = (fn, name) => {
    const print = fingerprint(fn);
    if (print !== null && (natives || !print.startsWith('native:')) && !into.has(print)) into.set(print, name);
  };
  for (const key of Reflect.ownKeys(exports)) {
    if (skip.includes(key)) continue;
    let value;
    try {
      value = exports[key];
    } catch {
      continue;
    }
    if (typeof value === 'function') {
      add(value, `${label}.${String(key)}`);
      const prototype = value.prototype;
      if (prototype && typeof prototype === 'object') {
        for (const method of Reflect.ownKeys(prototype)) {
          const descriptor = Object.getOwnPropertyDescriptor(prototype, method);
          for (const fn of [descriptor.value, descriptor.get, descriptor.set]) {
            if (typeof fn === 'function' && method !== 'constructor') {
              add(fn, `${label}.${String(key)}.prototype.${String(method)}`);
            }
          }
        }
      }
    } else if (value && typeof value === 'object' && key === 'promises') {
      ownFunctions(`${label}.promises`, value, into);
    }
  }
}

// The allowed built-ins (the gate's list in runner/policy.js; the gated run checks it loads them all).
const ALLOWED = ['assert', 'assert/strict', 'async_hooks', 'buffer', 'console', 'constants', 'crypto',
  'diagnostics_channel', 'dns', 'dns/promises', 'domain', 'events', 'http', 'https', 'module', 'os', 'path',
  'path/posix', 'path/win32', 'perf_hooks', 'process', 'punycode', 'querystring', 'readline', 'readline/promises',
  'stream', 'stream/consumers', 'stream/promises', 'stream/web', 'string_decoder', 'sys', 'timers',
  'timers/promises', 'tty', 'url', 'util', 'util/types', 'zlib'];

function surfaceRoots(names) {
  const roots = [['globalThis', globalThis], ['require', require], ['module', module], ['process', process]];
  for (const name of names) roots.push([`require('${name}')`, require(name)]);
  return roots;
}

function reference() {
  const forbidden = new Map();
  const attempt = (label, load, skip = [], natives = false) => {
    try {
      ownFunctions(label, load(), forbidden, skip, natives);
    } catch {
      // a module this node does not have
    }
  };
  const Module = require('module');
  const descriptor = (object, key) => {
    const d = Object.getOwnPropertyDescriptor(object, key);
    return d.get ? d.get.call(object) : d.value;
  };
  attempt('Module', () => ({
    _findPath: Module._findPath, _stat: descriptor(Module, '_stat'), _readPackage: descriptor(Module, '_readPackage'),
    _initPaths: Module._initPaths, _preloadModules: Module._preloadModules, runMain: Module.runMain,
    register: Module.register, _load: Module._load, _resolveFilename: Module._resolveFilename,
    'prototype._compile': Module.prototype._compile, wrapSafe: require('internal/modules/cjs/loader').wrapSafe,
    "_extensions['.js']": Module._extensions['.js'], "_extensions['.json']": Module._extensions['.json'],
    "_extensions['.node']": Module._extensions['.node'],
  }));
  const asyncHooks = require('async_hooks');
  const tls = require('tls');
  const secureContext = Object.getPrototypeOf(tls.createSecureContext().context);
  attempt('process', () => ({
    binding: process.binding, _linkedBinding: process._linkedBinding, dlopen: process.dlopen,
    _getActiveHandles: process._getActiveHandles, _getActiveRequests: process._getActiveRequests,
    chdir: process.chdir, _debugProcess: process._debugProcess, setSourceMapsEnabled: process.setSourceMapsEnabled,
    'report.writeReport': process.report.writeReport, 'async_hooks.createHook': asyncHooks.createHook,
    'async_hooks.executionAsyncResource': asyncHooks.executionAsyncResource, 'crypto.setEngine': crypto.setEngine,
    'SecureContext.setEngineKey': secureContext.setEngineKey, 'SecureContext.setClientCertEngine': secureContext.setClientCertEngine,
  }), [], true); // these natives have names of their own: dlopen, _getActiveHandles, setEngineKey...
  for (const name of ['fs', 'fs/promises', 'child_process', 'cluster', 'inspector', 'repl', 'v8', 'vm', 'wasi',
    'trace_events', 'dgram', 'http2']) {
    attempt(name, () => require(name), name === 'inspector' ? ['console'] : []);
  }
  attempt('worker_threads', () => {
    const { Worker, moveMessagePortToContext, receiveMessageOnPort, setEnvironmentData, getEnvironmentData } = require('worker_threads');
    return { Worker, moveMessagePortToContext, receiveMessageOnPort, setEnvironmentData, getEnvironmentData };
  });
  for (const id of ['internal/fs/utils', 'internal/fs/promises', 'internal/fs/streams', 'internal/fs/dir',
    'internal/fs/watchers', 'internal/fs/read_file_context', 'internal/fs/rimraf', 'internal/child_process',
    'internal/worker', 'internal/modules/esm/loader', 'internal/modules/esm/hooks', 'internal/modules/esm/resolve',
    'internal/modules/esm/load', 'internal/modules/esm/translators', 'internal/modules/esm/utils',
    'internal/modules/esm/module_job', 'internal/modules/esm/module_map', 'internal/modules/run_main',
    'internal/modules/package_json_reader', 'internal/process/esm_loader']) {
    attempt(id, () => require(id));
  }
  attempt('cascadedLoader', () => {
    const loader = require('internal/modules/esm/loader').getOrInitializeCascadedLoader();
    const methods = {};
    for (let proto = Object.getPrototypeOf(loader); proto && proto !== Object.prototype; proto = Object.getPrototypeOf(proto)) {
      for (const key of Reflect.ownKeys(proto)) {
        const fn = Object.getOwnPropertyDescriptor(proto, key).value;
        if (typeof fn === 'function' && key !== 'constructor') methods[`${proto.constructor.name}.${String(key)}`] = fn;
      }
    }
    return methods;
  });
  // Native handle classes and the file-system binding's most telling functions.
  const natives = {
    tcp_wrap: ['TCP', 'TCPConnectWrap'], pipe_wrap: ['Pipe', 'PipeConnectWrap'], tty_wrap: ['TTY'],
    udp_wrap: ['UDP', 'SendWrap'], process_wrap: ['Process'], spawn_sync: ['spawn'], stream_wrap: ['ShutdownWrap', 'WriteWrap', 'LibuvStreamWrap'],
    fs: ['FSReqCallback', 'FileHandle', 'StatWatcher', 'internalModuleReadJSON', 'internalModuleStat', 'openFileHandle', 'readdir', 'symlink', 'readlink', 'realpath', 'mkdtemp', 'copyFile', 'lchown', 'lutimes'],
    fs_event_wrap: ['FSEvent'], fs_dir: ['DirHandle', 'opendir'], contextify: ['ContextifyScript'], worker: ['Worker'],
    js_stream: ['JSStream'], inspector: ['Connection', 'MainThreadConnection'],
  };
  for (const [binding, names] of Object.entries(natives)) {
    let exports;
    try {
      exports = process.binding(binding);
    } catch {
      try {
        exports = require('internal/test/binding').internalBinding(binding);
      } catch {
        continue;
      }
    }
    for (const name of names) if (typeof exports[name] === 'function') forbidden.set(fingerprint(exports[name]), `${binding}.${name}`);
  }
  // And every native handle class of every binding, internal ones included: each class whose prototype
  // chain carries a handle's marks (HandleWrap's hasRef, StreamBase's isStreamBase), from the names of
  // every binding node's own sources ask for. None may be reachable as a function behind the gate.
  const { internalBinding } = require('internal/test/binding');
  const bindingNames = new Set();
  for (const [id, source] of Object.entries(process.binding('natives'))) {
    if (!id.startsWith('internal/deps/')) for (const m of source.matchAll(/internalBinding\('([a-z0-9_]+)'\)/g)) bindingNames.add(m[1]);
  }
  const isHandleClass = (value) => {
    if (typeof value !== 'function' || !value.prototype || typeof value.prototype !== 'object') return false;
    for (let p = value.prototype; p && p !== Object.prototype; p = Object.getPrototypeOf(p)) {
      if (Object.hasOwn(p, 'hasRef') || Object.hasOwn(p, 'isStreamBase')) return true;
    }
    return false;
  };
  // MessagePort is the web API's global, made only by MessageChannel (its constructor always throws).
  const WEB_GLOBALS = new Set([MessagePort]);
  for (const name of bindingNames) {
    let exports;
    try {
      exports = internalBinding(name);
    } catch {
      continue;
    }
    for (const key of Object.getOwnPropertyNames(exports)) {
      const value = Object.getOwnPropertyDescriptor(exports, key).value;
      if (isHandleClass(value) && !WEB_GLOBALS.has(value)) forbidden.set(fingerprint(value), `${name}.${key}`);
    }
  }
  // tty's streams: each constructs a native TTY handle on the descriptor it is given.
  const tty = require('tty');
  for (const name of ['ReadStream', 'WriteStream']) forbidden.set(fingerprint(tty[name]), `tty.${name}`);
  forbidden.delete(null);
  // A fingerprint must name one function. Not the base classes' methods that the refused modules share
  // with everything (fs.WriteStream.prototype.destroySoon is Writable.prototype.end), nor the source of
  // closures that a factory makes many of (util.deprecate's wrappers): drop both kinds.
  walk([['Object', Object], ['Function', Function], ['Array', Array], ['Error', Error], ['Promise', Promise],
    ['stream', require('stream')], ['events', require('events')], ['buffer', require('buffer')], ['util', require('util')]],
  (fn) => forbidden.delete(fingerprint(fn)));
  const objects = new Map();
  const everything = [['globalThis', globalThis], ['process', process]];
  for (const name of Module.builtinModules) {
    if (name.startsWith('internal/')) continue; // listed with --expose-internals; some run when loaded
    try {
      everything.push([name, require(name)]);
    } catch {
      // not loadable here
    }
  }
  walk(everything, (fn) => {
    const print = fingerprint(fn);
    if (!forbidden.has(print)) return;
    if (!objects.has(print)) objects.set(print, new Set());
    objects.get(print).add(fn);
  });
  for (const [print, functions] of objects) if (functions.size > 1 && !print.startsWith('native:')) forbidden.delete(print);
  let control = 0;
  walk([['fs', require('fs')], ['process', process]], (fn) => {
    if (forbidden.has(fingerprint(fn))) control++;
  });
  // How much the gated walk's roots reach without the gate: the gated run must cover most of it.
  const baseline = walk(surfaceRoots(ALLOWED), () => {});
  // One short line each: container logs come back in pieces of 16 KiB.
  for (const [print, label] of forbidden) process.stdout.write(`${JSON.stringify([print, label])}\n`);
  process.stdout.write(`${JSON.stringify(['baseline', baseline])}\n`);
  process.stdout.write(`${JSON.stringify(['control', control])}\n`);
  // The walk with instances, over the same roots in this ungated node: which powers it finds only
  // after a call (tty's native handles on a descriptor, among them), its positive control.
  // `node -e` makes every built-in a global of its own: those the gate refuses are left out (and the
  // global object's names for itself, which lead back to them).
  const globals = Object.create(Object.getPrototypeOf(globalThis));
  for (const key of Reflect.ownKeys(globalThis)) {
    if (key === 'globalThis' || key === 'global') continue;
    if (!Module.builtinModules.includes(key) || ALLOWED.includes(key)) {
      Object.defineProperty(globals, key, Object.getOwnPropertyDescriptor(globalThis, key));
    }
  }
  const roots = surfaceRoots(ALLOWED).map(([path, value]) => [path, path === 'globalThis' ? globals : value]);
  const discovered = { static: new Set(), constructed: {} };
  walkWithInstances(roots, (fn, path, phase) => {
    const label = forbidden.get(fingerprint(fn));
    if (label === undefined) return;
    if (phase === 'static') discovered.static.add(label);
    else if (!discovered.static.has(label) && !(label in discovered.constructed)) discovered.constructed[label] = path;
  });
  for (const [label, path] of Object.entries(discovered.constructed)) {
    process.stdout.write(`${JSON.stringify(['constructed', [label, path]])}\n`);
  }
  // What the walk constructed (servers, sockets) would keep this process alive.
  process.stdout.write('', () => process.exit(0));
}

async function gated() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  const forbidden = new Set(JSON.parse(Buffer.concat(chunks).toString()));
  const allowed = require('module').builtinModules.filter((name) => {
    try {
      require(name);
      return true;
    } catch {
      return false;
    }
  });
  const roots = surfaceRoots(allowed);
  for (const name of allowed) roots.push([`import('${name}')`, await import(name)]);
  const found = [];
  let functions = 0;
  let messagePorts = 0;
  const counts = walkWithInstances(roots, (fn, path) => {
    functions++;
    const print = fingerprint(fn);
    if (forbidden.has(print) && found.length < 50) found.push([print, path]);
  }, (object, path, phase) => {
    // no hooks thread, so no port to it: counted among what exists before any call
    if (phase === 'static' && object instanceof MessagePort) messagePorts++;
  });
  const { objects, instances, classes, constructed } = counts;
  process.stdout.write(JSON.stringify({ allowed, objects, instances, classes, constructed, functions, found, messagePorts }));
  process.exit(0); // what the walk constructed (servers, sockets) would keep this process alive
}
