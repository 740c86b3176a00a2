'use strict';
// A language's program as a child of this runner: how a container runs a language other than
// JavaScript (`--program <command...>` after runner.js, languages/python/image.py). The child starts
// with the container, before any payload, so a warm container holds a program that has loaded its
// libraries; this process tells the service it is ready only once the child is. Then, by the header:
// - one-shot: the child gets the one-shot header, the code and the stdin, and its stdout and stderr are
//   relayed to the container's as they come; this process leaves with the child's exit code;
// - session: this process is the session's supervisor (supervisor.js) with the child as its program.
// The child holds pipes to this process and nothing else, as a JavaScript session's program does.

const childProcess = require('child_process');
const fs = require('fs');
const { Buffer } = require('buffer');

const READY = Buffer.from('metaagent-runner: ready\n'); // what every runner writes first on stderr
const CHUNK = 64 * 1024;
const EXIT_BAD_PAYLOAD = 70;
const signals = require('os').constants.signals;
const ENDED_MAX = 'ended 255\n';

// The descriptor under a pipe's stream, for a read or a write that must not wait: null while it has none
// (not open yet, or closed).
function descriptorOf(stream) {
  const fd = stream._handle && stream._handle.fd;
  return typeof fd === 'number' && fd >= 0 ? fd : null;
}

// Reads what a pipe holds now, without waiting (the bytes a program left when it exited, or wrote before
// its answer). One buffer serves every drain, and what is read is copied out of it: a session drains two
// pipes at every call's answer, and two fresh 64 KiB buffers per call were garbage for node's collector.
const drained = Buffer.alloc(CHUNK);
function drainNow(stream, onBytes) {
  const fd = descriptorOf(stream);
  if (fd === null) return;
  for (;;) {
    let size;
    try {
      size = fs.readSync(fd, drained, 0, CHUNK, null);
    } catch {
      return; // EAGAIN: empty for now
    }
    if (size === 0) return;
    onBytes(Buffer.from(drained.subarray(0, size)));
  }
}

const exitCodeOf = (code, signal) => (code !== null ? code : 128 + (signals[signal] || 9));

// Starts `command` with four pipes and calls onReady(program) once its stderr began with the ready
// line; a program that says anything else first, or exits, has failed to start: what it said goes to
// this process's stderr, and this process leaves (the service reports the failed start).
function startProgram(command, { stdio, onReady }) {
  const program = childProcess.spawn(command[0], command.slice(1), {
    stdio: ['pipe', 'pipe', 'pipe', 'pipe'],
    cwd: '/tmp', // the container's working directory; a session's program moves to /workspace itself
    env: process.env,
  });
  program.stdin.on('error', () => {}); // EPIPE once the program is gone: its exit is told below
  let said = Buffer.alloc(0);
  const failed = (reason) => {
    stdio.writeStderr(`metaagent-runner: the program did not start (${reason})\n`);
    if (said.length > 0) stdio.writeAll(stdio.STDERR, said);
    process.exit(EXIT_BAD_PAYLOAD);
  };
  const beforeReady = (bytes) => {
    said = Buffer.concat([said, bytes]);
    const seen = said.subarray(0, READY.length);
    if (!READY.subarray(0, seen.length).equals(seen)) return failed('it wrote something else first');
    if (said.length < READY.length) return undefined;
    program.stderr.removeListener('data', beforeReady);
    program.removeListener('exit', exitedEarly);
    // A waiting program writes nothing more until it is given its header.
    if (said.length > READY.length) return failed('it wrote past its ready line');
    return onReady(program);
  };
  const exitedEarly = (code, signal) => failed(`it exited with ${exitCodeOf(code, signal)}`);
  program.stderr.on('data', beforeReady);
  program.on('exit', exitedEarly);
  program.on('error', (error) => failed(error.message));
}

// One-shot: hands the program its payload and relays its output until it exits, then leaves with its
// code. With `endToken` it first tells the program's end on both streams, as their last bytes
// ("\0metaagent-end <token> <code>\n"): each stream keeps its order on the way to the service, so the
// service has all of the output once it has both, and answers without waiting for the container's own
// end (this process, init and the sandbox going, the engine told), which it removes after. The program
// never sees the token.
//
// A program that has flushed its output may say `ended <status>` on fd 3, as the last bytes it writes
// there, and stop itself (the Python runner's leave()): this process then relays what is left, tells
// the end, and only then kills it, so that neither the answer nor its relay waits for the kernel to
// take the program's address space apart. What it says is only as good as the program (it chooses its
// exit status anyway), and what it wrote on fd 3 before does not matter: only the end of it is read.
// A program that never says it exits, and that exit is waited for.
function relayOnce(program, { stdio, header, endToken = null }) {
  let ended = false;
  const end = (exitCode) => {
    if (ended) return;
    ended = true;
    drainNow(program.stdout, (bytes) => stdio.writeAll(stdio.STDOUT, bytes));
    drainNow(program.stderr, (bytes) => stdio.writeAll(stdio.STDERR, bytes));
    if (endToken !== null) {
      const told = Buffer.from(`\0metaagent-end ${endToken} ${exitCode}\n`);
      stdio.writeAll(stdio.STDOUT, told);
      stdio.writeAll(stdio.STDERR, told);
    }
    program.kill('SIGKILL'); // nothing of it runs on (a no-op once it has exited)
    process.exit(exitCode);
  };
  program.stdout.on('data', (bytes) => stdio.writeAll(stdio.STDOUT, bytes));
  program.stderr.on('data', (bytes) => stdio.writeAll(stdio.STDERR, bytes));
  program.on('exit', (code, signal) => end(exitCodeOf(code, signal)));
  // Read with or without a token: a program that has said it stops, and waits for this process to end it.
  let tail = ''; // the last bytes fd 3 said: enough for the longest `ended <status>` line
  const onSaid = (bytes) => {
    tail = (tail + bytes.toString('latin1')).slice(-ENDED_MAX.length);
    const match = /ended (\d{1,3})\n$/.exec(tail);
    if (match !== null && Number(match[1]) <= 255) end(Number(match[1]));
  };
  program.stdio[3].on('error', () => {}); // a program that closed fd 3: its exit is waited for
  program.stdio[3].on('data', onSaid);
  program.stdin.end(header);
}

module.exports = Object.freeze({ __proto__: null, startProgram, relayOnce, descriptorOf, drainNow, exitCodeOf });
