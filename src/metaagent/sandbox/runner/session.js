'use strict';
// metaagent session runner: one long-lived program context and its workspace, driven by requests on
// stdin, behind the same module gate as a one-shot run.
//
// Frames, both ways: one type byte, a 32-bit big-endian length, then that many bytes.
//
//   service -> runner (stdin)                    runner -> service (stdout)
//   x {id, code}       run code                  o <bytes>   the program's stdout
//   p {id, path}       start writing a file      e <bytes>   the program's stderr
//   d <bytes>          a piece of it             r {id, ...} the answer to a request
//   z {id}             the end of it             f {id, size, modified_at}  a file follows
//   a {id}             abandon it                d <bytes>   a piece of it
//   g {id, path}       read a file               z {id}      the end of it
//   l {id}             list the files
//   D {id, path}       delete a file
//
// An interrupt is SIGINT: it stops the call that runs (a synchronous loop included, through vm's
// breakOnSigint, or an await that has not settled) and the session lives on, as after Ctrl-C in the
// Node.js REPL.
//
// The program shares this process, so it can write anything to fd 1, frames included, and read fd 0.
// That can only confuse its own session: the service validates every frame and trusts no size, path or
// id in one. The file requests never go through the program's fs: they use the fs captured here, check
// each path component with lstat, never follow a link and open with O_NOFOLLOW.

const fs = require('fs');
const pathModule = require('path');
const util = require('util');
const crypto = require('crypto');
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
const BufferByteLength = Buffer.byteLength;
const StringPrototypeIncludes = String.prototype.includes;
const fsRead = fs.read;
const { constants } = fs;
const { S_IFMT, S_IFDIR, S_IFREG } = constants;
// Stats' methods are on a class the program can reach (fs.Stats): the mode bits are read instead.
const isFolder = (stat) => (stat.mode & S_IFMT) === S_IFDIR;
const isRegular = (stat) => (stat.mode & S_IFMT) === S_IFREG;

