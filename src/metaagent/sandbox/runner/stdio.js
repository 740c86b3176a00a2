'use strict';
// metaagent stdio: the sandboxed program's process.stdin, process.stdout and process.stderr, and the
// runner's own reads and writes of the container's file descriptors 0, 1 and 2.
//
// The program's streams are plain stream objects. Writes go to the descriptor at once, synchronously,
// and block while the pipe to the service is full, so a program that prints faster than the service
// reads waits instead of piling its output up in its own memory. No node stdio stream is ever created
// for these descriptors: no object holds their handles, and no constructor of theirs (an fs stream, a
// net socket) is reachable from the program's streams. fs is captured here, before the gate refuses it
// to user code, and this file leaves the module cache once loaded.

const fs = require('fs');
const { Readable, Writable } = require('stream');
const { Buffer } = require('buffer');

const ReflectApply = Reflect.apply;
const ObjectDefineProperty = Object.defineProperty;
const ObjectGetOwnPropertyDescriptor = Object.getOwnPropertyDescriptor;
const ObjectFreeze = Object.freeze;
const AtomicsWait = Atomics.wait;
const fsWriteSync = fs.writeSync;
const fsReadSync = fs.readSync;
const BufferAlloc = Buffer.alloc;
const BufferFrom = Buffer.from;

const STDIN = 0;
const STDOUT = 1;
const STDERR = 2;
const sleepCell = new Int32Array(new SharedArrayBuffer(4));

function errorCode(error) {
  const descriptor = error !== null && typeof error === 'object' ? ObjectGetOwnPropertyDescriptor(error, 'code') : undefined;
  return descriptor !== undefined ? descriptor.value : undefined;
}

// A descriptor may be non-blocking (its other end decides): then wait a moment and try again.
function pause() {
  ReflectApply(AtomicsWait, Atomics, [sleepCell, 0, 0, 2]);
}

// Writes all of `data` (a Buffer) to `fd`, blocking until the reader has taken it.
function writeAll(fd, data) {
  let offset = 0;
  while (offset < data.length) {
    try {
      offset += fsWriteSync(fd, data, offset, data.length - offset);
    } catch (error) {
      if (errorCode(error) !== 'EAGAIN') throw error;
      pause();
    }
  }
}

function writeStderr(text) {
  writeAll(STDERR, BufferFrom(text, 'utf8'));
}

// Reads up to `buffer.length` bytes from stdin, blocking; 0 at the end of the stream.
function readStdin(buffer) {
  for (;;) {
    try {
      return fsReadSync(STDIN, buffer, 0, buffer.length, null);
    } catch (error) {
      if (errorCode(error) !== 'EAGAIN') throw error;
      pause();
    }
  }
}

function setOwn(object, key, value) {
  ObjectDefineProperty(object, key, { __proto__: null, value, writable: true, enumerable: true, configurable: true });
}

function lockOn(object, key, value) {
  ObjectDefineProperty(object, key, { __proto__: null, value, writable: false, enumerable: true, configurable: false });
}

function outputStream(fd) {
  const stream = new Writable({
    __proto__: null,
    decodeStrings: true,
    write(chunk, _encoding, callback) {
      try {
        writeAll(fd, chunk);
      } catch (error) {
        callback(error);
        return;
      }
      callback();
    },
  });
  setOwn(stream, 'fd', fd);
  return stream;
}

// A plain Readable holding exactly `input` (a Buffer), then EOF.
function inputStream(input) {
  return new Readable({
    __proto__: null,
    read() {
      if (input.length > 0) this.push(input);
      this.push(null);
    },
  });
}

// The program's process.stdin (its `input` bytes), process.stdout and process.stderr, locked.
function install(input) {
  lockOn(process, 'stdin', inputStream(input));
  lockOn(process, 'stdout', outputStream(STDOUT));
  lockOn(process, 'stderr', outputStream(STDERR));
}

module.exports = ObjectFreeze({
  __proto__: null, writeAll, writeStderr, readStdin, install, STDOUT, STDERR, BufferAlloc,
});
