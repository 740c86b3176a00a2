"""The catalogue of tools: one entry per tool, from which HTTP routes, `GET /tools` and MCP are built.

Each tool's request model is its single source of truth: it validates HTTP bodies, it is the OpenAPI
schema, the OpenAI function schema and the MCP input schema.

A tool whose output comes while it runs (the code interpreter) also has `stream`: the same call with an
`OutputSink`. Its `invoke` is that call without a sink, so the buffered answer, the event stream's
result and the MCP result come from one path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from metaagent.sandbox.output import OutputSink
    from metaagent.services import Services


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

    @property
    def description(self) -> str:
        return (self.request_model.__doc__ or self.summary).strip()

    def parameters_schema(self) -> dict[str, Any]:
        return inline_refs(self.request_model.model_json_schema())

    def function_schema(self) -> dict[str, Any]:
        """The OpenAI function-calling shape (flat, as the Responses API takes it)."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters_schema(),
            # Strict mode requires every field and no defaults; these tools have optional fields, so say
            # so rather than leave it to a client whose default may be strict (the Responses API's is).
            "strict": False,
        }


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
