'use strict';
// metaagent import(): the dynamic-import callback of every module the gate compiles (gate.js).
//
// V8 calls it on this thread for each import() in a module's code, eval and `new Function` code
// included. It decides with bindings captured when this file loaded (before any user code existed)
// and never hands the request to node's ESM loader, so no resolve or load hook, no hooks thread and no
// message port is involved: there is no channel to forge an answer on.
//
// What import() gives: an allowed built-in, or what require() would load from the importing module
// (a CommonJS file or JSON under the allowed folders), as a module namespace: `default` is the
// exports object and its own enumerable keys are named exports, as node's CommonJS interop gives them.
// ES module files are refused: node's loader would link their static imports outside the gate.
// URLs: node: (allowed built-ins) and file: (allowed folders); data:, http: and every other scheme are
// refused. The same specifier from the same module gives the same namespace.

const vm = require('vm');
const { fileURLToPath } = require('url');
const policy = require('./policy.js');

const ReflectApply = Reflect.apply;
const ObjectKeys = Object.keys;
const ObjectDefineProperty = Object.defineProperty;
const ObjectFreeze = Object.freeze;
const SafeMap = Map;
const MapPrototypeGet = Map.prototype.get;
const MapPrototypeSet = Map.prototype.set;
const StringPrototypeCharCodeAt = String.prototype.charCodeAt;
const StringPrototypeSlice = String.prototype.slice;
const StringPrototypeToLowerCase = String.prototype.toLowerCase;
const StringPrototypeIndexOf = String.prototype.indexOf;
const StringPrototypeEndsWith = String.prototype.endsWith;
const SyntheticModule = vm.SyntheticModule;
const SyntheticModulePrototype = SyntheticModule.prototype;
const moduleLink = SyntheticModulePrototype.link;
const moduleEvaluate = SyntheticModulePrototype.evaluate;
const moduleSetExport = SyntheticModulePrototype.setExport;
const moduleNamespace = Object.getOwnPropertyDescriptor(Object.getPrototypeOf(SyntheticModulePrototype), 'namespace').get;

const {
  refusedBuiltin, isAllowedPath, builtinBlockedError, pathBlockedError, urlBlockedError, blockedModuleError,
} = policy;

const CODE_NOT_FOUND = 'ERR_MODULE_NOT_FOUND';

// The one "VM Modules is an experimental feature" warning node emits, swallowed now, before user code
// exists, so that no program ever sees it.
{
  const emitWarning = process.emitWarning;
  process.emitWarning = function ignoreWarning() {};
  try {
    new SyntheticModule([], function evaluate() {}); // eslint-disable-line no-new
  } finally {
    process.emitWarning = emitWarning;
  }
}

function linkNothing() {
  throw new Error('a synthetic module has no imports');
}

// The scheme of a URL specifier ("node", "file", "data"...), lower-cased, or undefined for a path or a
// bare name. Read character by character: no regular expression that user code could have poisoned.
function schemeOf(specifier) {
  for (let i = 0; i < specifier.length; i++) {
    const c = ReflectApply(StringPrototypeCharCodeAt, specifier, [i]);
    const letter = (c >= 0x41 && c <= 0x5a) || (c >= 0x61 && c <= 0x7a);
    if (c === 0x3a) return i === 0 ? undefined : ReflectApply(StringPrototypeToLowerCase, ReflectApply(StringPrototypeSlice, specifier, [0, i]), []);
    if (!(letter || (i > 0 && ((c >= 0x30 && c <= 0x39) || c === 0x2b || c === 0x2d || c === 0x2e)))) return undefined;
  }
  return undefined;
}

function notFound(specifier, referrerName) {
  const error = new Error(`Cannot find module '${specifier}' imported from ${referrerName}`);
  ObjectDefineProperty(error, 'code', {
    __proto__: null, value: CODE_NOT_FOUND, enumerable: true, writable: true, configurable: true,
  });
  return error;
}

function errorCode(error) {
  if (error === null || typeof error !== 'object') return undefined;
  const descriptor = Object.getOwnPropertyDescriptor(error, 'code');
  return descriptor !== undefined ? descriptor.value : undefined;
}

