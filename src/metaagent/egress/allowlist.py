"""The egress allow-list: parsing `ALLOW_HTTP_HOSTS`, validating each pattern, and matching hosts.

Patterns are exact hosts (`api.openai.com`, `127.0.0.1`, `::1`) or a wildcard over subdomains
(`*.example.com`, which matches `api.example.com` and `a.b.example.com` but never `example.com` itself
nor `malicious-example.com`). Hosts and patterns are normalised the same way: lower case, no trailing
dot, international names in their ASCII (punycode) form, IP addresses in canonical form, IPv6 with or
without brackets.

What is malformed, and why each gets its own message: an entry that is not a bare host cannot mean
what its author hoped (a scheme, path or port is silently ignored by most allow-lists, which is how
`https://api.example.com/v1` ends up allowing nothing, or everything). So every such entry refuses the
configuration and says what to write instead.

Matching costs one set lookup for exact entries and one per label of the host for wildcards, however
many patterns there are.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

import idna

from metaagent.errors import ConfigError

_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_LOOKS_NUMERIC = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
_JSON_DEBRIS = re.compile(r"[\[\]\"']")
_EXAMPLE = '["api.openai.com", "*.example.com"]'


class PatternError(ValueError):
    """One entry is malformed; `reason` says why and `fix` what to write instead."""

    def __init__(self, entry: str, reason: str, fix: str) -> None:
        super().__init__(f"{entry!r}: {reason}; {fix}")
        self.entry = entry
        self.reason = reason
        self.fix = fix


def canonical_ip(text: str) -> str | None:
    """The canonical form of an IP literal (IPv6 with or without brackets), or None if not one."""
    candidate = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return None
    return str(address)


def normalize_pattern(entry: str) -> str:
    """Validates one allow-list entry and returns its normal form, or raises PatternError."""
    text = entry.strip()
    if not text:
        raise PatternError(entry, "empty entry", "remove it")
    lowered = text.lower()
    if "://" in lowered or re.match(r"^https?:", lowered):
        host = re.sub(r"^[a-z][a-z0-9+.-]*:/*", "", lowered).split("/")[0]
        raise PatternError(
            entry, "a scheme is not part of a host", f"write the host alone: {host or 'api.example.com'}"
        )
    if "@" in text:
        raise PatternError(entry, "user info is not part of a host", f"write the host alone: {text.rsplit('@', 1)[1]}")
    if any(sep in text for sep in "/\\?#"):
        host = re.split(r"[/\\?#]", text, maxsplit=1)[0]
        raise PatternError(entry, "a path or query is not part of a host", f"write the host alone: {host}")
    if any(ch.isspace() for ch in text):
        raise PatternError(entry, "white space inside a host", "remove it, or split the entry with a comma")
    ip = canonical_ip(text)
    if ip is not None:
        return ip
    if text.startswith("[") or text.count(":") > 1:
        raise PatternError(entry, "not a valid IPv6 address", "write it like ::1 or [2001:db8::1], without a port")
    if ":" in text:
        host, port = text.rsplit(":", 1)
        raise PatternError(entry, f"a port ({port}) is not part of the allow-list", f"write the host alone: {host}")
    if text in ("*", "*.", "*.*"):
        raise PatternError(
            entry,
            "a bare wildcard would allow every host",
            "list the hosts, or use *.example.com for subdomains",
        )
    wildcard = text.startswith("*.")
    body = text[2:] if wildcard else text
    if "*" in body:
        raise PatternError(entry, "a wildcard may only be the whole leftmost label", "write it like *.example.com")
    if body.startswith("."):
        raise PatternError(entry, "a host cannot start with a dot", f"for subdomains write *{body}")
    ascii_host = _to_ascii(entry, body.rstrip(".") if body.endswith(".") and not body.endswith("..") else body)
    labels = ascii_host.split(".")
    for label in labels:
        if not label:
            raise PatternError(entry, "empty label (two dots in a row)", "remove the extra dot")
        if not _LABEL.match(label):
            bad = next((ch for ch in label if not (ch.isalnum() or ch == "-")), None)
            reason = f"bad character {bad!r} in a host" if bad else f"label {label!r} starts or ends with '-'"
            if len(label) > 63:
                reason = f"label {label[:20]}... is longer than 63 characters"
            raise PatternError(entry, reason, "use letters, digits and inner hyphens only")
    if len(ascii_host) > 253:
        raise PatternError(entry, "longer than 253 characters", "a DNS name cannot be this long")
    if _LOOKS_NUMERIC.match(labels[-1]):
        raise PatternError(
            entry,
            "ends in a number but is not an IP address in dotted-decimal form",
            "write IPv4 addresses like 127.0.0.1",
        )
    if wildcard and len(labels) < 2:
        raise PatternError(
            entry,
            "a wildcard over a top-level domain allows too much",
            f"write it like *.example.{ascii_host}",
        )
    return f"*.{ascii_host}" if wildcard else ascii_host


def _to_ascii(entry: str, host: str) -> str:
    if host.isascii():
        return host.lower()
    try:
        return idna.encode(idna.uts46_remap(host, std3_rules=False, transitional=False)).decode("ascii")
    except idna.IDNAError as exc:
        raise PatternError(entry, f"not a valid international domain name ({exc})", "check the spelling") from None


@dataclass(frozen=True)
class Entries:
    """A list setting as read: each item with its position (1-based, as written), and how many empty
    items (stray or trailing commas in comma-separated text) were dropped."""

    items: tuple[tuple[int, str], ...]
    empty_items: int = 0

    @property
    def texts(self) -> list[str]:
        return [text for _position, text in self.items]


def empty_items_warning(setting: str, count: int) -> str:
    """The one warning line for empty items that were ignored."""
    noun = "item" if count == 1 else "items"
    return f"{setting} has {count} empty {noun} (stray or trailing commas); ignored"


def split_entries(raw: str, setting: str) -> Entries:
    """Reads a list setting: a JSON array of strings (preferred) or comma-separated text (fallback).

    ConfigError names each bad item of a JSON array by position and value, and says where JSON could
    not read a value that looks like an array but is not one.
    """
    text = raw.strip()
    if not text:
        return Entries(())
    json_error: json.JSONDecodeError | None = None
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            json_error = exc
        else:
            return _json_items(value, setting)
    parts = text.split(",")
    items = tuple((position, part.strip()) for position, part in enumerate(parts, 1) if part.strip())
    if any(_JSON_DEBRIS.search(part) for _position, part in items):
        problems = _json_problems(text, items, json_error)
        raise ConfigError(f"{setting} looks like a JSON array but is not valid JSON", problems)
    return Entries(items, empty_items=len(parts) - len(items))


def _json_items(value: object, setting: str) -> Entries:
    if not isinstance(value, list):  # a JSON text that starts with "[" is an array; kept for the type checker
        raise ConfigError(f"{setting} is JSON but not an array", [f"write it like {_EXAMPLE}"])
    problems = [
        f'item {position}: {_shown_json(item)} is not a string; write it in double quotes, like "api.example.com"'
        for position, item in enumerate(value, 1)
        if not isinstance(item, str)
    ]
    if problems:
        what = "an item that is not a string" if len(problems) == 1 else f"{len(problems)} items that are not strings"
        raise ConfigError(f"{setting} is a JSON array with {what}", problems)
    return Entries(tuple(enumerate(value, 1)))


def _shown_json(item: object) -> str:
    text = json.dumps(item)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_problems(text: str, items: tuple[tuple[int, str], ...], error: json.JSONDecodeError | None) -> list[str]:
    hint = (
        "check for trailing commas, missing quotes or single quotes "
        f"(JSON needs double quotes): write it like {_EXAMPLE}, "
        "or as plain comma-separated text: api.openai.com,*.example.com"
    )
    if error is not None:
        near = text[max(0, error.pos - 20) : error.pos + 20]
        where = f"JSON could not read it at character {error.pos + 1} ({error.msg}), near {near!r}"
        return [where, hint]
    bad = [f"item {n}: {part!r} has brackets or quotes" for n, part in items if _JSON_DEBRIS.search(part)]
    return [*bad, hint]


@dataclass(frozen=True)
class Match:
    allowed: bool
    pattern: str | None
    reason: str


class AllowList:
    """A validated, normalised allow-list. Build it with `AllowList.parse` or `AllowList.of`."""

    def __init__(self, patterns: Iterable[str], *, empty_items: int = 0) -> None:
        normal = [normalize_pattern(p) for p in patterns]
        self.empty_items = empty_items  # ignored empty items of the setting, for the start-up warning
        self.patterns: tuple[str, ...] = tuple(dict.fromkeys(normal))
        self._exact = frozenset(p for p in self.patterns if not p.startswith("*."))
        self._wildcard_bases = frozenset(p[2:] for p in self.patterns if p.startswith("*."))
        self.duplicates: tuple[str, ...] = tuple(p for p in set(normal) if normal.count(p) > 1)

    @classmethod
    def of(cls, *patterns: str) -> AllowList:
        return cls(patterns)

    @classmethod
    def parse(cls, raw: str | None, setting: str = "ALLOW_HTTP_HOSTS") -> AllowList:
        """Parses and validates the setting; raises ConfigError naming every bad entry by position."""
        entries = split_entries(raw or "", setting)
        problems = []
        for position, entry in entries.items:
            try:
                normalize_pattern(entry)
            except PatternError as exc:
                problems.append(f"item {position}: {exc.entry!r}: {exc.reason}; {exc.fix}")
        if problems:
            raise ConfigError.malformed_entries(setting, problems)
        return cls(entries.texts, empty_items=entries.empty_items)

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __len__(self) -> int:
        return len(self.patterns)

    def match(self, host: str) -> Match:
        """Whether a normalised host is allowed, by which pattern, or why not."""
        if host in self._exact:
            return Match(True, host, f"exact entry {host}")
        # Wildcards never match an IP literal. A normalised one contains ":" or ends in a digit, which
        # spares most names the exception-driven IP parse (the slowest part of a miss).
        if not (":" in host or host[-1:].isdigit()) or canonical_ip(host) is None:
            rest = host
            while "." in rest:
                rest = rest.split(".", 1)[1]
                if rest in self._wildcard_bases:
                    return Match(True, f"*.{rest}", f"wildcard *.{rest}")
        if not self.patterns:
            return Match(False, None, "the allow-list is empty, so every host is blocked")
        return Match(False, None, f"{host} matches no entry of the allow-list")

    def allows(self, host: str) -> bool:
        return self.match(host).allowed

    def covers(self, pattern: str) -> bool:
        """Whether every host the (normalised) pattern matches is also matched by this list."""
        if not pattern.startswith("*."):
            return self.allows(pattern)
        base = pattern[2:]
        if base in self._wildcard_bases:
            return True
        # *.a.example.com lies inside *.example.com, but not inside an exact entry a.example.com.
        parent = self.match(base)
        return parent.allowed and parent.pattern is not None and parent.pattern.startswith("*.")
