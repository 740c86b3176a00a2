'use strict';
// metaagent fs gate: in a session, the program's `fs` and `fs/promises`, confined to the session's
// folders (/workspace and /tmp).
//
// Every function of the facade takes its paths through one check: a path (a string, a Buffer or a
// file: URL, relative ones resolved against the process's cwd, which chdir keeps inside too) is turned
// into one absolute, normalised string, checked to lie inside a root, and only that string is handed to
// the real function, so that what was checked is what is opened. Links cannot be made (link, symlink),
// and node has no way to make a FIFO or a device, so nothing in the folders can lead out of them.
// Functions that take a descriptor accept only the ones this facade opened, and 0, 1 and 2: writes to 1
// and 2 go to the program's own stdout and stderr, reads of 0 see an empty stdin. Any other path or
// descriptor fails with an error whose code is ERR_METAAGENT_PATH_REFUSED, thrown by the synchronous
// functions and passed to the callback or the promise of the others. A function this file does not
// know is refused: a later node's additions stay out until someone looks at them.
//
// Everything here is captured when the runner loads, before any user code exists.

const fs = require('fs');
const pathModule = require('path');
const { URL, fileURLToPath } = require('url');
const { Buffer } = require('buffer');
const readlineCreateInterface = require('readline').createInterface;

const ReflectApply = Reflect.apply;
const ObjectCreate = Object.create;
const ObjectDefineProperty = Object.defineProperty;
const ObjectFreeze = Object.freeze;
const ObjectKeys = Object.keys;
const ErrorCtor = Error;
const ErrorCaptureStackTrace = Error.captureStackTrace;
const SafeSet = Set;
const SetPrototypeAdd = Set.prototype.add;
const SetPrototypeHas = Set.prototype.has;
const SetPrototypeDelete = Set.prototype.delete;
const PromiseReject = Promise.reject.bind(Promise);
const PromisePrototypeThen = Promise.prototype.then;
const StringPrototypeStartsWith = String.prototype.startsWith;
const StringPrototypeIndexOf = String.prototype.indexOf;
const StringPrototypeSlice = String.prototype.slice;
const BufferIsBuffer = Buffer.isBuffer;
const BufferFrom = Buffer.from;
const BufferAlloc = Buffer.alloc;
const ArrayBufferIsView = ArrayBuffer.isView;
const TextDecoderCtor = TextDecoder;
const nextTick = process.nextTick;
const processCwd = process.cwd;
const processChdir = process.chdir;
const pathResolve = pathModule.posix.resolve;
const pathNormalize = pathModule.posix.normalize;
const promises = fs.promises;
const WeakMapCtor = WeakMap;
const WeakMapPrototypeGet = WeakMap.prototype.get;
const WeakMapPrototypeSet = WeakMap.prototype.set;

const CODE_PATH_REFUSED = 'ERR_METAAGENT_PATH_REFUSED';
const strictUtf8 = new TextDecoderCtor('utf-8', { fatal: true });

function refusal(what, reason, callee) {
  const error = new ErrorCtor(`${what}: ${reason}`);
  if (typeof callee === 'function') ErrorCaptureStackTrace(error, callee);
  ObjectDefineProperty(error, 'code', {
    __proto__: null, value: CODE_PATH_REFUSED, enumerable: true, writable: true, configurable: true,
  });
  return error;
}

