'use strict';
// metaagent session supervisor: the trusted half of a session container. It owns the wire to the
// service and the workspace; the program runs in a child process (the same runner in its `program`
// role, session.js) whose stdin, stdout, stderr and fd 3 are pipes to this process and nothing else.
//
// Why a process of its own: a trusted duty that shares a realm with user code calls user code's
// versions of the built-ins it uses (a replaced String.prototype.split steers a file request out of
// /workspace), and any descriptor such a process holds is reachable through some native handle class
// (tty.WriteStream(1) writes raw frames to the service). Here no user code ever runs, and the program
// holds no descriptor of the wire: whatever it sends is data that this process frames, budgets and
// checks, never a frame, a path or a size anyone believes.
//
// The wire to the service is a Unix socket of the session's own (its path in the session's header; the
// service takes this process's connection and then unlinks it: wire_socket.py), both ways, and fd 2 for
// this process's own last words. The frames are the ones session_wire.py describes:
//   service -> supervisor                        supervisor -> service
//   x {id, code}       run code                  o <bytes>   the program's stdout (within its budget)
//   i {id}             interrupt that call       e <bytes>   the program's stderr (within its budget)
//   p {id, path}       start writing a file      r {id, ...} the answer to a request
//   d <bytes>          a piece of it             f {id, size, modified_at}  a file follows
//   z {id}             the end of it             d <bytes>   a piece of it
//   a {id}             abandon it                z {id}      the end of it
//   g {id, path}       read a file
//   l {id}             list the files        (its answer may come in pieces: every one but the last
//                                                 says more: true)
//   D {id, path}       delete a file
//
// To the program (its fd 0) go only `x` frames, each with a fresh token for its id; from it (its fd 3)
// come only `r` answers {id, status, result, result_bytes, result_incomplete, error, images, images_truncated},
// each checked here. Its stdout and stderr are raw bytes: this process frames them as they come, and of each output
// window (from one call's answer to the next's) forwards at most what the service keeps (its 50 KiB
// and 25 KiB caps) and counts the rest, which the next answer reports (`stdout_skipped`,
// `stderr_skipped`). So a program that floods its output, between calls or during one, costs the
// service at most one window's bytes per call, in frames of up to 64 KiB.
//
// An answer that breaks these rules ends the program (and so the session); nothing else can.

const fs = require('fs');
const childProcess = require('child_process');
const net = require('net');
const crypto = require('crypto');
const { Buffer } = require('buffer');
// drainNow: reads what a pipe holds now, without waiting (the bytes the program wrote before its answer).
const { descriptorOf, drainNow, exitCodeOf } = require('./program.js');

