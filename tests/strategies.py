"""Hypothesis strategies for hostile text, and where to put it: every string slot of a tool's request.

Hypothesis' own text strategies never produce lone surrogates (they are not valid Unicode), and
schemathesis keeps to each field's declared length, so neither reaches the two classes of input that
gave 500s: a lone UTF-16 surrogate (which JSON carries as a `\\udfff` escape) and a string longer than
its field allows. These strategies produce both, for any field.
"""

from __future__ import annotations

import copy
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


def with_hostile_strings(body: Any) -> st.SearchStrategy[Any]:
    """The body as generated, or with one of its strings replaced by a lone surrogate or an over-long text."""
    paths = list(strings_in(body))
    if not paths:
        return st.just(body)
    hostile = st.tuples(st.sampled_from(paths), st.one_of(lone_surrogates(), over_long(None)))
    return st.one_of(st.just(body), hostile.map(lambda pair: replace_at(body, *pair)))
