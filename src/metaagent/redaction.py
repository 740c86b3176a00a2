"""Keeping the service's upstream keys out of everything it answers: `Redactor`.

An upstream can echo the key it was sent (a wrong key quoted in an error, a hostile or compromised
upstream putting it in a result). Every string an upstream tool returns passes through `Redactor.scrub`
first, and each key is found in its simple transforms:

- in any case, and with anything between its letters and digits (spaces, dashes, dots, zero-width
  characters, markup): the text is compared with its letters and digits alone, lower-cased;
- in part: any run of at least `FRAGMENT` of its letters and digits in order (so a key cut short, or
  without its first characters, is still found), and any word that holds its first 8 characters (the
  way OpenAI masks a key it quotes);
- in base64 (standard and URL-safe alphabets, at any alignment inside a longer base64 text) and in hex.

Each occurrence becomes `[redacted]`; the count of replacements goes into the answer (`redacted`).
A real key is random, so a fragment of `FRAGMENT` characters does not occur in ordinary text by chance.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from typing import Any

from metaagent.text import well_formed

MARK = "[redacted]"
FRAGMENT = 12  # letters and digits of a key that, in a row, count as the key
_PREFIX = 8  # a word holding the key's first characters is a masked copy of it
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_=-]+")


class TooDeep(ValueError):
    """A value nests deeper than the bound given to `scrub_tree`."""


class _Secret:
    def __init__(self, secret: str, *, masked_form: bool = True) -> None:
        self.alnum = "".join(ch for ch in secret.lower() if ch.isascii() and ch.isalnum())
        self.fragment = min(FRAGMENT, len(self.alnum))
        # Every window of `fragment` characters, and where it starts in the key.
        self.windows: dict[str, list[int]] = {}
        for start in range(len(self.alnum) - self.fragment + 1):
            self.windows.setdefault(self.alnum[start : start + self.fragment], []).append(start)
        self.prefix = secret[:_PREFIX] if masked_form and len(secret) >= 12 else None


def _base64_cores(secret: bytes) -> set[str]:
    """Substrings that every base64 text holding `secret` contains, whatever its alignment."""
    cores: set[str] = set()
    for shift in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * shift + secret).decode().rstrip("=")
            # The first characters also encode the padding bytes, the last ones what follows the key.
            core = text[(shift * 8 + 5) // 6 : len(text) - 3]
            if len(core) >= 8:
                cores.add(core)
    return cores


class Redactor:
    """Finds and replaces the given secrets (see the module's docstring); secrets shorter than 8 are skipped."""

    def __init__(self, secrets: Iterable[str]) -> None:
        values = [s.strip() for s in secrets if s and len(s.strip()) >= 8]
        self._secrets = [_Secret(v) for v in values]
        self._secrets += [_Secret(v.encode().hex(), masked_form=False) for v in values]
        self._secrets = [s for s in self._secrets if s.fragment >= 8]
        self._base64 = sorted(set().union(*(_base64_cores(v.encode()) for v in values)), key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def scrub(self, text: str) -> tuple[str, int]:
        """`text` with every occurrence of a secret replaced by `[redacted]`, and how many there were."""
        if not self._secrets:
            return text, 0
        total = 0
        for secret in self._secrets:
            text, count = _scrub_fragments(text, secret)
            total += count
            if secret.prefix is not None and secret.prefix in text:
                words = text.split(" ")
                masked = [MARK if secret.prefix in word else word for word in words]
                total += sum(a != b for a, b in zip(words, masked, strict=True))
                text = " ".join(masked)
        for core in self._base64:
            if core in text:
                text, count = _replace_runs_holding(text, core)
                total += count
        return text, total

    def scrub_tree(self, value: Any, max_depth: int) -> tuple[Any, int]:
        """A copy of a JSON value with every string (object keys included) scrubbed and made well-formed
        (a lone surrogate becomes U+FFFD): text fit to answer. Raises TooDeep."""
        total = 0

        def clean(text: str) -> str:
            nonlocal total
            result, count = self.scrub(well_formed(text))
            total += count
            return result

        # Iterative, so that no nesting can exhaust Python's stack.
        root: list[Any] = [None]
        pending: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 0)]
        while pending:
            item, parent, slot, depth = pending.pop()
            if depth > max_depth:
                raise TooDeep(f"nests deeper than {max_depth} levels")
            if isinstance(item, str):
                parent[slot] = clean(item)
            elif isinstance(item, dict):
                copy: dict[str, Any] = {}
                parent[slot] = copy
                for key, element in item.items():
                    name = clean(key) if isinstance(key, str) else key
                    copy[name] = None
                    pending.append((element, copy, name, depth + 1))
            elif isinstance(item, list):
                items: list[Any] = [None] * len(item)
                parent[slot] = items
                pending.extend((element, items, index, depth + 1) for index, element in enumerate(item))
            else:
                parent[slot] = item
        return root[0], total


def _replace_runs_holding(text: str, core: str) -> tuple[str, int]:
    """Replaces each base64-looking run of `text` that holds `core` with `[redacted]`."""
    count = 0

    def replace(match: re.Match[str]) -> str:
        nonlocal count
        if core not in match.group(0):
            return match.group(0)
        count += 1
        return MARK

    return _BASE64_RUN.sub(replace, text), count


_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]+")


def _scrub_fragments(text: str, secret: _Secret) -> tuple[str, int]:
    """Replaces each maximal run of the secret's characters (in order, `fragment` or more, any case,
    anything but letters and digits between them) with `[redacted]`."""
    quick = _NOT_ALNUM.sub("", text).lower()  # at C speed: most texts hold no window and stop here
    if not any(window in quick for window in secret.windows):
        return text, 0
    positions = [i for i, ch in enumerate(text) if ch.isascii() and ch.isalnum()]
    letters = "".join(text[i] for i in positions).lower()
    spans: list[tuple[int, int]] = []
    at = 0
    while at + secret.fragment <= len(letters):
        starts = secret.windows.get(letters[at : at + secret.fragment])
        if starts is None:
            at += 1
            continue
        longest = 0
        for start in starts:
            length = secret.fragment
            while (
                at + length < len(letters)
                and start + length < len(secret.alnum)
                and (letters[at + length] == secret.alnum[start + length])
            ):
                length += 1
            longest = max(longest, length)
        spans.append((positions[at], positions[at + longest - 1] + 1))
        at += longest
    pieces: list[str] = []
    last = 0
    for begin, end in spans:
        pieces += [text[last:begin], MARK]
        last = end
    pieces.append(text[last:])
    return "".join(pieces), len(spans)