const WORKSPACE = '/workspace';
const HEADER = 5;
const MAX_INPUT_FRAME = 2 * 1024 * 1024; // a call's code (1 MiB) in JSON, with room
const MAX_PROGRAM_FRAME = 8 * 1024 * 1024; // an answer: a 64 KiB result JSON-escaped, and 4 MiB of images in base64
const MAX_IMAGES = 8; // a call's figures: at most 8, of 4 MiB of PNG in all (the service checks again)
const MAX_IMAGE_BYTES = 4 * 1024 * 1024;
const PNG_SIGNATURE = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;
const CHUNK = 64 * 1024; // output frames
// File bytes per frame, both ways (CHUNK in session_wire.py): under runsc every frame's hops are trapped
// syscalls, and 64 KiB frames held a 10 MiB upload to 35 MiB/s.
const FILE_CHUNK = 1024 * 1024;
// The bytes of an answer that may each start a JSON value (',', '[', '{'), at most: a real answer has
// a few dozen, plus what its result (64 KiB) and error (3 x 4 KiB) strings hold. JSON.parse of 8 MiB of
// `[],[],...` needs more than this process's 48 MiB heap, and V8 then aborts the supervisor (134).
const MAX_ANSWER_VALUES = 128 * 1024;
const MAX_RESULT_BYTES = 64 * 1024; // the service keeps 50 KiB of it
const MAX_ERROR_FIELD = 4096; // characters of a thrown error's name, message and stack (the service keeps 4 KiB)
const ERROR_KEYS = ['name', 'message', 'stack'];
// What the service keeps of each stream per call: STDOUT_CAP and STDERR_CAP in sandbox/execute.py.
const OUTPUT_BUDGET = { __proto__: null, o: 50 * 1024, e: 25 * 1024 };
const OUTPUT_FLUSH_MS = 20; // how long output may wait to share a frame (streaming's added latency)
// An interrupt's SIGINT is sent again at this interval until its call answers: one that reaches the
// program before the call is armed to take it (its frame not read yet, or node's breakOnSigint not yet
// entered) is spent on no call, and the call would then run on to the end of the grace period.
const INTERRUPT_RESEND_MS = 200;
const MAX_LISTED = 10000;
const LISTING_PIECE = 64 * 1024;
const MAX_DEPTH = 64;
const PART_SUFFIX = '.metaagent-part';
const EXIT_BAD_FRAME = 70;
const strictUtf8 = new TextDecoder('utf-8', { fatal: true });
const CALL_STATUSES = new Set(['ok', 'threw', 'interrupted']);
const PROGRAM_READY = Buffer.from('metaagent-runner: ready\n'); // RUNNER_READY in sandbox/execute.py
const { constants } = fs;
const { S_IFMT, S_IFDIR, S_IFREG } = constants;
const isFolder = (stat) => (stat.mode & S_IFMT) === S_IFDIR;
const isRegular = (stat) => (stat.mode & S_IFMT) === S_IFREG;
// A file's modification time in ISO 8601, held to the years 1970-9999 that every reader parses (a
// program can set any time with utimes; one past JavaScript's dates would make toISOString throw).
const LATEST_MS = Date.UTC(9999, 11, 31, 23, 59, 59, 999);
const modifiedAt = (stat) => {
  const ms = Number(stat.mtimeMs);
  return new Date(Number.isFinite(ms) ? Math.min(Math.max(ms, 0), LATEST_MS) : 0).toISOString();
};

// What a call threw, as the program describes it: {name, message, stack} of strings (stack may be null),
// each cut to MAX_ERROR_FIELD characters; anything else is dropped (the service then says only that the
// call threw).
function checkedError(error) {
  if (error === null || typeof error !== 'object' || Array.isArray(error)) return null;
  const keys = Object.keys(error);
  if (keys.length !== 3 || !ERROR_KEYS.every((key) => keys.includes(key))) return null;
  const { name, message, stack } = error;
  if (typeof name !== 'string' || typeof message !== 'string' || (stack !== null && typeof stack !== 'string')) return null;
  const cut = (text) => (text.length <= MAX_ERROR_FIELD ? text : text.slice(0, MAX_ERROR_FIELD));
  return { name: cut(name), message: cut(message), stack: stack === null ? null : cut(stack) };
}

// A call's token: 16 bytes cut from random bytes drawn 4 KiB at a time. Each draw from OpenSSL costs a
// getpid() (its check for a fork), a trapped system call under gVisor; a call needs only 16 bytes.
const TOKEN_BYTES = 16;
let randomBytesLeft = Buffer.alloc(0);
function newToken() {
  if (randomBytesLeft.length < TOKEN_BYTES) randomBytesLeft = crypto.randomBytes(4096);
  const token = randomBytesLeft.subarray(0, TOKEN_BYTES).toString('hex');
  randomBytesLeft = randomBytesLeft.subarray(TOKEN_BYTES);
  return token;
}

function frame(type, payload) {
  const header = Buffer.alloc(HEADER);
  header[0] = type.charCodeAt(0);
  header.writeUInt32BE(payload.length, 1);
  return Buffer.concat([header, payload]);
}

const jsonFrame = (type, message) => frame(type, Buffer.from(JSON.stringify(message), 'utf8'));