const WORKSPACE = '/workspace';
const ROOTS = [WORKSPACE, '/tmp'];
const SESSION_FILENAME = '/app/session.js';
const HEADER = 5;
const MAX_INPUT_FRAME = 2 * 1024 * 1024; // a call's code (1 MiB) in JSON, with room
const CHUNK = 64 * 1024;
const MAX_RESULT_BYTES = 64 * 1024; // the service keeps 50 KiB of it
const MAX_LISTED = 10000;
const MAX_DEPTH = 64;
const PART_SUFFIX = '.metaagent-part';
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
  const send = (type, payload) => stdio.writeAll(stdio.STDOUT, frame(type, payload));
  const reply = (message) => send('r', BufferFrom(JSONStringify(message), 'utf8'));
  const framedWrite = (fd, bytes) => send(fd === stdio.STDERR ? 'e' : 'o', bytes);

  // The workspace is the cwd (with WorkingDir, the cwd would be the folder below the tmpfs).
  ReflectApply(processChdir, process, [WORKSPACE]);
  const files = createFsGate(ROOTS, { write: framedWrite });
  stdio.install(BufferAlloc(0), framedWrite);
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
    framedWrite(stdio.STDERR, BufferFrom(`Uncaught ${text}\n`, 'utf8'));
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

  // --- file requests: the captured fs, each component checked with lstat ---

  let upload = null; // {id, fd, part, target, size}

  function fileError(id, kind, message) {
    reply({ id, status: 'error', error: kind, message });
  }

  // The components of a workspace path, or null when the path breaks the rules (the service checked
  // them already; this is depth).
  function components(path) {
    if (typeof path !== 'string' || path.length === 0 || BufferByteLength(path) > 1024) return null;
    const parts = path.split('/');
    for (const part of parts) {
      if (part === '' || part === '.' || part === '..' || BufferByteLength(part) > 255) return null;
      for (let i = 0; i < part.length; i++) {
        const c = part.charCodeAt(i);
        if (c < 0x20 || (c >= 0x7f && c <= 0x9f)) return null;
      }
    }
    return parts;
  }

  // Walks to the folder holding the last component; creates missing folders with `create`. Returns the
  // folder's path, or a {kind, message} failure. Never passes a symbolic link.
  function folderOf(parts, create) {
    let folder = WORKSPACE;
    for (let i = 0; i < parts.length - 1; i++) {
      folder = `${folder}/${parts[i]}`;
      let stat;
      try {
        stat = fs.lstatSync(folder);
      } catch (error) {
        if (error.code !== 'ENOENT') return { kind: 'failed', message: error.message };
        if (!create) return { kind: 'not_found', message: `${parts.slice(0, i + 1).join('/')} does not exist` };
        try {
          fs.mkdirSync(folder, { mode: 0o755 });
          continue;
        } catch (mkdirError) {
          return { kind: mkdirError.code === 'ENOSPC' ? 'full' : 'failed', message: mkdirError.message };
        }
      }
      if (!isFolder(stat)) {
        return { kind: create ? 'not_a_folder' : 'not_found', message: `${parts.slice(0, i + 1).join('/')} is not a folder` };
      }
    }
    return { folder };
  }

  function startUpload(id, path) {
    const parts = components(path);
    if (parts === null) return fileError(id, 'bad_path', 'the path breaks the rules');
    const place = folderOf(parts, true);
    if (place.kind) return fileError(id, place.kind, place.message);
    const target = `${place.folder}/${parts[parts.length - 1]}`;
    try {
      if (isFolder(fs.lstatSync(target))) return fileError(id, 'is_folder', `${path} is a folder`);
    } catch (error) {
      if (error.code !== 'ENOENT') return fileError(id, 'failed', error.message);
    }
    const part = `${place.folder}/.${crypto.randomBytes(8).toString('hex')}${PART_SUFFIX}`;
    let fd;
    try {
      fd = fs.openSync(part, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, 0o644);
    } catch (error) {
      return fileError(id, error.code === 'ENOSPC' ? 'full' : 'failed', error.message);
    }
    upload = { id, fd, part, target, size: 0, failure: null };
    return undefined;
  }

  function dropUpload() {
    if (upload === null) return;
    try { fs.closeSync(upload.fd); } catch { /* closed already */ }
    try { fs.unlinkSync(upload.part); } catch { /* gone already */ }
    upload = null;
  }

  function uploadData(bytes) {
    if (upload === null || upload.failure !== null) return;
    try {
      let offset = 0;
      while (offset < bytes.length) offset += fs.writeSync(upload.fd, bytes, offset, bytes.length - offset);
      upload.size += bytes.length;
    } catch (error) {
      upload.failure = { kind: error.code === 'ENOSPC' ? 'full' : 'failed', message: error.message };
    }
  }

  function endUpload(id) {
    if (upload === null || upload.id !== id) return undefined;
    const { failure, size } = upload;
    if (failure !== null) {
      dropUpload();
      return fileError(id, failure.kind, failure.message);
    }
    try {
      fs.closeSync(upload.fd);
      fs.renameSync(upload.part, upload.target);
    } catch (error) {
      dropUpload();
      return fileError(id, error.code === 'ENOSPC' ? 'full' : 'failed', error.message);
    }
    upload = null;
    return reply({ id, status: 'ok', size });
  }

  function openRegular(id, path) {
    const parts = components(path);
    if (parts === null) return fileError(id, 'bad_path', 'the path breaks the rules');
    const place = folderOf(parts, false);
    if (place.kind) return fileError(id, place.kind === 'not_a_folder' ? 'not_found' : place.kind, place.message);
    const target = `${place.folder}/${parts[parts.length - 1]}`;
    let fd;
    try {
      // O_NONBLOCK: a FIFO made by the program would otherwise block the open.
      fd = fs.openSync(target, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
    } catch (error) {
      return fileError(id, 'not_found', `${path} is not a file (${error.code})`);
    }
    const stat = fs.fstatSync(fd);
    if (!isRegular(stat)) {
      fs.closeSync(fd);
      return fileError(id, 'not_found', `${path} is not a regular file`);
    }
    return { fd, stat, target };
  }

  function download(id, path) {
    const opened = openRegular(id, path);
    if (opened === undefined || opened.fd === undefined) return;
    const { fd, stat } = opened;
    try {
      // Exactly the size it had when opened: a file the program grows meanwhile ends there.
      send('f', BufferFrom(JSONStringify({ id, size: stat.size, modified_at: stat.mtime.toISOString() }), 'utf8'));
      const buffer = BufferAlloc(CHUNK);
      let left = stat.size;
      while (left > 0) {
        const size = fs.readSync(fd, buffer, 0, Math.min(CHUNK, left), null);
        if (size === 0) break;
        send('d', buffer.subarray(0, size));
        left -= size;
      }
      send('z', BufferFrom(JSONStringify({ id, sent: stat.size - left }), 'utf8'));
    } finally {
      fs.closeSync(fd);
    }
  }

  function remove(id, path) {
    const opened = openRegular(id, path);
    if (opened === undefined || opened.fd === undefined) return;
    fs.closeSync(opened.fd);
    try {
      fs.unlinkSync(opened.target);
    } catch (error) {
      fileError(id, 'failed', error.message);
      return;
    }
    reply({ id, status: 'ok' });
  }

  function list(id) {
    const found = [];
    let truncated = false;
    const visit = (folder, relative, depth) => {
      let names;
      try {
        names = fs.readdirSync(folder);
      } catch {
        return;
      }
      for (const name of names) {
        if (found.length >= MAX_LISTED) {
          truncated = true;
          return;
        }
        if (name.endsWith(PART_SUFFIX)) continue;
        const path = `${folder}/${name}`;
        let stat;
        try {
          stat = fs.lstatSync(path);
        } catch {
          continue;
        }
        const shown = relative === '' ? name : `${relative}/${name}`;
        if (isFolder(stat) && depth < MAX_DEPTH) visit(path, shown, depth + 1);
        else if (isRegular(stat)) found.push({ path: shown, size: stat.size, modified_at: stat.mtime.toISOString() });
      }
    };
    visit(WORKSPACE, '', 0);
    reply({ id, status: 'ok', files: found, truncated });
  }

  // --- the request loop ---

  function handle(type, payload) {
    if (type === 'd') return uploadData(payload);
    let request;
    try {
      request = JSONParse(payload.toString('utf8'));
    } catch {
      return badFrame('a request is not JSON');
    }
    const { id } = request;
    if (type === 'x') return execute(id, request.code);
    if (type === 'p') return startUpload(id, request.path);
    if (type === 'z') return endUpload(id);
    if (type === 'a') return dropUpload();
    if (type === 'g') return download(id, request.path);
    if (type === 'l') return list(id);
    if (type === 'D') return remove(id, request.path);
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
      const type = String.fromCharCode(pending[0]);
      const length = pending.readUInt32BE(1);
      if (length > MAX_INPUT_FRAME) return badFrame(`a frame of ${length} bytes`);
      if (pending.length < HEADER + length) return undefined;
      const payload = pending.subarray(HEADER, HEADER + length);
      pending = pending.subarray(HEADER + length);
      handle(type, BufferFrom(payload));
    }
    return undefined;
  }
  // fd 0 is read on the thread pool, so the event loop stays free for the program's timers between calls.
  function readMore() {
    ReflectApply(fsRead, fs, [0, readBuffer, 0, CHUNK, null, (error, size) => {
      if (error && error.code === 'EAGAIN') return setTimeout(readMore, 5);
      if (error || size === 0) process.exit(0); // the service closed the session's stdin
      pending = BufferConcat([pending, readBuffer.subarray(0, size)]);
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
