'use strict';
// metaagent handle gate: node's native handle classes (libuv's handles and node's stream bases: TCP,
// Pipe, TTY, UDP, FileHandle, Signal, Process...), gated as a class rather than one wrapper at a time.
//
// A native handle class is the lowest point on every path to a descriptor: tty.ReadStream(0),
// tty.WriteStream(1), net.Socket({fd}), a socket's `_handle.constructor` and whatever else a later node
// builds on them all end in one of these constructors or in a handle's own `open(fd)`. The classes are
// not listed here by hand: they are found in node's own bindings when this file loads (before any
// payload byte arrives, so before any user code exists). The names are every `internalBinding('x')`
// node's built-in sources ask for (process.binding('natives')) and every binding already loaded
// (process.moduleLoadList); each one process.binding gives is searched for classes whose prototype chain
// carries a handle's marks (HandleWrap's `hasRef`, StreamBase's `isStreamBase`). Bindings process.binding
// does not give are internal to node: user code reaches their objects only through the allowed modules,
// which tests/sandbox/test_reachability.py walks, instances included.
//
// install() gates every class found, in three ways, each locked (non-writable, non-configurable):
// 1. No constructor from an instance: the `constructor` of each prototype in a handle class's chain is a
//    refusal. With process.binding refused, an instance's prototype was the only way to the class, so
//    user code makes no handle but through node's own wrappers, and those are gated (2, and tty in
//    gate.js).
// 2. No descriptor adopted: `open(fd)` (uv_pipe_open, uv_tcp_open, uv_udp_open: net.Socket({fd}),
//    net.Server#listen({fd}), dgram's `fd`) is refused on every handle class.
// 3. Nothing moves on the runner's stdio through a handle's methods: a stream handle whose descriptor
//    is 0, 1 or 2 (a TTY or a FileHandle made on one; their native constructors take the descriptor as
//    an argument) refuses every method of its stream base. The runner never makes a handle on them
//    (stdio.js), so only a handle user code made is refused. This is depth below 1 and 2, not a
//    replacement: a stream's `_externalStream` (locked by V8, so not gated here) lets node's HTTP parser
//    read it natively, which is why no user code may make such a handle in the first place.
// Each refusal is an ERR_METAAGENT_BLOCKED_API error that names the binding's class.

const policy = require('./policy.js');

const ReflectApply = Reflect.apply;
const ReflectOwnKeys = Reflect.ownKeys;
const ObjectCreate = Object.create;
const ObjectDefineProperty = Object.defineProperty;
const ObjectGetOwnPropertyDescriptor = Object.getOwnPropertyDescriptor;
const ObjectGetOwnPropertyNames = Object.getOwnPropertyNames;
const ObjectGetPrototypeOf = Object.getPrototypeOf;
const ObjectKeys = Object.keys;
const ObjectFreeze = Object.freeze;
const ObjectPrototype = Object.prototype;
const StringPrototypeIndexOf = String.prototype.indexOf;
const StringPrototypeSlice = String.prototype.slice;
const StringPrototypeStartsWith = String.prototype.startsWith;
const { apiBlockedError } = policy;

const BINDING_CALL = "internalBinding('";
const LOADED_BINDING = 'Internal Binding ';
const HANDLE_MARKS = ['hasRef', 'isStreamBase'];
const RUNNER_DESCRIPTORS = [0, 1, 2];

function indexOf(string, search, from) {
  return ReflectApply(StringPrototypeIndexOf, string, [search, from]);
}

function hasOwn(object, key) {
  return ObjectGetOwnPropertyDescriptor(object, key) !== undefined;
}

// The names of node's bindings, from node itself: its built-ins' sources and its load list.
function bindingNames() {
  const names = ObjectCreate(null);
  const natives = process.binding('natives');
  const ids = ObjectKeys(natives);
  for (let i = 0; i < ids.length; i++) {
    // node's vendored tools and libraries (acorn, undici, V8's tools) ask for no binding of their own
    if (ReflectApply(StringPrototypeStartsWith, ids[i], ['internal/deps/'])) continue;
    const source = natives[ids[i]];
    if (typeof source !== 'string') continue;
    for (let at = indexOf(source, BINDING_CALL, 0); at !== -1; at = indexOf(source, BINDING_CALL, at)) {
      at += BINDING_CALL.length;
      const end = indexOf(source, "'", at);
      if (end === -1) break;
      names[ReflectApply(StringPrototypeSlice, source, [at, end])] = true;
    }
  }
  const loaded = process.moduleLoadList;
  for (let i = 0; i < loaded.length; i++) {
    if (ReflectApply(StringPrototypeStartsWith, loaded[i], [LOADED_BINDING])) {
      names[ReflectApply(StringPrototypeSlice, loaded[i], [LOADED_BINDING.length])] = true;
    }
  }
  return ObjectKeys(names);
}

// The bindings process.binding gives, by name. Some of them warn once that process.binding is
// deprecated: not here, since no program asked for them.
function bindings() {
  const found = [];
  const names = bindingNames();
  const noDeprecation = ObjectGetOwnPropertyDescriptor(process, 'noDeprecation');
  ObjectDefineProperty(process, 'noDeprecation', {
    __proto__: null, value: true, writable: true, enumerable: true, configurable: true,
  });
  try {
    for (let i = 0; i < names.length; i++) {
      try {
        found[found.length] = [names[i], process.binding(names[i])];
      } catch {
        // internal to node (see the header)
      }
    }
  } finally {
    if (noDeprecation === undefined) delete process.noDeprecation;
    else ObjectDefineProperty(process, 'noDeprecation', noDeprecation);
  }
  return found;
}