// The figures a call showed, as the program lists them: [{mime: 'image/png', data: <base64 of a PNG>}],
// within MAX_IMAGES and MAX_IMAGE_BYTES. {images, truncated}: what breaks the rules is left out, and
// then `truncated` says that something was.
function checkedImages(images, truncated) {
  const kept = [];
  let total = 0;
  let left = truncated === true;
  if (images === undefined) return { images: kept, truncated: left };
  if (!Array.isArray(images)) return { images: kept, truncated: true };
  for (const image of images) {
    const valid = image !== null && typeof image === 'object' && !Array.isArray(image)
      && Object.keys(image).length === 2 && image.mime === 'image/png' && typeof image.data === 'string'
      && image.data.length % 4 === 0 && BASE64.test(image.data);
    const png = valid ? Buffer.from(image.data, 'base64') : null;
    if (png === null || !png.subarray(0, PNG_SIGNATURE.length).equals(PNG_SIGNATURE)
      || kept.length >= MAX_IMAGES || total + png.length > MAX_IMAGE_BYTES) {
      left = true;
      continue;
    }
    total += png.length;
    kept.push({ mime: 'image/png', data: image.data });
  }
  return { images: kept, truncated: left };
}

// Splits a byte stream into frames: feed(bytes) calls onFrame(type, payload) for each whole one, and
// onBad(reason) once for a frame longer than `maxFrame`.
// The bytes not yet framed are kept as the pieces they came in, and a frame is joined once, when its
// last byte is here: joining at every read made a frame sent in small pieces cost quadratic CPU.
function frameReader(maxFrame, onFrame, onBad) {
  let pieces = [];
  let buffered = 0;
  return (bytes) => {
    pieces.push(bytes);
    buffered += bytes.length;
    while (buffered >= HEADER) {
      if (pieces[0].length < HEADER) pieces = [Buffer.concat(pieces, buffered)];
      const length = pieces[0].readUInt32BE(1);
      if (length > maxFrame) return onBad(`a frame of ${length} bytes`);
      if (buffered < HEADER + length) return undefined;
      const joined = pieces.length === 1 ? pieces[0] : Buffer.concat(pieces, buffered);
      const type = String.fromCharCode(joined[0]);
      const payload = Buffer.from(joined.subarray(HEADER, HEADER + length));
      const rest = joined.subarray(HEADER + length);
      pieces = rest.length === 0 ? [] : [rest];
      buffered = rest.length;
      onFrame(type, payload);
    }
    return undefined;
  };
}

// `programHeader`: the bytes that start the program (its header line, and its CA bundle); `wirePath`: the
// wire's socket; `program`: a program already started and ready (another language's, program.js), or
// none: this runner again, in its program role.
function runSupervisor({ stdio, programHeader, wirePath, program: started }) {
  const wire = net.connect(wirePath);
  const unreachable = (error) => {
    stdio.writeStderr(`metaagent-supervisor: the wire's socket cannot be reached (${error.code})\n`);
    process.exit(EXIT_BAD_FRAME);
  };
  wire.once('error', unreachable);
  wire.once('connect', () => {
    wire.removeListener('error', unreachable);
    supervise({ stdio, programHeader, wire, program: started });
  });
}

