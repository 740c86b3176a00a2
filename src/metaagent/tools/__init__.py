"""The catalogue of tools: one entry per tool, from which HTTP routes, `GET /tools` and MCP are built.

Each tool's request model is its single source of truth: it validates HTTP bodies, it is the OpenAPI
schema, the OpenAI function schema and the MCP input schema.

Each optional parameter also accepts null ("not given", see `metaagent.validation`), so a caller in OpenAI's
strict mode, which sends every property, can call every tool; `strict_form` turns a tool's schema into
the shape strict mode requires, where the tool's shape allows it.

A tool whose output comes while it runs (the code interpreter) also has `stream`: the same call with an
`OutputSink`. Its `invoke` is that call without a sink, so the buffered answer, the event stream's
result and the MCP result come from one path.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from metaagent.validation import accepts_null

if TYPE_CHECKING:
    from metaagent.sandbox.output import OutputSink
    from metaagent.services import Services


@dataclass(frozen=True)
class Effects:
    """What a call of the tool does to the world, as MCP's tool annotations tell a client."""

    read_only: bool  # it changes nothing (reading a session's file is a use of it, no more)
    destructive: bool = False  # it may delete or overwrite what was there
    idempotent: bool = False  # the same call again has no further effect
    open_world: bool = False  # it reaches beyond this service (the web, an upstream API)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    path: str | None  # its POST route under /tools; None for a tool whose HTTP face is a resource's (sessions)
    request_model: type[BaseModel]
    response_model: type[BaseModel]
    summary: str
    invoke: Callable[[Services, Any], Awaitable[BaseModel]]
    error_statuses: tuple[int, ...] = (400, 422, 502, 504)
    stream: Callable[[Services, Any, OutputSink], Awaitable[BaseModel]] | None = None
    effects: Effects = field(kw_only=True)  # no default: each tool says what it does

    @property
    def description(self) -> str:
        return inspect.cleandoc(self.request_model.__doc__ or self.summary)

    def parameters_schema(self) -> dict[str, Any]:
        return inline_refs(self.request_model.model_json_schema())

    def function_schema(self, *, strict: bool = False) -> dict[str, Any]:
        """The OpenAI function-calling shape (flat, as the Responses API takes it); with `strict`, the strict
        form when the tool's shape allows one (`"strict": true`), else the usual one with `"strict": false`."""
        parameters = self.parameters_schema()
        strict_parameters = strict_form(parameters) if strict else None
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": parameters if strict_parameters is None else strict_parameters,
            # Said either way, rather than left to a client whose default may be strict (the Responses API's is).
            "strict": strict_parameters is not None,
        }


# The keywords of OpenAI's strict subset of JSON Schema. The strict form keeps only these: a limit it
# drops (`maxLength`) is still enforced by the request model, so the caller learns it from the 422.
_STRICT_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "anyOf", "enum", "const",
        "title", "description", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
    }
)  # fmt: skip


class _NotStrict(Exception):
    """The schema has a shape strict mode cannot express (an object with free-form keys)."""


def strict_form(schema: dict[str, Any]) -> dict[str, Any] | None:
    """`schema` (flat, no `$ref`) in the form OpenAI's strict mode requires, or None if it has none.

    Strict mode wants every property of every object required and no other property allowed
    (`additionalProperties: false`); an optional property says so by accepting null, which the request
    models take as "not given". A default is not a strict keyword: the description says what null means.
    An object with free-form keys (a map of headers) cannot be strict.
    """
    try:
        return _strict(schema)
    except _NotStrict:
        return None


def _strict(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _STRICT_KEYWORDS:
            continue
        if key == "properties":
            out[key] = {name: _strict(prop) for name, prop in value.items()}
        elif key == "items":
            out[key] = _strict(value)
        elif key == "anyOf":
            out[key] = [_strict(option) for option in value]
        else:
            out[key] = value
    if node.get("type") == "object" or "properties" in node:
        if node.get("additionalProperties") is not False:
            raise _NotStrict
        properties: dict[str, Any] = out.setdefault("properties", {})
        for name, prop in properties.items():
            if name not in node.get("required", ()) and not accepts_null(prop):
                properties[name] = {"anyOf": [prop, {"type": "null"}]}
        out["required"] = list(properties)
    default = node.get("default")
    if default is not None:
        said = f"null means the default, {json.dumps(default)}."
        out["description"] = f"{out['description'].rstrip()} ({said})" if "description" in out else said.capitalize()
    return out


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Replaces local `$ref`s by their definitions: function-calling clients handle flat schemas best."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                merged = {
                    **defs[ref.removeprefix("#/$defs/")],
                    **{k: v for k, v in node.items() if k != "$ref"},
                }
                return resolve(merged)
            return {k: resolve(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    result: dict[str, Any] = resolve(schema)
    return result
