"""Which npm packages sandboxed code may have: the allow-list, the block list, and the spec grammar.

A request names packages as `name` or `name@version`, where version is an exact version or a semver
range (`4.17.21`, `^4.17.0`, `~1.11`, `>=1 <2`, `1.x`, `^1 || ^2`). Everything else npm would accept
as a "spec" is refused before npm ever sees it, each with its own rule: URLs, git and GitHub specs,
tarballs, paths, `file:` and `link:`, `npm:` aliases, dist-tags, and any character npm's own naming
rules (validate-npm-package-name, for new packages) do not allow in a name.

The allow-list (`METAAGENT_NPM_ALLOWED_PACKAGES`, JSON array or comma-separated, like
`ALLOW_HTTP_HOSTS`) holds entries of the same grammar. A bare entry allows every version; an entry
with a version pins the package: a request for the bare name gets the entry's version, and a request
with its own version gets the versions both allow (npm intersects the two ranges).

The block list always wins, even over the allow-list: every name of a Node core module (npm has
packages named `fs` and `child_process`; `require` would load the built-in anyway), and packages whose
purpose is to hand back what the sandbox blocks (files, programs, native code, sandbox escapes). The
sandbox's module gate refuses those powers whichever package asks; the block list says so up front.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from metaagent.egress.allowlist import Entries, split_entries
from metaagent.errors import ConfigError, PackageRefused

SETTING = "METAAGENT_NPM_ALLOWED_PACKAGES"

# Popular pure-JavaScript packages that load with require() on the sandbox's Node 18 and touch no
# blocked module. uuid is pinned: from version 12 on it is ESM-only and require('uuid') fails on Node 18.
DEFAULT_ALLOWED_PACKAGES: tuple[str, ...] = (
    "lodash",
    "dayjs",
    "date-fns",
    "luxon",
    "@js-joda/core",
    "mathjs",
    "decimal.js",
    "simple-statistics",
    "ramda",
    "zod",
    "validator",
    "uuid@^11",
    "papaparse",
    "yaml",
)

# Every built-in of Node 18 to 22 (`require('module').builtinModules`), and the ones that exist only
# with the node: prefix. A test checks this list against the host's node.
NODE_CORE_MODULES: frozenset[str] = frozenset(
    {
        "_http_agent", "_http_client", "_http_common", "_http_incoming", "_http_outgoing", "_http_server",
        "_stream_duplex", "_stream_passthrough", "_stream_readable", "_stream_transform", "_stream_wrap",
        "_stream_writable", "_tls_common", "_tls_wrap", "assert", "assert/strict", "async_hooks", "buffer",
        "child_process", "cluster", "console", "constants", "crypto", "dgram", "diagnostics_channel", "dns",
        "dns/promises", "domain", "events", "fs", "fs/promises", "http", "http2", "https", "inspector",
        "inspector/promises", "module", "net", "os", "path", "path/posix", "path/win32", "perf_hooks",
        "process", "punycode", "querystring", "readline", "readline/promises", "repl", "stream",
        "stream/consumers", "stream/promises", "stream/web", "string_decoder", "sys", "timers",
        "timers/promises", "tls", "trace_events", "tty", "url", "util", "util/types", "v8", "vm", "wasi",
        "worker_threads", "zlib", "test", "test/reporters", "sea", "sqlite",
    }
)  # fmt: skip

_CORE_REASONS = {
    "fs": "reads and writes files",
    "fs/promises": "reads and writes files",
    "child_process": "runs programs",
    "cluster": "forks processes",
    "worker_threads": "starts threads with a fresh module system",
    "net": "opens raw sockets",
    "tls": "opens raw TLS sockets",
    "dgram": "opens UDP sockets",
    "http2": "opens raw HTTP/2 sessions",
    "inspector": "drives the debugger",
    "repl": "evaluates code with every built-in",
    "v8": "changes V8 flags at run time",
    "vm": "compiles unverified code caches",
    "wasi": "gives WebAssembly file access",
}

_WRAPPERS = {
    "files": (
        "fs-extra graceful-fs fs-jetpack jsonfile mkdirp make-dir rimraf del write-file-atomic proper-lockfile "
        "chokidar glob fast-glob globby tmp tmp-promise temp tar tar-fs adm-zip unzipper extract-zip archiver "
        "decompress ncp cpy copyfiles move-file fs-promise fs-promises node-fs fs.realpath"
    ),
    "programs": (
        "shelljs execa cross-spawn child-process child-process-promise node-cmd zx sudo-prompt open opn "
        "spawn-sync foreground-child signal-exit"
    ),
    "native code": (
        "node-pty bindings node-gyp-build node-addon-api nan ffi-napi ref-napi koffi node-ffi better-sqlite3 "
        "sqlite3 bcrypt sharp canvas esbuild"
    ),
    "threads and processes": "worker-threads workerpool piscina threads tinypool",
    "sandbox escapes": "vm2 isolated-vm safe-eval static-eval",
}

_WRAPPER_REASONS = {
    "files": "wraps fs, which reads and writes files",
    "programs": "wraps child_process, which runs programs",
    "native code": "loads native code, which the sandbox refuses",
    "threads and processes": "wraps worker_threads or child_process",
    "sandbox escapes": "a JavaScript sandbox with a history of escapes",
}


def _blocked_table() -> Mapping[str, str]:
    table: dict[str, str] = {}
    for name in NODE_CORE_MODULES:
        why = _CORE_REASONS.get(name)
        table[name] = f"a Node core module ({why}) blocked in the sandbox" if why else "a Node core module name"
    for group, names in _WRAPPERS.items():
        for name in names.split():
            table[name] = _WRAPPER_REASONS[group]
    return MappingProxyType(table)


BLOCKED_PACKAGES: Mapping[str, str] = _blocked_table()

MAX_NAME_LENGTH = 214  # npm's limit, scope included
MAX_VERSION_LENGTH = 64

# npm's naming rules for new packages: lowercase, URL-safe, no leading dot or underscore; `~'!()*`
# are refused too. Strictly more than npm: the first character of each part is a letter or digit.
_NAME_PART = r"[a-z0-9][a-z0-9._-]*"
_NAME = re.compile(rf"^(?:@{_NAME_PART}/)?{_NAME_PART}$")

# node-semver's range grammar, with single spaces: range-set := range ( ' || ' range )*.
_NR = r"(?:0|[1-9][0-9]{0,15})"
_XR = rf"(?:[xX*]|{_NR})"
_IDS = r"[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*"
_PARTIAL = rf"v?{_XR}(?:\.{_XR}(?:\.{_XR}(?:-{_IDS})?(?:\+{_IDS})?)?)?"
_SIMPLE = rf"(?:<=|>=|<|>|=|~|\^)?{_PARTIAL}"
_RANGE = rf"(?:{_PARTIAL} - {_PARTIAL}|{_SIMPLE}(?: {_SIMPLE})*)"
_RANGE_SET = re.compile(rf"^{_RANGE}(?: \|\| {_RANGE})*$")

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_GIT_PREFIX = re.compile(r"^(?:git\+|git@|git:|github:|gitlab:|bitbucket:|gist:)", re.IGNORECASE)
_GITHUB_SHORTHAND = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(?:#.*)?$")
_TARBALL = re.compile(r"\.(?:tgz|tar|tar\.gz)$", re.IGNORECASE)
_SHELL = re.compile(r"[;|&$`<>(){}\[\]'\"!*?#%^=,+:\\]")


@dataclass(frozen=True)
class PackageSpec:
    """A registry package and, optionally, the version or range asked for."""

    name: str
    version: str | None = None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


class SpecRefused(ValueError):
    """One spec breaks `rule`; `reason` says how and `fix` what to write instead."""

    def __init__(self, spec: str, rule: str, reason: str, fix: str) -> None:
        super().__init__(f"{shown(spec)}: {reason}; {fix}")
        self.spec = spec
        self.rule = rule
        self.reason = reason
        self.fix = fix

    def refusal(self) -> PackageRefused:
        return PackageRefused(
            f"Package not allowed: {shown(self.spec)}: {self.reason}; {self.fix}",
            package=self.spec,
            rule=self.rule,
        )


def shown(spec: str) -> str:
    """The spec as it can be printed: control characters escaped, at most 100 characters."""
    text = spec.encode("unicode_escape").decode("ascii") if not spec.isprintable() else spec
    return text if len(text) <= 100 else text[:97] + "..."


def blocked_reason(name: str) -> str | None:
    """Why a package name is blocked, or None. Takes any spelling: `FS`, `node:fs`, `fs/promises`."""
    lowered = name.strip().lower()
    if lowered.startswith("node:"):
        return BLOCKED_PACKAGES.get(lowered[5:], "a Node core module name")
    return BLOCKED_PACKAGES.get(lowered)


def _split(text: str) -> tuple[str, str | None]:
    at = text.find("@", 1)  # a leading @ starts a scope
    return (text, None) if at == -1 else (text[:at], text[at + 1 :])


def parse_spec(text: str) -> PackageSpec:
    """Validates one `name` or `name@version`; raises SpecRefused naming the rule it breaks."""
    if not text.strip():
        raise SpecRefused(text, "empty", "an empty package name", "write a name such as lodash")
    if any(not ch.isprintable() for ch in text) or text != text.strip():
        raise SpecRefused(text, "whitespace", "control characters, tabs, newlines or edge spaces", "remove them")
    name, version = _split(text)
    why = blocked_reason(name)
    if why is not None:
        raise SpecRefused(text, "blocked", f"{name} is on the block list ({why})", "the sandbox cannot use it")
    if not text.isascii():
        raise SpecRefused(text, "characters", "non-ASCII characters", "npm names are lowercase ASCII")
    if _URL.match(text) or text.lower().startswith(("http:", "https:")):
        rule = "git" if text.lower().startswith("git") else "url"
        raise SpecRefused(text, rule, "a URL is not a registry package", "name the package as the registry knows it")
    if _GIT_PREFIX.match(text) or (version is not None and "#" in version):
        raise SpecRefused(text, "git", "a git or GitHub spec is not a registry package", "use the registry's name")
    if text.lower().startswith(("file:", "link:")):
        raise SpecRefused(text, "path", "a file: or link: spec is a local path", "use the registry's name")
    if "npm:" in text.lower():
        raise SpecRefused(text, "alias", "npm: aliases install one package under another's name", "ask for it")
    if _TARBALL.search(text):
        raise SpecRefused(text, "tarball", "a tarball is not a registry package", "use the registry's name")
    if text.startswith(("/", "./", "../", "~")) or "\\" in text or text in (".", ".."):
        raise SpecRefused(text, "path", "a file system path is not a registry package", "use the registry's name")
    if not name.startswith("@") and _GITHUB_SHORTHAND.match(name):
        raise SpecRefused(text, "git", "user/repo is a GitHub shorthand", "use the registry's name")
    _check_name(text, name)
    if version is None:
        return PackageSpec(name)
    if not version:
        raise SpecRefused(text, "version", "an empty version after @", "remove the @ or write a version")
    if len(version) > MAX_VERSION_LENGTH or not _RANGE_SET.match(version):
        raise SpecRefused(
            text,
            "version",
            f"{shown(version)} is not an exact version or a semver range (dist-tags are not accepted)",
            "write it like 4.17.21, ^4.17.0, ~1.2 or >=1 <2",
        )
    return PackageSpec(name, version)


def _check_name(text: str, name: str) -> None:
    if " " in name:
        raise SpecRefused(text, "whitespace", "a space in the name", "split packages into separate entries")
    if len(name) > MAX_NAME_LENGTH:
        raise SpecRefused(text, "length", f"longer than {MAX_NAME_LENGTH} characters", "npm names are shorter")
    if name.lower() != name:
        raise SpecRefused(text, "case", "upper-case letters", f"npm names are lowercase: {name.lower()}")
    base = name.split("/", 1)[1] if name.startswith("@") and "/" in name else name
    if base.startswith((".", "_")) or name.startswith(("@.", "@_")):
        raise SpecRefused(text, "characters", "a name cannot start with a dot or an underscore", "check the name")
    if name.startswith("@") and name.count("/") != 1:
        raise SpecRefused(text, "scope", "a scoped name is @scope/name", "write it like @js-joda/core")
    if "/" in name and not name.startswith("@"):
        raise SpecRefused(text, "path", "a slash outside a scope makes a path", "use the registry's name")
    if not _NAME.match(name):
        bad = next((ch for ch in name if _SHELL.match(ch) or not (ch.isalnum() or ch in "@/._-")), None)
        what = f"the character {bad!r}" if bad else "a character npm does not allow here"
        raise SpecRefused(text, "characters", f"{what} in the name", "use lowercase letters, digits, - . and _")


def _alternatives(version: str) -> list[str]:
    return version.split(" || ")


def combine(requested: str | None, allowed: str | None) -> str:
    """The npm spec to install: the versions both the request and the allow-list entry admit."""
    if requested is None:
        return allowed or "latest"
    if allowed is None or requested == allowed:
        return requested
    return " || ".join(f"{a} {b}" for a in _alternatives(requested) for b in _alternatives(allowed))


class PackagePolicy:
    """The validated allow-list. Build it with `PackagePolicy.parse` (start-up) or directly (tests)."""

    def __init__(self, entries: Iterable[PackageSpec], *, empty_items: int = 0) -> None:
        listed = list(entries)
        self.empty_items = empty_items  # ignored empty items of the setting, for the start-up warning
        self.blocked_entries: tuple[str, ...] = tuple(str(e) for e in listed if blocked_reason(e.name))
        self.entries: Mapping[str, str | None] = MappingProxyType(
            {e.name: e.version for e in listed if not blocked_reason(e.name)}
        )

    @classmethod
    def parse(cls, raw: str | None) -> PackagePolicy:
        """The setting's value (None: the default list); ConfigError names every bad entry by position."""
        listed = Entries(tuple(enumerate(DEFAULT_ALLOWED_PACKAGES, 1))) if raw is None else split_entries(raw, SETTING)
        problems: list[str] = []
        entries: list[PackageSpec] = []
        seen: dict[str, str | None] = {}
        for position, text in ((p, t.strip()) for p, t in listed.items):
            try:
                entry = parse_spec(text)
            except SpecRefused as exc:
                if exc.rule == "blocked":  # kept, so that start-up can warn; blocked always wins
                    entries.append(PackageSpec(*_split(text)))
                    continue
                problems.append(f"item {position}: {exc}")
                continue
            if entry.name in seen and seen[entry.name] != entry.version:
                problems.append(
                    f"item {position}: {entry.name!r} is listed twice with different versions; keep one entry"
                )
            seen[entry.name] = entry.version
            entries.append(entry)
        if problems:
            raise ConfigError.malformed_entries(SETTING, problems)
        return cls(entries, empty_items=listed.empty_items)

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, requested: Iterable[str]) -> dict[str, str]:
        """The npm dependencies to install for a request ({name: spec}); PackageRefused for the first
        spec that breaks a rule. Nothing here touches npm or the network."""
        dependencies: dict[str, str] = {}
        for text in requested:
            try:
                spec = parse_spec(text)
            except SpecRefused as exc:
                raise exc.refusal() from None
            if spec.name not in self.entries:
                names = sorted(self.entries)
                more = f" and {len(names) - 20} more" if len(names) > 20 else ""
                where = f"has {', '.join(names[:20])}{more}" if names else "is empty"
                raise SpecRefused(
                    text,
                    "not-allowed",
                    f"{spec.name} is not on the package allow-list ({SETTING} {where})",
                    "ask the operator to add it",
                ).refusal()
            if spec.name in dependencies:
                raise SpecRefused(text, "duplicate", f"{spec.name} is asked for twice", "keep one").refusal()
            allowed = self.entries[spec.name]
            if spec.version is not None and allowed is not None and spec.version != allowed:
                hyphen = " - " in spec.version or " - " in allowed
                if hyphen:
                    raise SpecRefused(
                        text,
                        "version",
                        f"the allow-list pins {spec.name}@{allowed}; a hyphen range cannot be combined with it",
                        "write the range with >= and <=, or leave the version out",
                    ).refusal()
            dependencies[spec.name] = combine(spec.version, allowed)
        return dependencies
