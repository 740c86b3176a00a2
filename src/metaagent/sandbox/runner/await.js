'use strict';
// metaagent top-level await for session calls: the Node.js 18 REPL's own rewrite
// (lib/internal/repl/await.js), with Debian's acorn and acorn-walk, which the image carries in
// /usr/share/nodejs. Code with a top-level `await` is wrapped in an async arrow function whose last
// expression is returned; its top-level declarations are hoisted out of it (as `var` and `let`), so that
// they persist in the session like those of any other call. Returns null when the code has no top-level
// await (it then runs as a script, unchanged), and throws a SyntaxError the REPL would show.
//
// Loaded by the runner before any user code exists; it only parses text and builds strings.

const acorn = require('/usr/share/nodejs/acorn');
const walk = require('/usr/share/nodejs/acorn-walk');

const noop = () => {};

function isTopLevelDeclaration(state) {
  return state.ancestors[state.ancestors.length - 2] === state.body;
}

const visitorsWithoutAncestors = {
  ClassDeclaration(node, state, c) {
    if (isTopLevelDeclaration(state)) {
      state.prepend(node, `${node.id.name}=`);
      state.hoistedDeclarationStatements.push(`let ${node.id.name}; `);
    }
    walk.base.ClassDeclaration(node, state, c);
  },
  ForOfStatement(node, state, c) {
    if (node.await === true) state.containsAwait = true;
    walk.base.ForOfStatement(node, state, c);
  },
  FunctionDeclaration(node, state) {
    state.prepend(node, `this.${node.id.name} = ${node.id.name}; `);
    state.hoistedDeclarationStatements.push(`var ${node.id.name}; `);
  },
  FunctionExpression: noop,
  ArrowFunctionExpression: noop,
  MethodDefinition: noop,
  AwaitExpression(node, state, c) {
    state.containsAwait = true;
    walk.base.AwaitExpression(node, state, c);
  },
  ReturnStatement(node, state, c) {
    state.containsReturn = true;
    walk.base.ReturnStatement(node, state, c);
  },
  VariableDeclaration(node, state, c) {
    const variableKind = node.kind;
    const parentType = state.ancestors[state.ancestors.length - 2].type;
    const isIterableForDeclaration = parentType === 'ForOfStatement' || parentType === 'ForInStatement';
    if (variableKind === 'var' || isTopLevelDeclaration(state)) {
      state.replace(
        node.start,
        node.start + variableKind.length + (isIterableForDeclaration ? 1 : 0),
        variableKind === 'var' && isIterableForDeclaration ? '' : `void${node.declarations.length === 1 ? '' : ' ('}`,
      );
      if (!isIterableForDeclaration) {
        for (const decl of node.declarations) {
          state.prepend(decl, '(');
          state.append(decl, decl.init ? ')' : '=undefined)');
        }
        if (node.declarations.length !== 1) state.append(node.declarations[node.declarations.length - 1], ')');
      }
      const hoisted = { var: [], let: [] };
      const register = (pattern) => {
        if (pattern === null) return;
        switch (pattern.type) {
          case 'Identifier':
            hoisted[variableKind === 'var' ? 'var' : 'let'].push(pattern.name);
            break;
          case 'ObjectPattern':
            for (const property of pattern.properties) register(property.type === 'RestElement' ? property.argument : property.value);
            break;
          case 'ArrayPattern':
            for (const element of pattern.elements) register(element && element.type === 'RestElement' ? element.argument : element);
            break;
          case 'AssignmentPattern':
            register(pattern.left);
            break;
          default:
        }
      };
      for (const decl of node.declarations) register(decl.id);
      for (const kind of ['var', 'let']) {
        if (hoisted[kind].length > 0) state.hoistedDeclarationStatements.push(`${kind} ${hoisted[kind].join(', ')}; `);
      }
    }
    walk.base.VariableDeclaration(node, state, c);
  },
};

const visitors = {};
for (const nodeType of Object.keys(walk.base)) {
  const callback = visitorsWithoutAncestors[nodeType] || walk.base[nodeType];
  visitors[nodeType] = (node, state, c) => {
    const isNew = node !== state.ancestors[state.ancestors.length - 1];
    if (isNew) state.ancestors.push(node);
    callback(node, state, c);
    if (isNew) state.ancestors.pop();
  };
}

function processTopLevelAwait(src) {
  const wrapPrefix = '(async () => { ';
  const wrapped = `${wrapPrefix}${src} })()`;
  const wrappedArray = Array.from(wrapped);
  let root;
  try {
    root = acorn.parse(wrapped, { ecmaVersion: 'latest' });
  } catch (e) {
    // A parse error before the first await is the script's own: let the script compile report it.
    const awaitPos = src.indexOf('await');
    const errPos = e.pos - wrapPrefix.length;
    if (awaitPos > errPos) return null;
    if (errPos === awaitPos + 6 && e.message.includes('Expecting Unicode escape sequence')) return null;
    if (errPos === awaitPos + 7 && e.message.includes('Unexpected token')) return null;
    const line = e.loc.line;
    const column = line === 1 ? e.loc.column - wrapPrefix.length : e.loc.column;
    let message = `\n${src.split('\n')[line - 1]}\n${' '.repeat(column)}^\n\n${e.message.replace(/ \([^)]+\)/, '')}`;
    if (message.endsWith('Unexpected token')) message += ` '${src[e.pos - wrapPrefix.length] ?? src[src.length - 1]}'`;
    throw new SyntaxError(message);
  }
  const body = root.body[0].expression.callee.body;
  const state = {
    body,
    ancestors: [],
    hoistedDeclarationStatements: [],
    replace(from, to, str) {
      for (let i = from; i < to; i++) wrappedArray[i] = '';
      if (from === to) str += wrappedArray[from];
      wrappedArray[from] = str;
    },
    prepend(node, str) {
      wrappedArray[node.start] = str + wrappedArray[node.start];
    },
    append(node, str) {
      wrappedArray[node.end - 1] += str;
    },
    containsAwait: false,
    containsReturn: false,
  };
  walk.recursive(body, state, visitors);
  // No transform for a false alarm (no await expression) or a top-level return, which is not allowed.
  if (!state.containsAwait || state.containsReturn) return null;
  const last = body.body[body.body.length - 1];
  if (last !== undefined && last.type === 'ExpressionStatement') {
    state.prepend(last, 'return (');
    state.append(last.expression, ')');
  }
  return state.hoistedDeclarationStatements.join('') + wrappedArray.join('');
}

module.exports = Object.freeze({ __proto__: null, processTopLevelAwait });
