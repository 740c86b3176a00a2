'use strict';
// metaagent egress: routes node's http, https and global fetch through the execution's tunnel socket.
//
// The container has no network (--network=none). When an execution asks for one, the service mounts a
// Unix socket into the container and the payload header names it. Each outbound connection is then one
// tunnel: connect to the socket, write "host:port\n", read "OK\n" (or "ERR <code> <message>\n"), and
// from then on the socket carries the connection's bytes. TLS runs here, end to end: the service only
// moves bytes, and certificates are verified in this process against the image's CA bundle plus the
// operator's extra CAs.
//
// The service decides every tunnel (allow-list, DNS, address policy, limits), so nothing in this file
// is a boundary: user code that bypasses or poisons it gets at most what the service allows anyway.
// It exists so that ordinary code works unchanged and refusals read clearly. Its modules are captured
// here, when the runner starts, before the module gate refuses net and tls to user code.

const net = require('net');
const tls = require('tls');
const http = require('http');
const https = require('https');
const { Buffer } = require('buffer');

const keepLoopAlive = setInterval;
const stopKeepingLoopAlive = clearInterval;

const MAX_REPLY_BYTES = 1024;
// Node 18's fetch is undici's, which reads its dispatcher from this global (undici 5's own key).
const UNDICI_DISPATCHER = Symbol.for('undici.globalDispatcher.1');
// Options that change a TLS secure context: with any of them, the context is built for the connection.
const CONTEXT_OPTIONS = [
  'ca', 'cert', 'key', 'pfx', 'passphrase', 'ciphers', 'ecdhCurve', 'dhparam', 'secureProtocol',
  'secureOptions', 'honorCipherOrder', 'minVersion', 'maxVersion', 'crl', 'sigalgs', 'sessionIdContext',
  'ticketKeys', 'sessionTimeout', 'privateKeyIdentifier', 'privateKeyEngine', 'clientCertEngine',
];

function tunnelError(code, message) {
  const error = new Error(message);
  error.code = code;
  return error;
}

function hostForLine(host) {
  const bare = host.startsWith('[') && host.endsWith(']') ? host.slice(1, -1) : host;
  return net.isIPv6(bare) ? `[${bare}]` : bare;
}

// Opens tunnels, at most `maxTunnels` at once: the service refuses more, so callers past that wait here
// for a free one instead of failing (a program that starts twenty fetches at once still works).
function tunnelOpener(socketPath, maxTunnels) {
  let open = 0;
  const waiting = [];
  // Idle keep-alive sockets (fetch's) do not hold the event loop open, so a program whose requests wait
  // for them to close would end early; this timer holds it while anything waits.
  let waitTimer = null;

  function release() {
    open--;
    const next = waiting.shift();
    if (waiting.length === 0 && waitTimer !== null) {
      stopKeepingLoopAlive(waitTimer);
      waitTimer = null;
    }
    if (next !== undefined) next();
  }

  function start(host, port, callback) {
    open++;
    let released = false;
    // Called when the raw socket or a TLS socket over it closes, whichever comes first.
    function done() {
      if (!released) {
        released = true;
        release();
      }
    }
    const socket = net.connect(socketPath);
    socket.once('close', done);
    let reply = Buffer.alloc(0);
    let settled = false;

    function settle(error) {
      if (settled) return;
      settled = true;
      socket.removeListener('readable', read);
      socket.removeListener('error', onError);
      socket.removeListener('end', onEnd);
      if (error) {
        socket.destroy();
        callback(error);
      } else {
        callback(null, socket, done);
      }
    }

    function read() {
      let chunk;
      while (!settled && (chunk = socket.read()) !== null) {
        reply = Buffer.concat([reply, chunk]);
        const newline = reply.indexOf(0x0a);
        if (newline === -1) {
          if (reply.length > MAX_REPLY_BYTES) settle(tunnelError('ERR_METAAGENT_TUNNEL', 'the egress tunnel did not answer'));
          continue;
        }
        const line = reply.subarray(0, newline).toString('utf8');
        if (line === 'OK') {
          // http and https are client-first protocols: the service sends nothing after OK until the
          // upstream does, and the upstream waits for our first bytes.
          if (reply.length > newline + 1) settle(tunnelError('ERR_METAAGENT_TUNNEL', 'the egress tunnel spoke first'));
          else settle(null);
          return;
        }
        const match = /^ERR (\S+) (.*)$/.exec(line);
        settle(match ? tunnelError(match[1], match[2]) : tunnelError('ERR_METAAGENT_TUNNEL', `the egress tunnel answered ${JSON.stringify(line.slice(0, 100))}`));
      }
    }

    function onError(error) {
      settle(tunnelError('ERR_METAAGENT_TUNNEL', `cannot reach the egress tunnel (${error.message})`));
    }

    function onEnd() {
      settle(tunnelError('ERR_METAAGENT_TUNNEL', 'the egress tunnel closed without an answer'));
    }

    socket.on('readable', read);
    socket.on('error', onError);
    socket.on('end', onEnd);
    socket.write(`${hostForLine(host)}:${port}\n`);
  }

  return function openTunnel(host, port, callback) {
    if (open < maxTunnels) return start(host, port, callback);
    waiting.push(() => start(host, port, callback));
    if (waitTimer === null) waitTimer = keepLoopAlive(() => {}, 1 << 30);
    return undefined;
  };
}