function supervise({ stdio, programHeader, wire, program: started }) {
  // Written to at once, synchronously, as fd 1 was: a frame is whole before anything else is done.
  const wireFd = descriptorOf(wire);
  const send = (type, payload) => stdio.writeAll(wireFd, frame(type, payload));
  const reply = (message) => stdio.writeAll(wireFd, jsonFrame('r', message));
  const fail = (reason) => {
    stdio.writeStderr(`metaagent-supervisor: ${reason}\n`);
    process.exit(EXIT_BAD_FRAME);
  };

  // Signals the program can send here (same uid), or that reach the whole process group through
  // dumb-init: SIGINT is the program's to take, not this process's; SIGUSR1 would start node's inspector
  // on 127.0.0.1:9229, which the program could reach (a listener replaces node's handler, as in gate.js).
  process.on('SIGINT', () => {});
  process.on('SIGUSR1', () => {});

  const program = started || childProcess.spawn(process.execPath, [...process.execArgv, process.argv[1]], {
    stdio: ['pipe', 'pipe', 'pipe', 'pipe'],
    cwd: WORKSPACE,
    env: process.env,
  });
  const [toProgram, programStdout, programStderr, programAnswers] = program.stdio;
  toProgram.on('error', () => {}); // EPIPE once the program is gone: its exit is told below
  toProgram.write(programHeader);

  // --- the program's output: framed here, within each window's budget ---

  let window = { __proto__: null, o: 0, e: 0 };
  let skipped = { __proto__: null, o: 0, e: 0 };
  let preamble = Buffer.alloc(0); // the program's stderr until its ready line has been taken off
  let programReady = started !== undefined; // a started program's ready line has been taken off

  // What is kept is sent in frames of whatever came within OUTPUT_FLUSH_MS (or CHUNK bytes), not one
  // frame per write: a program that writes a byte at a time costs the service no more frames than one
  // that writes them at once.
  const held = { __proto__: null, o: [], e: [] };
  const heldBytes = { __proto__: null, o: 0, e: 0 };
  let flushTimer = null;

  function flush() {
    if (flushTimer !== null) {
      clearTimeout(flushTimer);
      flushTimer = null;
    }
    for (const type of ['o', 'e']) {
      if (heldBytes[type] === 0) continue;
      const bytes = Buffer.concat(held[type]);
      held[type] = [];
      heldBytes[type] = 0;
      for (let offset = 0; offset < bytes.length; offset += CHUNK) send(type, bytes.subarray(offset, offset + CHUNK));
    }
  }

  function output(type, bytes) {
    const room = OUTPUT_BUDGET[type] - window[type];
    const kept = bytes.length <= room ? bytes : bytes.subarray(0, room);
    if (kept.length > 0) {
      window[type] += kept.length;
      held[type].push(kept);
      heldBytes[type] += kept.length;
      if (heldBytes[type] >= CHUNK) flush();
      else if (flushTimer === null) flushTimer = setTimeout(flush, OUTPUT_FLUSH_MS);
    }
    skipped[type] += bytes.length - kept.length;
  }

  function stderrBytes(bytes) {
    if (programReady) return output('e', bytes);
    preamble = Buffer.concat([preamble, bytes]);
    const seen = preamble.subarray(0, PROGRAM_READY.length);
    if (!PROGRAM_READY.subarray(0, seen.length).equals(seen)) {
      programReady = true; // it failed before it was ready: what it said is the reason, shown as output
      return output('e', preamble);
    }
    if (preamble.length < PROGRAM_READY.length) return undefined;
    programReady = true;
    const rest = preamble.subarray(PROGRAM_READY.length);
    return rest.length > 0 ? output('e', rest) : undefined;
  }

  programStdout.on('data', (bytes) => output('o', bytes));
  programStderr.on('data', stderrBytes);

  // --- calls: code to the program, its checked answer to the service ---

  // The call that runs: the service's id, and the token the program knows it by. The token is new and
  // unguessable for each call, so a program that writes to its answer pipe cannot answer a call it has
  // not been given (one that would not run): only the running call's own code knows its token, and
  // only by reading the frame that brought it.
  let current = null;
  let ready = false;
  let startRequests = null; // set below: hands the requests that came early to their handler

  function answer(payload) {
    let values = 0;
    for (let i = 0; i < payload.length; i++) {
      const byte = payload[i];
      if (byte === 0x2c || byte === 0x5b || byte === 0x7b) values += 1;
    }
    if (values > MAX_ANSWER_VALUES) return badAnswer('an answer of too many values');
    let message;
    try {
      message = JSON.parse(payload.toString('utf8'));
    } catch {
      return badAnswer('not JSON');
    }
    if (message === null || typeof message !== 'object') return badAnswer('not an object');
    if (!ready) {
      if (message.id !== 0 || message.status !== 'ready') return badAnswer('an answer before it was ready');
      ready = true;
      reply({ id: 0, status: 'ready' });
      return startRequests();
    }
    if (current === null || message.id !== current.token) return badAnswer('an answer to no call');
    if (!CALL_STATUSES.has(message.status)) return badAnswer('an unknown status');
    const checked = { id: current.id, status: message.status };
    if (typeof message.result === 'string') {
      const bytes = Buffer.from(message.result, 'utf8');
      checked.result = bytes.length <= MAX_RESULT_BYTES ? message.result : bytes.subarray(0, MAX_RESULT_BYTES).toString('utf8');
      const claimed = message.result_bytes;
      checked.result_bytes = Number.isSafeInteger(claimed) && claimed >= bytes.length ? claimed : bytes.length;
      if (message.result_incomplete === true) checked.result_incomplete = true;
    }
    if (message.status === 'threw') {
      const error = checkedError(message.error);
      if (error !== null) checked.error = error;
    }
    if (message.images !== undefined || message.images_truncated !== undefined) {
      const figures = checkedImages(message.images, message.images_truncated);
      checked.images = figures.images;
      checked.images_truncated = figures.truncated;
    }
    // Whatever the program wrote before it answered belongs to this call: take it off the pipes first.
    drainNow(programStdout, (bytes) => output('o', bytes));
    drainNow(programStderr, stderrBytes);
    flush();
    checked.stdout_skipped = skipped.o;
    checked.stderr_skipped = skipped.e;
    window = { __proto__: null, o: 0, e: 0 };
    skipped = { __proto__: null, o: 0, e: 0 };
    clearInterval(current.interrupting);
    current = null;
    return reply(checked);
  }

  function badAnswer(reason) {
    stdio.writeStderr(`metaagent-supervisor: the program broke its protocol (${reason}); ending it\n`);
    program.kill('SIGKILL');
  }

  programAnswers.on('data', frameReader(MAX_PROGRAM_FRAME, (type, payload) => {
    if (type !== 'r') return badAnswer(`a frame of type ${JSON.stringify(type)}`);
    return answer(payload);
  }, badAnswer));

  // The program's end is the session's: this process leaves with its code, once the output it left in
  // the pipes is read. (Not at 'close', which waits for every pipe's other end to be seen closed.)
  program.on('exit', (code, signal) => {
    drainNow(programStdout, (bytes) => output('o', bytes));
    drainNow(programStderr, stderrBytes);
    flush();
    process.exit(exitCodeOf(code, signal));
  });

  function execute(id, code) {
    if (current !== null) return fail('a call while another runs');
    if (typeof code !== 'string') return fail('a call without code');
    current = { id, token: newToken(), interrupting: null };
    toProgramNow(jsonFrame('x', { id: current.token, code }));
    return undefined;
  }

  // A call's frame goes into the program's pipe at once when the pipe takes it, as it nearly always does
  // (the program is waiting for it, and nothing is queued before it); what the pipe does not take now is
  // queued on the stream, which writes it as the program reads. The stream alone would cost every call
  // one more poll of the event loop, for its write's completion: a trapped system call under gVisor.
  function toProgramNow(bytes) {
    const fd = descriptorOf(toProgram);
    let offset = 0;
    if (fd !== null && toProgram.writableLength === 0) {
      try {
        while (offset < bytes.length) offset += fs.writeSync(fd, bytes, offset, bytes.length - offset);
      } catch {
        // EAGAIN: the pipe is full for now. (EPIPE: the program is gone, and its exit is told below.)
      }
    }
    if (offset < bytes.length) toProgram.write(bytes.subarray(offset));
  }

  function interrupt(id) {
    if (current === null || current.id !== id || current.interrupting !== null) return;
    program.kill('SIGINT');
    current.interrupting = setInterval(() => program.kill('SIGINT'), INTERRUPT_RESEND_MS);
  }

  // --- file requests: this process's own fs, each component checked with lstat ---

  let upload = null; // {id, fd, part, target, size, failure}

  function fileError(id, kind, message) {
    reply({ id, status: 'error', error: kind, message });
  }

  // The components of a workspace path, or null when the path breaks the rules (the service checked
  // them already; this is depth).
  function components(path) {
    if (typeof path !== 'string' || path.length === 0 || Buffer.byteLength(path) > 1024) return null;
    const parts = path.split('/');
    for (const part of parts) {
      if (part === '' || part === '.' || part === '..' || Buffer.byteLength(part) > 255) return null;
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
      // O_NONBLOCK: a FIFO would otherwise block the open.
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
      send('f', Buffer.from(JSON.stringify({ id, size: stat.size, modified_at: modifiedAt(stat) }), 'utf8'));
      const buffer = Buffer.alloc(FILE_CHUNK);
      let left = stat.size;
      while (left > 0) {
        const size = fs.readSync(fd, buffer, 0, Math.min(FILE_CHUNK, left), null);
        if (size === 0) break;
        send('d', buffer.subarray(0, size));
        left -= size;
      }
      send('z', Buffer.from(JSON.stringify({ id, sent: stat.size - left }), 'utf8'));
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
        names = fs.readdirSync(folder, { encoding: 'buffer' });
      } catch {
        return;
      }
      for (const raw of names) {
        if (found.length >= MAX_LISTED) {
          truncated = true;
          return;
        }
        // A name that the path rules refuse (not UTF-8, a control character) could not be asked for:
        // it is left out, as are the parts of uploads under way.
        let name;
        try {
          name = strictUtf8.decode(raw);
        } catch {
          continue;
        }
        if (name.endsWith(PART_SUFFIX) || components(name) === null) continue;
        const path = `${folder}/${name}`;
        let stat;
        try {
          stat = fs.lstatSync(path);
        } catch {
          continue;
        }
        const shown = relative === '' ? name : `${relative}/${name}`;
        if (Buffer.byteLength(shown) > 1024) continue;
        if (isFolder(stat) && depth < MAX_DEPTH) visit(path, shown, depth + 1);
        else if (isRegular(stat)) found.push({ path: shown, size: stat.size, modified_at: modifiedAt(stat) });
      }
    };
    visit(WORKSPACE, '', 0);
    // In pieces of about LISTING_PIECE bytes of JSON, each `more: true` but the last, so that the service
    // parses a long listing a piece at a time between its other work rather than in one go.
    let piece = [];
    let pieceBytes = 0;
    for (const entry of found) {
      const size = Buffer.byteLength(entry.path) + 64;
      if (piece.length > 0 && pieceBytes + size > LISTING_PIECE) {
        reply({ id, status: 'ok', files: piece, more: true });
        piece = [];
        pieceBytes = 0;
      }
      piece.push(entry);
      pieceBytes += size;
    }
    reply({ id, status: 'ok', files: piece, truncated });
  }

  // --- the service's requests ---

  function handle(type, payload) {
    if (type === 'd') return uploadData(payload);
    let request;
    try {
      request = JSON.parse(payload.toString('utf8'));
    } catch {
      return fail('bad request: not JSON');
    }
    if (request === null || typeof request !== 'object' || !Number.isSafeInteger(request.id)) {
      return fail('bad request: no integer id');
    }
    const { id } = request;
    if (type === 'x') return execute(id, request.code);
    if (type === 'i') return interrupt(id);
    if (type === 'p') return startUpload(id, request.path);
    if (type === 'z') return endUpload(id);
    if (type === 'a') return dropUpload();
    if (type === 'g') return download(id, request.path);
    if (type === 'l') return list(id);
    if (type === 'D') return remove(id, request.path);
    return fail(`bad request: unknown type ${JSON.stringify(type)}`);
  }

  const consume = frameReader(MAX_INPUT_FRAME, handle, (reason) => fail(`bad request: ${reason}`));
  // Requests wait until the program is ready (the service sends none before this process says so, but
  // one that came early keeps its place).
  let early = Buffer.alloc(0);
  startRequests = () => {
    const waiting = early;
    early = null;
    if (waiting.length > 0) consume(waiting);
  };
  wire.on('data', (bytes) => {
    if (early !== null) early = Buffer.concat([early, bytes]);
    else consume(bytes);
  });
  wire.on('end', () => program.kill('SIGKILL')); // the service closed the wire: the session is over
  wire.on('error', () => program.kill('SIGKILL'));
}

module.exports = Object.freeze({ __proto__: null, runSupervisor });
