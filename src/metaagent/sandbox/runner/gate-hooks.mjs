// metaagent ESM hooks: the module gate for import(), registered by gate.js with module.register.
//
// They run on node's hooks thread, in a realm user code cannot reach (so its prototype poisoning does
// not apply here), and see every ESM request: import() from CommonJS, eval and new Function code,
// and the imports of any module those load. Errors thrown here reach the importing code with their
// message and code intact.
//
// A specifier is decided twice: as written (built-in names, absolute paths), and once resolved, because
// resolution may turn it into something else ("NODE:fs" resolves to node:fs, a relative specifier of a
// file: module to any file). Only allowed built-ins (node:) and files under the allowed folders (file:)
// pass; data:, http:, blob: and every other scheme are refused.

import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const require = createRequire(import.meta.url);
const { refusedBuiltin, isAllowedPath, builtinBlockedError, pathBlockedError, urlBlockedError } =
  require('./policy.js');

function checkSpecifier(specifier) {
  const refused = refusedBuiltin(specifier);
  if (refused !== undefined) throw builtinBlockedError(refused);
  if (specifier.startsWith('/') && !isAllowedPath(specifier)) throw pathBlockedError(specifier);
}

function checkURL(url, specifier) {
  let parsed;
  try {
    parsed = new URL(url);
  } catch {
    throw urlBlockedError(specifier, 'unparsable');
  }
  if (parsed.protocol === 'node:') {
    const refused = refusedBuiltin(`node:${parsed.pathname}`);
    if (refused !== undefined) throw builtinBlockedError(refused);
    if (parsed.search !== '' || parsed.hash !== '') throw urlBlockedError(specifier, 'node: with query or fragment');
    return;
  }
  if (parsed.protocol === 'file:') {
    let path;
    try {
      path = fileURLToPath(parsed);
    } catch {
      throw pathBlockedError(specifier);
    }
    if (!isAllowedPath(path)) throw pathBlockedError(specifier);
    return;
  }
  throw urlBlockedError(specifier, parsed.protocol);
}

export async function resolve(specifier, context, nextResolve) {
  checkSpecifier(specifier);
  const result = await nextResolve(specifier, context);
  checkURL(result.url, specifier);
  return result;
}

export async function load(url, context, nextLoad) {
  checkURL(url, url);
  return nextLoad(url, context);
}