// The argument shapes of the functions, by name. p: a path; f: a descriptor; pf: a path or a descriptor
// (readFile, writeFile...); ph: a path or a FileHandle (fs.promises' readFile, writeFile...).
const SHAPES = {
  __proto__: null,
  access: ['p'], appendFile: ['pf'], chmod: ['p'], chown: ['p'], close: ['f'], copyFile: ['p', 'p'],
  cp: ['p', 'p'], createReadStream: ['p?'], createWriteStream: ['p?'], exists: ['p'], fchmod: ['f'],
  fchown: ['f'], fdatasync: ['f'], fstat: ['f'], fsync: ['f'], ftruncate: ['f'], futimes: ['f'],
  lchown: ['p'], lstat: ['p'], lutimes: ['p'], mkdir: ['p'], mkdtemp: ['prefix'], open: ['p'],
  opendir: ['p'], read: ['f'], readdir: ['p'], readFile: ['pf'], readlink: ['p'], readv: ['f'],
  realpath: ['p'], rename: ['p', 'p'], rm: ['p'], rmdir: ['p'], stat: ['p'], statfs: ['p'],
  truncate: ['pf'], unlink: ['p'], unwatchFile: ['p'], utimes: ['p'], watch: ['p'], watchFile: ['p'],
  write: ['f'], writeFile: ['pf'], writev: ['f'],
};
const PROMISE_SHAPES = {
  __proto__: null,
  access: ['p'], appendFile: ['ph'], chmod: ['p'], chown: ['p'], copyFile: ['p', 'p'], cp: ['p', 'p'],
  lchown: ['p'], lstat: ['p'], lutimes: ['p'], mkdir: ['p'], mkdtemp: ['prefix'], open: ['p'],
  opendir: ['p'], readdir: ['p'], readFile: ['ph'], readlink: ['p'], realpath: ['p'], rename: ['p', 'p'],
  rm: ['p'], rmdir: ['p'], stat: ['p'], statfs: ['p'], truncate: ['p'], unlink: ['p'], utimes: ['p'],
  watch: ['p'], writeFile: ['ph'],
};
// Links: the only way to make a name in the folders lead out of them.
const LINKS = ['link', 'symlink', 'lchmod'];
// Watchers: node's watcher objects have methods that start a watch on any path (a probe), so a session
// has none.
const WATCHERS = ['watch', 'watchFile', 'unwatchFile'];
// Plain values and classes that reach no path by themselves.
const KEPT = ['constants', 'Dirent', 'Stats', 'Dir', '_toUnixTimestamp'];

