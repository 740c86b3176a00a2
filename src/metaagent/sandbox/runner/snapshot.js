'use strict';
// metaagent runner start-up snapshot: built into the image (image.py runs `node --build-snapshot` on this
// file, once per heap size), never run in a sandbox.
//
// Debian's node is built without node's own start-up snapshot and code cache, so every start compiles
// node's bootstrap and each built-in module from source: most of a runner's CPU before user code. A V8
// startup snapshot holds that work done: node's bootstrap and the built-ins below, as heap state.
//
// What it does not hold is the runner: node 18 cannot snapshot the `module` built-in the gate patches, nor
// net, tls and http, which it captures. So the runner, the gate included, still loads from its files after
// the snapshot is deserialized, the same code in the same order as without one, before any payload byte
// is read; only the built-ins it requires come from the snapshot's module cache instead of being compiled.
// Nothing user-controlled exists when the snapshot is built (a build-time chroot of the image's root fs,
// no payload), and V8 re-seeds Math.random and node refreshes the process object (argv, env, pid, clocks)
// when it starts from it.

// Built-ins node can snapshot that the runner requires, compiled and evaluated here once for every start;
// those node warns it cannot snapshot yet (vm, async_hooks, readline, net, tls...) load with the runner.
// 'module' is only required (node warns once, here at build time, that it cannot snapshot it, and no more
// when the runner loads it): the CommonJS loader it exports is part of node's bootstrap anyway.
const PRELOADED = [
  'module', 'fs', 'path', 'url', 'buffer', 'events', 'stream', 'string_decoder', 'util', 'crypto',
];
for (const name of PRELOADED) require(name);

const RUNNER_PATH = '/opt/metaagent/runner.js'; // the same path as RUNNER_PATH in image.py

require('v8').startupSnapshot.setDeserializeMainFunction(() => {
  // As `node runner.js` loads it: the runner is the main module until it hands that role to the user's.
  require('module')._load(RUNNER_PATH, null, true);
});