// The prototypes of a class's chain, its own first, Object.prototype left out.
function chainOf(prototype) {
  const chain = [];
  for (let p = prototype; p !== null && p !== ObjectPrototype; p = ObjectGetPrototypeOf(p)) chain[chain.length] = p;
  return chain;
}

function isHandleClass(value) {
  if (typeof value !== 'function') return false;
  const prototype = value.prototype;
  if (prototype === null || typeof prototype !== 'object') return false;
  const chain = chainOf(prototype);
  for (let i = 0; i < chain.length; i++) {
    for (let j = 0; j < HANDLE_MARKS.length; j++) if (hasOwn(chain[i], HANDLE_MARKS[j])) return true;
  }
  return false;
}

// Every handle class of every binding, as [label ("tty_wrap.TTY"), class], each class once.
function handleClasses() {
  const classes = [];
  const seen = new Set();
  const all = bindings();
  for (let i = 0; i < all.length; i++) {
    const [name, binding] = all[i];
    if (binding === null || (typeof binding !== 'object' && typeof binding !== 'function')) continue;
    const keys = ObjectGetOwnPropertyNames(binding);
    for (let j = 0; j < keys.length; j++) {
      const descriptor = ObjectGetOwnPropertyDescriptor(binding, keys[j]);
      const value = descriptor.value;
      if (!isHandleClass(value) || seen.has(value)) continue;
      seen.add(value);
      classes[classes.length] = ObjectFreeze([`${name}.${keys[j]}`, value]);
    }
  }
  return ObjectFreeze(classes);
}

// Found now, while only the runner's code exists; gated by install().
const HANDLE_CLASSES = handleClasses();

function lock(object, key, value) {
  ObjectDefineProperty(object, key, {
    __proto__: null, value, writable: false, enumerable: false, configurable: false,
  });
}

// A refusal named `name` (util.inspect names a handle by its prototype's constructor), which throws
// when called or constructed.
function refusal(name, api) {
  const blocked = function blocked() {
    throw apiBlockedError(api, blocked);
  };
  ObjectDefineProperty(blocked, 'name', { __proto__: null, value: name, configurable: true });
  return blocked;
}

function isRunnerDescriptor(fd) {
  for (let i = 0; i < RUNNER_DESCRIPTORS.length; i++) if (fd === RUNNER_DESCRIPTORS[i]) return true;
  return false;
}

// A stream base's method that refuses to act for a handle on one of the runner's descriptors. `fdOf`
// is the base's own `fd` getter (a native accessor: it throws for any other receiver).
function stdioGuarded(name, key, original, fdOf) {
  return {
    [key](...args) {
      let fd;
      try {
        fd = ReflectApply(fdOf, this, []);
      } catch {
        fd = -1;
      }
      if (isRunnerDescriptor(fd)) throw apiBlockedError(`A ${name} handle on descriptor ${fd} (the runner's stdio)`, undefined);
      return ReflectApply(original, this, args);
    },
  }[key];
}

function guardStreamBase(prototype, name) {
  const fdDescriptor = ObjectGetOwnPropertyDescriptor(prototype, 'fd');
  if (fdDescriptor === undefined || typeof fdDescriptor.get !== 'function') return;
  const fdOf = fdDescriptor.get;
  const keys = ReflectOwnKeys(prototype);
  for (let i = 0; i < keys.length; i++) {
    const key = keys[i];
    // `onread` looks like a data property but is a native accessor: redefining it calls its setter on
    // the prototype, which aborts the process. It only holds the callback node's streams read with.
    if (key === 'constructor' || key === 'onread' || typeof key !== 'string') continue;
    const descriptor = ObjectGetOwnPropertyDescriptor(prototype, key);
    if (typeof descriptor.value === 'function' && descriptor.configurable) {
      lock(prototype, key, stdioGuarded(name, key, descriptor.value, fdOf));
    }
  }
}

let installed = false;

function install() {
  if (installed) return;
  installed = true;
  const done = new Set();
  for (let i = 0; i < HANDLE_CLASSES.length; i++) {
    const [label, Class] = HANDLE_CLASSES[i];
    const chain = chainOf(Class.prototype);
    for (let j = 0; j < chain.length; j++) {
      const prototype = chain[j];
      if (done.has(prototype)) continue;
      done.add(prototype);
      const ctor = ObjectGetOwnPropertyDescriptor(prototype, 'constructor');
      const name = ctor !== undefined && typeof ctor.value === 'function' ? ctor.value.name : '?';
      const what = j === 0 ? label : name; // a base several classes share
      const open = ObjectGetOwnPropertyDescriptor(prototype, 'open');
      if (open !== undefined && typeof open.value === 'function' && open.configurable) {
        lock(prototype, 'open', refusal('open', `A handle on a file descriptor (${what}#open)`));
      }
      guardStreamBase(prototype, name);
      if (ctor !== undefined && ctor.configurable) lock(prototype, 'constructor', refusal(name, `The native handle class ${what}`));
    }
  }
}

// The labels of the classes found, for the runner's own checks and tests.
function labels() {
  const out = [];
  for (let i = 0; i < HANDLE_CLASSES.length; i++) out[out.length] = HANDLE_CLASSES[i][0];
  return out;
}

module.exports = ObjectFreeze({ __proto__: null, install, labels });