// A namespace whose `default` is `exports` and whose named exports are its own enumerable keys.
async function namespaceOf(exports, identifier) {
  const names = ['default'];
  const keys = exports !== null && (typeof exports === 'object' || typeof exports === 'function') ? ObjectKeys(exports) : [];
  for (let i = 0; i < keys.length; i++) {
    if (keys[i] !== 'default') {
      ObjectDefineProperty(names, names.length, { __proto__: null, value: keys[i], writable: true, enumerable: true, configurable: true });
    }
  }
  const module = new SyntheticModule(names, function evaluate() {
    ReflectApply(moduleSetExport, module, ['default', exports]);
    for (let i = 1; i < names.length; i++) ReflectApply(moduleSetExport, module, [names[i], exports[names[i]]]);
  }, { __proto__: null, identifier });
  await ReflectApply(moduleLink, module, [linkNothing]);
  await ReflectApply(moduleEvaluate, module, []);
  return ReflectApply(moduleNamespace, module, []);
}

// Returns importerFor(module): the dynamic-import callback of the code of one CommonJS module.
// `load` and `resolve` are the gate's Module._load and Module._resolveFilename.
function importerFactory(load, resolve) {
  const namespaces = new SafeMap(); // key -> Promise of a namespace

  function cached(key, exportsOf) {
    let namespace = ReflectApply(MapPrototypeGet, namespaces, [key]);
    if (namespace === undefined) {
      namespace = namespaceOf(exportsOf(), key);
      ReflectApply(MapPrototypeSet, namespaces, [key, namespace]);
    }
    return namespace;
  }

  function builtin(name) {
    return cached(`node:${name}`, () => load(`node:${name}`, null, false));
  }

  // A path or a bare name, resolved and loaded as require() from `referrer` does it.
  function file(specifier, referrer, referrerName) {
    let filename;
    try {
      filename = resolve(specifier, referrer, false);
    } catch (error) {
      if (errorCode(error) === 'MODULE_NOT_FOUND') throw notFound(specifier, referrerName);
      throw error;
    }
    if (ReflectApply(StringPrototypeIndexOf, filename, ['/']) !== 0) return builtin(filename); // a bare built-in name
    if (ReflectApply(StringPrototypeEndsWith, filename, ['.mjs'])) throw esModuleRefused(specifier);
    return cached(filename, () => {
      try {
        return load(filename, referrer, false);
      } catch (error) {
        if (errorCode(error) === 'ERR_REQUIRE_ESM') throw esModuleRefused(specifier);
        throw error;
      }
    });
  }

  function decide(specifier, referrer) {
    const referrerName = referrer !== null && typeof referrer === 'object' && typeof referrer.filename === 'string'
      ? referrer.filename : 'the sandbox';
    const refused = refusedBuiltin(specifier);
    if (refused !== undefined) throw builtinBlockedError(refused);
    const scheme = schemeOf(specifier);
    if (scheme === undefined) {
      if (specifier[0] === '/' && !isAllowedPath(specifier)) throw pathBlockedError(specifier);
      return file(specifier, referrer, referrerName);
    }
    const rest = ReflectApply(StringPrototypeSlice, specifier, [scheme.length + 1]);
    if (scheme === 'node') {
      if (ReflectApply(StringPrototypeIndexOf, rest, ['?']) !== -1 || ReflectApply(StringPrototypeIndexOf, rest, ['#']) !== -1) {
        throw urlBlockedError(specifier, 'node: with query or fragment');
      }
      const refusedName = refusedBuiltin(`node:${rest}`);
      if (refusedName !== undefined) throw builtinBlockedError(refusedName);
      return builtin(rest);
    }
    if (scheme === 'file') {
      let path;
      try {
        path = fileURLToPath(specifier);
      } catch {
        throw pathBlockedError(specifier);
      }
      if (!isAllowedPath(path)) throw pathBlockedError(specifier);
      return file(path, referrer, referrerName);
    }
    throw urlBlockedError(specifier, `${scheme}:`);
  }

  return function importerFor(referrer) {
    // V8 has turned the specifier into a string already; the second argument is the referring script.
    return function importModuleDynamically(specifier) {
      policy.requireString(specifier, 'specifier');
      return decide(specifier, referrer);
    };
  };
}

function esModuleRefused(specifier) {
  return blockedModuleError(
    `Module "${specifier}" is an ES module, which the sandbox cannot load: import() and require() load CommonJS modules and built-ins only`,
  );
}

module.exports = ObjectFreeze({ __proto__: null, importerFactory });