function createFsGate(roots, stdio) {
  const rootList = [];
  for (let i = 0; i < roots.length; i++) ObjectDefineProperty(rootList, i, { __proto__: null, value: roots[i], enumerable: true });
  const rootsText = roots.join(' and ');
  const opened = new SafeSet(); // descriptors this facade's open returned
  const handles = new WeakMapCtor(); // the FileHandle wrappers this facade handed out -> node's real ones

  function inside(absolute) {
    for (let i = 0; i < rootList.length; i++) {
      const root = rootList[i];
      if (absolute === root || ReflectApply(StringPrototypeStartsWith, absolute, [`${root}/`])) return true;
    }
    return false;
  }

  // The text a path argument names (a string, UTF-8 bytes or a file: URL), or throws the refusal.
  function pathText(value, what, callee) {
    let text;
    if (typeof value === 'string') {
      text = value;
    } else if (BufferIsBuffer(value) || (ArrayBufferIsView(value) && value.BYTES_PER_ELEMENT === 1)) {
      try {
        text = strictUtf8.decode(value);
      } catch {
        throw refusal(what, 'a path given as bytes must be UTF-8', callee);
      }
    } else if (value !== null && typeof value === 'object' && value.href && value.protocol !== undefined) {
      try {
        text = fileURLToPath(new URL(`${value.href}`));
      } catch {
        throw refusal(what, 'only file: URLs name files', callee);
      }
    } else {
      throw refusal(what, 'a path must be a string, a Buffer or a file: URL', callee);
    }
    return text;
  }

  // The absolute, normalised path a path argument names, or throws the refusal.
  function checkedPath(value, what, callee) {
    const text = pathText(value, what, callee);
    if (ReflectApply(StringPrototypeIndexOf, text, ['\u0000']) !== -1) throw refusal(what, 'a path cannot hold NUL', callee);
    const absolute = pathNormalize(pathResolve(ReflectApply(processCwd, process, []), text));
    if (!inside(absolute)) {
      throw refusal(what, `${absolute} is outside ${rootsText}, the only folders a session's code may use`, callee);
    }
    return absolute;
  }

  function checkedDescriptor(value, what, callee) {
    if (typeof value === 'number' && (value <= 2 || ReflectApply(SetPrototypeHas, opened, [value]))) return value;
    throw refusal(what, `descriptor ${value} was not opened by this program's fs`, callee);
  }

  function checkedArgument(shape, value, what, callee) {
    if (shape === 'p') return checkedPath(value, what, callee);
    if (shape === 'p?') return value === null || value === undefined ? value : checkedPath(value, what, callee);
    if (shape === 'f') return checkedDescriptor(value, what, callee);
    if (shape === 'pf') return typeof value === 'number' ? checkedDescriptor(value, what, callee) : checkedPath(value, what, callee);
    if (shape === 'ph') {
      const real = value !== null && typeof value === 'object' ? ReflectApply(WeakMapPrototypeGet, handles, [value]) : undefined;
      return real !== undefined ? real : checkedPath(value, what, callee);
    }
    // mkdtemp's prefix: the folder it names, with the random suffix, must be inside. Node gets the
    // checked string, never the caller's value, whose toString may say something else than its bytes.
    const absolute = checkedPath(`${pathText(value, what, callee)}XXXXXX`, what, callee);
    return ReflectApply(StringPrototypeSlice, absolute, [0, absolute.length - 6]);
  }

  // A copy of stream options with their descriptor checked, and the facade's own functions as the fs the
  // stream opens, reads, writes and closes with (node keeps it in the stream: never the real module).
  function checkedStreamOptions(options, what, callee) {
    const copy = ObjectCreate(null);
    if (typeof options === 'string') copy.encoding = options;
    else if (options !== null && typeof options === 'object') {
      const keys = ObjectKeys(options);
      for (let i = 0; i < keys.length; i++) copy[keys[i]] = options[keys[i]];
    }
    if (copy.fd !== null && typeof copy.fd === 'object') {
      const real = ReflectApply(WeakMapPrototypeGet, handles, [copy.fd]);
      if (real === undefined) throw refusal(what, 'fd must be a descriptor or a FileHandle of this program', callee);
      copy.fd = real.fd;
      copy.fs = handleOperations(real);
      return copy;
    }
    if (copy.fd !== undefined && copy.fd !== null) checkedDescriptor(copy.fd, what, callee);
    copy.fs = streamFs;
    return copy;
  }

  // fs.write and fs.writeSync on 1 and 2 go to the program's stdout and stderr; reads of 0 see EOF.
  function stdioBytes(args) {
    const data = args[1];
    if (typeof data === 'string') return BufferFrom(data, typeof args[3] === 'string' ? args[3] : 'utf8');
    if (ArrayBufferIsView(data)) {
      const view = BufferFrom(data.buffer, data.byteOffset, data.byteLength);
      const offset = typeof args[2] === 'number' ? args[2] : 0;
      const length = typeof args[3] === 'number' ? args[3] : view.length - offset;
      return view.subarray(offset, offset + length);
    }
    return BufferFrom(`${data}`);
  }

  // The encoding a whole-file function's options name (a string, or an object's `encoding`).
  function encodingOf(options, fallback) {
    if (typeof options === 'string') return options;
    if (options !== null && typeof options === 'object' && typeof options.encoding === 'string') return options.encoding;
    return fallback;
  }

  // A descriptor of the program's stdio given to a function that takes a path or a descriptor: as for
  // write and read, writeFile and appendFile on 1 and 2 are the program's output, readFile of 0 is empty.
  function isStdioDescriptor(shape, value) {
    return (shape === 'f' || shape === 'pf') && typeof value === 'number' && value <= 2;
  }

  function gatedSync(name, original, shapes) {
    const what = `fs.${name}`;
    const gated = {
      [name](...args) {
        for (let i = 0; i < shapes.length; i++) args[i] = checkedArgument(shapes[i], args[i], what, gated);
        if (name === 'createReadStream' || name === 'createWriteStream') args[1] = checkedStreamOptions(args[1], what, gated);
        if (isStdioDescriptor(shapes[0], args[0])) return stdioSync(name, args, what, gated);
        const result = ReflectApply(original, fs, args);
        if (name === 'openSync') ReflectApply(SetPrototypeAdd, opened, [result]);
        if (name === 'closeSync') ReflectApply(SetPrototypeDelete, opened, [args[0]]);
        return result;
      },
    }[name];
    return gated;
  }

  function stdioSync(name, args, what, callee) {
    if (name === 'writeSync' && args[0] >= 1) {
      const bytes = stdioBytes(args);
      stdio.write(args[0], bytes);
      return bytes.length;
    }
    if (name === 'readSync' && args[0] === 0) return 0;
    if (name === 'closeSync') return undefined; // the program's stdio stays open: a stream on 1 closes it as it ends
    if ((name === 'writeFileSync' || name === 'appendFileSync') && args[0] >= 1) {
      const data = args[1];
      let bytes;
      if (typeof data === 'string') bytes = BufferFrom(data, encodingOf(args[2], 'utf8'));
      else if (ArrayBufferIsView(data)) bytes = BufferFrom(data.buffer, data.byteOffset, data.byteLength);
      else throw refusal(what, 'the data must be a string, a Buffer, a TypedArray or a DataView', callee);
      stdio.write(args[0], bytes);
      return undefined;
    }
    if (name === 'readFileSync' && args[0] === 0) {
      const encoding = encodingOf(args[1], null);
      return encoding === null ? BufferAlloc(0) : '';
    }
    throw refusal(what, `descriptor ${args[0]} is the program's stdio, which only write (1, 2) and read (0) reach`, callee);
  }

  function gatedCallback(name, original, shapes) {
    const what = `fs.${name}`;
    const gated = {
      [name](...args) {
        const last = args.length - 1;
        const callback = typeof args[last] === 'function' ? args[last] : undefined;
        try {
          for (let i = 0; i < shapes.length; i++) args[i] = checkedArgument(shapes[i], args[i], what, gated);
          if (isStdioDescriptor(shapes[0], args[0])) {
            const syncName = `${name}Sync`;
            const result = stdioSync(syncName, args, what, gated);
            if (callback !== undefined) ReflectApply(nextTick, process, [callback, null, result, args[1]]);
            return undefined;
          }
        } catch (error) {
          if (callback === undefined || name === 'watch' || name === 'watchFile' || name === 'unwatchFile') throw error;
          ReflectApply(nextTick, process, [callback, error]);
          return undefined;
        }
        if (name === 'open' && callback !== undefined) {
          args[last] = function opened_(error, fd) {
            if (!error) ReflectApply(SetPrototypeAdd, opened, [fd]);
            return ReflectApply(callback, this, [error, fd]);
          };
        }
        if (name === 'close') ReflectApply(SetPrototypeDelete, opened, [args[0]]);
        return ReflectApply(original, fs, args);
      },
    }[name];
    return gated;
  }

  function gatedPromise(name, original, shapes) {
    const what = `fs.promises.${name}`;
    const gated = {
      [name](...args) {
        try {
          for (let i = 0; i < shapes.length; i++) args[i] = checkedArgument(shapes[i], args[i], what, gated);
        } catch (error) {
          if (name === 'watch') throw error;
          return PromiseReject(error);
        }
        const result = ReflectApply(original, promises, args);
        if (name !== 'open') return result;
        return ReflectApply(PromisePrototypeThen, result, [wrapHandle]);
      },
    }[name];
    return gated;
  }

  function refusedLink(name, flavour) {
    const what = `fs.${flavour === 'promise' ? 'promises.' : ''}${name}`;
    const refused = {
      [name](...args) {
        const error = refusal(what, 'links cannot be made in a session (they could lead out of its folders)', refused);
        if (flavour === 'promise') return PromiseReject(error);
        const callback = args[args.length - 1];
        if (flavour === 'callback' && typeof callback === 'function') {
          ReflectApply(nextTick, process, [callback, error]);
          return undefined;
        }
        throw error;
      },
    }[name];
    return refused;
  }

  function refusedUnknown(name) {
    const refused = {
      [name]() {
        throw refusal(`fs.${name}`, 'this file-system function is not available in a session', refused);
      },
    }[name];
    return refused;
  }

  // The stream classes: functions that make node's streams with a checked path and the facade's fs. They
  // do not extend node's classes (whose constructor takes any path and the real fs), and those classes'
  // prototypes lead back here: nothing reaches node's constructors.
  function gatedStreamClass(name, Original) {
    const what = `fs.${name}`;
    const Gated = {
      // A function expression, not a method: `new fs.ReadStream(...)` must work, as in node.
      [name]: function (path, options) { // eslint-disable-line func-names
        const checked = path === null || path === undefined ? path : checkedPath(path, what, Gated);
        return new Original(checked, checkedStreamOptions(options, what, Gated));
      },
    }[name];
    ObjectDefineProperty(Gated, 'prototype', { __proto__: null, value: Original.prototype, writable: false });
    ObjectDefineProperty(Original.prototype, 'constructor', {
      __proto__: null, value: Gated, writable: false, enumerable: false, configurable: false,
    });
    return Gated;
  }
  const GatedReadStream = gatedStreamClass('ReadStream', fs.ReadStream);
  const GatedWriteStream = gatedStreamClass('WriteStream', fs.WriteStream);

  // A FileHandle of fs.promises.open, as the program gets it: node's handle stays in `handles`, out of
  // reach (its descriptor slot is writable, and its class wraps any descriptor). The wrapper's methods
  // call the real ones; its streams are the facade's on its descriptor.
  const FileHandlePrototype = ObjectCreate(null);
  function handleOf(wrapper, what) {
    const real = wrapper !== null && typeof wrapper === 'object' ? ReflectApply(WeakMapPrototypeGet, handles, [wrapper]) : undefined;
    if (real === undefined) throw refusal(`FileHandle.${what}`, 'not a FileHandle of this program', undefined);
    return real;
  }
  const HANDLE_METHODS = ['appendFile', 'chmod', 'chown', 'datasync', 'read', 'readFile', 'readv', 'stat', 'sync',
    'truncate', 'utimes', 'write', 'writeFile', 'writev'];
  for (let i = 0; i < HANDLE_METHODS.length; i++) {
    const name = HANDLE_METHODS[i];
    FileHandlePrototype[name] = {
      [name](...args) {
        let real;
        try {
          real = handleOf(this, name);
        } catch (error) {
          return PromiseReject(error);
        }
        return ReflectApply(real[name], real, args);
      },
    }[name];
  }
  FileHandlePrototype.close = function close() {
    let real;
    try {
      real = handleOf(this, 'close');
    } catch (error) {
      return PromiseReject(error);
    }
    return ReflectApply(real.close, real, []);
  };
  // A stream on a FileHandle reads and writes through the handle itself, never through its number: a
  // handle's descriptor is not one of the program's (closed by the handle or by garbage collection, its
  // number may come back as anything the process opens next).
  function handleOperations(real) {
    const settle = (callback, field) => [
      (result) => ReflectApply(callback, undefined, [null, result[field], result.buffer]),
      (error) => ReflectApply(callback, undefined, [error]),
    ];
    return ObjectFreeze({
      __proto__: null,
      open(path, flags, mode, callback) {
        ReflectApply(nextTick, process, [callback, null, real.fd]);
      },
      read(fd, buffer, offset, length, position, callback) {
        ReflectApply(PromisePrototypeThen, ReflectApply(real.read, real, [buffer, offset, length, position]),
          settle(callback, 'bytesRead'));
      },
      write(fd, buffer, offset, length, position, callback) {
        ReflectApply(PromisePrototypeThen, ReflectApply(real.write, real, [buffer, offset, length, position]),
          settle(callback, 'bytesWritten'));
      },
      close(fd, callback) {
        ReflectApply(PromisePrototypeThen, ReflectApply(real.close, real, []),
          [() => ReflectApply(callback, undefined, [null]), (error) => ReflectApply(callback, undefined, [error])]);
      },
    });
  }
  function handleStream(Original, name) {
    return {
      [name](options) {
        const own = checkedStreamOptions(options, `FileHandle.${name}`, undefined);
        own.fd = this; // checked above only if the caller gave one: the stream is on this handle
        return new Original(null, checkedStreamOptions(own, `FileHandle.${name}`, undefined));
      },
    }[name];
  }
  FileHandlePrototype.createReadStream = handleStream(fs.ReadStream, 'createReadStream');
  FileHandlePrototype.createWriteStream = handleStream(fs.WriteStream, 'createWriteStream');
  FileHandlePrototype.readLines = function readLines(options) {
    return readlineCreateInterface({ __proto__: null, input: this.createReadStream(options), crlfDelay: Infinity });
  };
  ObjectDefineProperty(FileHandlePrototype, 'fd', {
    __proto__: null, enumerable: true, configurable: false,
    get() {
      return handleOf(this, 'fd').fd;
    },
  });
  ObjectDefineProperty(FileHandlePrototype, 'constructor', {
    __proto__: null, enumerable: false, writable: false, configurable: false,
    value: function FileHandle() {
      throw refusal('FileHandle', 'FileHandles come from fs.promises.open only', FileHandle);
    },
  });
  ObjectFreeze(FileHandlePrototype);
  function wrapHandle(real) {
    const wrapper = ObjectCreate(FileHandlePrototype);
    ReflectApply(WeakMapPrototypeSet, handles, [wrapper, real]);
    return wrapper;
  }

  const facade = ObjectCreate(null);
  const names = ObjectKeys(fs);
  for (let i = 0; i < names.length; i++) {
    const name = names[i];
    const value = fs[name];
    const sync = name.length > 4 && name.slice(-4) === 'Sync';
    const base = sync ? name.slice(0, -4) : name;
    let gated;
    if (name === 'promises') continue;
    if (KEPT.includes(name)) gated = value;
    else if (name === 'ReadStream' || name === 'FileReadStream') gated = GatedReadStream;
    else if (name === 'WriteStream' || name === 'FileWriteStream') gated = GatedWriteStream;
    else if (name === 'createReadStream') gated = function createReadStream(path, options) { return GatedReadStream(path, options); };
    else if (name === 'createWriteStream') gated = function createWriteStream(path, options) { return GatedWriteStream(path, options); };
    else if (WATCHERS.includes(name)) gated = refusedUnknown(name);
    else if (LINKS.includes(base)) gated = refusedLink(name, sync ? 'sync' : 'callback');
    else if (SHAPES[base] !== undefined && typeof value === 'function') {
      gated = sync ? gatedSync(name, value, SHAPES[base]) : gatedCallback(name, value, SHAPES[base]);
      if (typeof value.native === 'function') {
        const native = sync ? gatedSync(name, value.native, SHAPES[base]) : gatedCallback(name, value.native, SHAPES[base]);
        ObjectDefineProperty(gated, 'native', { __proto__: null, value: native, enumerable: true, writable: true, configurable: true });
      }
    } else if (typeof value === 'function') gated = refusedUnknown(name);
    else gated = value;
    ObjectDefineProperty(facade, name, { __proto__: null, value: gated, enumerable: true, writable: true, configurable: true });
  }
  const promiseFacade = ObjectCreate(null);
  const promiseNames = ObjectKeys(promises);
  for (let i = 0; i < promiseNames.length; i++) {
    const name = promiseNames[i];
    const value = promises[name];
    let gated;
    if (name === 'constants') gated = value;
    else if (LINKS.includes(name)) gated = refusedLink(name, 'promise');
    else if (WATCHERS.includes(name)) gated = refusedUnknown(`promises.${name}`);
    else if (PROMISE_SHAPES[name] !== undefined) gated = gatedPromise(name, value, PROMISE_SHAPES[name]);
    else gated = typeof value === 'function' ? refusedUnknown(`promises.${name}`) : value;
    ObjectDefineProperty(promiseFacade, name, { __proto__: null, value: gated, enumerable: true, writable: true, configurable: true });
  }
  ObjectDefineProperty(facade, 'promises', { __proto__: null, value: promiseFacade, enumerable: true, writable: true, configurable: true });
  // What every stream opens, reads, writes and closes with: the facade's functions as they are now, before
  // any user code (which may replace the facade's properties, never these).
  const streamFs = ObjectFreeze({
    __proto__: null, open: facade.open, read: facade.read, write: facade.write, close: facade.close,
  });

  // process.chdir: inside the folders only, so that relative paths stay inside too.
  function chdir(directory) {
    return ReflectApply(processChdir, process, [checkedPath(directory, 'process.chdir', chdir)]);
  }

  return ObjectFreeze({ __proto__: null, fs: facade, promises: promiseFacade, chdir, checkedPath });
}

module.exports = ObjectFreeze({ __proto__: null, createFsGate, CODE_PATH_REFUSED });
