"""What every tool's request model shares: unknown fields refused, strict types, and well-formed Unicode.

Types are strict (pydantic's strict mode): `true` or `"5"` is not an integer, `"true"` is not a boolean
and `5` is not a string; a number field still takes an integer (`"timeout_s": 30` for a float). The body
itself was read by `metaagent.request_json` (UTF-8 only, no repeated key, no integer past its range).

JSON can carry a lone UTF-16 surrogate (`"\\udfff"`), and Python's parser hands it over as is; such a
string cannot be encoded as UTF-8, so it would fail far from the boundary (a 500, or an audit record
that cannot be written). Every string of every field, however deeply nested (lists, objects and their
keys, nested models), is checked once, here, and one that holds a lone surrogate is a 422 that names the
field. A model inherits the check by deriving from `ToolRequest`, so a new field or tool cannot miss it.

Every optional field takes `null` as "not given": its default applies, and it is not among the fields the
caller set (`model_fields_set`). OpenAI's strict mode sends every property, with null where the model has
no value, so a tool callable in strict mode needs exactly this; the JSON Schema says so (each optional
property also accepts null), so the schema and the validation cannot disagree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from metaagent.text import is_well_formed


def lone_surrogate_at(value: Any) -> str | None:
    """Where in `value` a string holds a lone surrogate ("" for `value` itself, "[2]", "['key']"), or None."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            if not is_well_formed(item):
                return where
        elif isinstance(item, list | tuple):
            pending.extend((f"{where}[{i}]", element) for i, element in enumerate(item))
        elif isinstance(item, dict):
            for key, element in item.items():
                if isinstance(key, str) and not is_well_formed(key):
                    return f"{where} (a key)"
                pending.append((f"{where}[{key!r}]", element))
    return None


# Keywords that annotate a property rather than constrain its value: they stay outside the `anyOf`.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated"})


def accepts_null(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(accepts_null(option) for option in schema.get("anyOf", ()))


def _optional_properties_accept_null(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The schema side of "null is not given": each optional property becomes `anyOf: [<its schema>, null]`."""
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        prop = properties.get(field.alias or name)
        if prop is None or field.is_required() or accepts_null(prop):
            continue
        value = {key: item for key, item in prop.items() if key not in _ANNOTATIONS}
        annotations = {key: item for key, item in prop.items() if key in _ANNOTATIONS}
        prop.clear()
        prop.update({"anyOf": [value, {"type": "null"}], **annotations})


class ToolRequest(BaseModel):
    """The base of every tool's request model."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra=_optional_properties_accept_null,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }

    @field_validator("*", mode="after")
    @classmethod
    def _well_formed_text(cls, value: Any) -> Any:
        where = lone_surrogate_at(value)
        if where is not None:
            inside = f" (at {where})" if where else ""
            raise PydanticCustomError(
                "lone_surrogate",
                "text with a lone UTF-16 surrogate{inside} is not valid Unicode; send well-formed text "
                "(in JSON, \\ud800-\\udfff escapes only in high-low pairs)",
                {"inside": inside},
            )
        return value