let installed = false;

function install({ socketPath, maxTunnels, extraCa }) {
  if (installed) throw new Error('egress is installed already');
  installed = true;
  const openTunnel = tunnelOpener(socketPath, maxTunnels);
  let defaultContext;

  // The secure context that trusts the image's CA bundle and the operator's extra CAs, unless the caller
  // brought its own trust (a `ca` or `secureContext` option): then the caller's choice stands, as in node.
  function secureContextFor(options) {
    if (extraCa.length === 0 || options.secureContext !== undefined || options.ca !== undefined) return undefined;
    if (CONTEXT_OPTIONS.some((name) => options[name] !== undefined)) {
      const context = tls.createSecureContext(options);
      context.context.addCACert(extraCa);
      return context;
    }
    if (defaultContext === undefined) {
      defaultContext = tls.createSecureContext();
      defaultContext.context.addCACert(extraCa);
    }
    return defaultContext;
  }

  function startTls(raw, done, options) {
    const tlsOptions = { ...options, socket: raw };
    const context = secureContextFor(options);
    if (context !== undefined) tlsOptions.secureContext = context;
    delete tlsOptions.path;
    const socket = tls.connect(tlsOptions);
    socket.once('close', done);
    return socket;
  }

  function targetOf(options, defaultPort) {
    if (options.socketPath) {
      throw tunnelError('ERR_METAAGENT_HOST_BLOCKED', 'Unix sockets are not reachable from the sandbox');
    }
    return { host: options.host || 'localhost', port: Number(options.port) || defaultPort };
  }

  // Agent#createConnection(options, oncreate): node's Agent takes the socket from oncreate when the
  // function returns nothing, which lets the tunnel answer first.
  function tunneledConnection(options, oncreate) {
    const { host, port } = targetOf(options, 80);
    openTunnel(host, port, oncreate);
  }

  function tunneledTlsConnection(options, oncreate) {
    const { host, port } = targetOf(options, 443);
    openTunnel(host, port, (error, raw, done) => {
      if (error) return oncreate(error);
      let socket;
      try {
        socket = startTls(raw, done, { ...options, host, port });
      } catch (tlsError) {
        raw.destroy();
        return oncreate(tlsError);
      }
      return oncreate(null, socket);
    });
  }

  function callbackRequired(connect) {
    return function createConnection(options, oncreate) {
      if (typeof oncreate !== 'function' || options === null || typeof options !== 'object') {
        throw tunnelError('ERR_METAAGENT_TUNNEL', 'in the sandbox, Agent#createConnection needs (options, callback)');
      }
      try {
        connect(options, oncreate);
      } catch (error) {
        process.nextTick(oncreate, error);
      }
    };
  }

  // Every Agent, the global ones and any a program makes, including those of `agent: false`.
  http.Agent.prototype.createConnection = callbackRequired(tunneledConnection);
  https.Agent.prototype.createConnection = callbackRequired(tunneledTlsConnection);

  // fetch: undici creates its global dispatcher when fetch first runs; a dispatcher of the same class
  // with our connector replaces it, so fetch keeps all of its behaviour and only its sockets change.
  fetch().catch(() => {});
  const dispatcher = globalThis[UNDICI_DISPATCHER];
  if (dispatcher === undefined || typeof dispatcher.constructor !== 'function') {
    throw new Error('the fetch dispatcher of this node is not where node 18 keeps it');
  }
  const Dispatcher = dispatcher.constructor;
  globalThis[UNDICI_DISPATCHER] = new Dispatcher({
    // Per origin, fetch reuses its connections rather than queue for more tunnels than there are.
    connections: maxTunnels,
    connect(options, callback) {
      const secure = options.protocol === 'https:';
      const host = hostForLine(options.hostname);
      const bare = host.startsWith('[') ? host.slice(1, -1) : host;
      const port = Number(options.port) || (secure ? 443 : 80);
      openTunnel(host, port, (error, raw, done) => {
        if (error) return callback(error);
        if (!secure) return callback(null, raw);
        let socket;
        try {
          socket = startTls(raw, done, {
            host: bare,
            servername: options.servername || (net.isIP(bare) ? undefined : bare),
            ALPNProtocols: ['http/1.1'],
          });
        } catch (tlsError) {
          raw.destroy();
          return callback(tlsError);
        }
        const onError = (tlsError) => callback(tlsError);
        socket.once('error', onError);
        socket.once('secureConnect', () => {
          socket.removeListener('error', onError);
          callback(null, socket);
        });
        return undefined;
      });
    },
  });
}

module.exports = Object.freeze({ __proto__: null, install });
