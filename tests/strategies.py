"""Hypothesis strategies for hostile text, and where to put it: every string slot of a tool's request.

Hypothesis' own text strategies never produce lone surrogates (they are not valid Unicode), and
schemathesis keeps to each field's declared length, so neither reaches the two classes of input that
gave 500s: a lone UTF-16 surrogate (which JSON carries as a `\\udfff` escape) and a string longer than
its field allows. These strategies produce both, for any field.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

Path = tuple[str | int, ...]


def lone_surrogates() -> st.SearchStrategy[str]:
    """Text holding at least one lone surrogate (a high or low one, alone or two in the wrong order)."""
    lone = st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        st.just("\udc00\ud800"),  # a low before a high: each alone
    )
    return st.tuples(st.text(max_size=12), lone, st.text(max_size=12)).map("".join)


def any_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Any Python string a sandbox's JSON could decode to: any code point, and surrogates alone, in the
    wrong order, or as a high-low pair (which JavaScript reads as one character)."""
    surrogate = st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDBFF),
        st.characters(min_codepoint=0xDC00, max_codepoint=0xDFFF),
        st.sampled_from(["\ud83d\ude00", "\ude00\ud83d", "\ud800\ud800"]),
    )
    return st.lists(st.one_of(st.characters(), surrogate), max_size=max_size).map("".join)


def over_long(max_length: int | None) -> st.SearchStrategy[str]:
    """Text past `max_length` (a field's declared bound), or large text where a field declares none."""
    low = (max_length or 64 * 1024) + 1
    return st.tuples(st.integers(low, low + 4096), st.text(max_size=8)).map(lambda pair: "x" * pair[0] + pair[1])


@dataclass(frozen=True)
class Slot:
    """One place a string goes in a request: its path (a key `"*"` stands for an object's key) and bound."""

    path: Path
    max_length: int | None

    @property
    def field(self) -> str:
        return str(self.path[0])


def _string_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    if schema.get("type") == "string":
        return schema
    for option in schema.get("anyOf", []):
        if option.get("type") == "string":
            return dict(option)
    return None


def _walk(schema: dict[str, Any], path: Path) -> Iterator[Slot]:
    text = _string_schema(schema)
    if text is not None and "enum" not in text:
        yield Slot(path, text.get("maxLength"))
    for option in [schema, *schema.get("anyOf", [])]:
        if option.get("type") == "array" and isinstance(option.get("items"), dict):
            yield from _walk(option["items"], (*path, 0))
        if option.get("type") == "object":
            for name, sub in option.get("properties", {}).items():
                yield from _walk(sub, (*path, name))
            extra = option.get("additionalProperties")
            if isinstance(extra, dict):
                yield Slot((*path, "*"), None)  # the key
                yield from _walk(extra, (*path, "X-Value"))


def string_slots(schema: dict[str, Any]) -> list[Slot]:
    """Every string slot of a request model's (inlined) JSON Schema, nested ones included."""
    return list(_walk(schema, ()))


def place(base: dict[str, Any], path: Path, text: str) -> dict[str, Any]:
    """A copy of `base` with `text` at `path`, creating the lists and objects on the way."""
    result = copy.deepcopy(base)
    node: Any = result
    for step, following in zip(path, [*path[1:], None], strict=True):
        if following is None:
            break
        if following == "*":
            node[step] = {text: "value"}
            return result
        if isinstance(node, list):
            node.append([] if isinstance(following, int) else {})
            node = node[-1]
            continue
        if not isinstance(node.get(step), list | dict):
            node[step] = [] if isinstance(following, int) else {}
        node = node[step]
    last = path[-1]
    if isinstance(node, list):
        node.append(text)
    else:
        node[last] = text
    return result


def strings_in(value: Any, path: Path = ()) -> Iterator[Path]:
    """The paths of every string (and object key) inside a generated JSON value."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from strings_in(item, (*path, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key, "*")
            yield from strings_in(item, (*path, key))


def replace_at(value: Any, path: Path, text: str) -> Any:
    """A copy of a generated JSON value with the string (or, for a path ending in `"*"`, the key) at `path`
    replaced by `text`."""
    if not path:
        return text
    result = copy.deepcopy(value)
    node: Any = result
    for step in path[:-2] if path[-1] == "*" else path[:-1]:
        node = node[step]
    if path[-1] == "*":
        key = path[-2]
        node[text] = node.pop(key)
    else:
        node[path[-1]] = text
    return result


def longest_bound(schema: Any) -> int:
    """The largest `maxLength` anywhere in a JSON Schema (or an OpenAPI description), 0 if none."""
    if isinstance(schema, dict):
        own = schema.get("maxLength")
        inner = max((longest_bound(value) for value in schema.values()), default=0)
        return max(own if isinstance(own, int) else 0, inner)
    if isinstance(schema, list):
        return max((longest_bound(item) for item in schema), default=0)
    return 0


def with_hostile_strings(body: Any, longer_than: int) -> st.SearchStrategy[Any]:
    """The body as generated, or with one of its strings replaced by a lone surrogate or an over-long text.

    The over-long text is longer than `longer_than`, which the caller makes the largest bound of any field:
    a shorter one could replace the very string that made a negative case invalid (a `code` past its
    1 MiB, say) with one its field accepts, and the "invalid" request would then be served."""
    paths = list(strings_in(body))
    if not paths:
        return st.just(body)
    hostile = st.tuples(st.sampled_from(paths), st.one_of(lone_surrogates(), over_long(longer_than)))
    return st.one_of(st.just(body), hostile.map(lambda pair: replace_at(body, *pair)))


# Hostile upstream answers: what a compromised or broken Serper or OpenAI could send.


def hostile_text(secrets: tuple[str, ...] = ()) -> st.SearchStrategy[str]:
    """Ordinary text, text with lone surrogates or controls, and text that echoes a secret in some form."""
    plain = st.text(max_size=40)
    echoed = st.tuples(plain, st.sampled_from(secrets), plain).map("".join) if secrets else plain
    controls = st.text(st.characters(max_codepoint=0x9F), max_size=20)
    return st.one_of(plain, lone_surrogates(), controls, echoed)


def json_values(secrets: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    """Any JSON value, with hostile strings (keys included) and numbers that do not fit a float."""
    numbers = st.one_of(
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.just(10**400),
        st.just(-(10**30)),
    )
    leaves = st.one_of(st.none(), st.booleans(), numbers, hostile_text(secrets))
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(hostile_text(secrets), inner, max_size=5)),
        max_leaves=25,
    )


def json_bytes(value: Any) -> bytes:
    """A JSON value as an upstream would send it: `NaN`, `Infinity`, 400-digit integers and lone surrogate
    escapes included (which a strict JSON writer would refuse)."""
    return json.dumps(value, allow_nan=True).encode()


def serper_answers(secrets: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """Serper-shaped answers (any field of any type) and arbitrary JSON values."""
    items = st.dictionaries(
        st.sampled_from(["title", "link", "snippet", "position", "date", "source", "imageUrl", "thumbnailUrl"]),
        json_values(secrets),
    )
    shaped = st.fixed_dictionaries(
        {},
        optional={
            "organic": st.one_of(st.lists(items, max_size=4), json_values(secrets)),
            "news": st.lists(items, max_size=3),
            "images": st.lists(items, max_size=3),
            "answerBox": json_values(secrets),
            "knowledgeGraph": json_values(secrets),
            "peopleAlsoAsk": json_values(secrets),
            "relatedSearches": json_values(secrets),
        },
    )
    return st.one_of(shaped, json_values(secrets))


def openai_answers(secrets: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """OpenAI-shaped embeddings answers (vectors as lists, base64 or anything else) and arbitrary JSON."""
    vectors = st.one_of(
        st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers()), max_size=8),
        st.binary(max_size=32).map(lambda raw: base64.b64encode(raw).decode()),
        json_values(secrets),
    )
    item = st.fixed_dictionaries(
        {"embedding": vectors}, optional={"index": st.one_of(st.integers(-2, 3), json_values()), "object": st.text()}
    )
    shaped = st.fixed_dictionaries(
        {"data": st.one_of(st.lists(item, max_size=3), json_values(secrets))},
        optional={"model": hostile_text(secrets), "usage": json_values(secrets)},
    )
    return st.one_of(shaped, json_values(secrets))


def upstream_bodies(answers: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[bytes, dict[str, str]]]:
    """An answer's bytes and headers: plain, gzip, cut short, or labelled gzip without being gzip."""
    plain = answers.map(lambda value: (json_bytes(value), {}))
    gzipped = answers.map(lambda value: (gzip.compress(json_bytes(value)), {"Content-Encoding": "gzip"}))
    cut = st.tuples(answers, st.integers(0, 64)).map(lambda pair: (json_bytes(pair[0])[: pair[1]], {}))
    mislabelled = st.binary(max_size=64).map(lambda raw: (raw, {"Content-Encoding": "gzip"}))
    return st.one_of(plain, gzipped, cut, mislabelled, st.binary(max_size=64).map(lambda raw: (raw, {})))
