"""Strict mode: every optional parameter takes null, and `GET /tools?strict=true` is what OpenAI's strict
mode requires, checked with the OpenAI Agents SDK's own strict conversion and a JSON Schema validator."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from agents.exceptions import UserError
from agents.strict_schema import ensure_strict_json_schema

from metaagent.app import TOOLS
from metaagent.tools import ToolSpec
from tests.conftest import ServiceFactory

# A value for each required parameter of each tool: a strict-mode call sends these and null for the rest.
REQUIRED_VALUES: dict[str, dict[str, Any]] = {
    "http": {"url": "http://127.0.0.1:9/"},
    "code_interpreter": {"code": "1"},
    "search": {"q": "gvisor"},
    "embeddings": {"input": "a text"},
    "session_create": {},
    "session_close": {"session_id": "ses_x"},
    "session_files": {"session_id": "ses_x"},
    "session_read_file": {"session_id": "ses_x", "path": "data.csv"},
    "session_write_file": {"session_id": "ses_x", "path": "data.csv", "content": "a,b\n1,2\n"},
}
# The one tool whose shape strict mode cannot express: its headers are a map with free-form keys.
NOT_STRICT = {"http"}


def strict_mode_arguments(spec: ToolSpec) -> dict[str, Any]:
    """What a strict-mode caller sends: every property, null where it has no value."""
    properties = spec.parameters_schema()["properties"]
    return {name: REQUIRED_VALUES[spec.name].get(name) for name in properties}


def test_every_tool_has_required_values_here() -> None:
    assert {spec.name for spec in TOOLS} == set(REQUIRED_VALUES)


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_every_optional_parameter_accepts_null_and_null_is_not_given(spec: ToolSpec) -> None:
    schema = spec.parameters_schema()
    arguments = strict_mode_arguments(spec)
    jsonschema.validate(arguments, schema)
    request = spec.request_model.model_validate(arguments)
    assert request.model_fields_set == set(REQUIRED_VALUES[spec.name])  # the nulls were not given
    assert request == spec.request_model.model_validate(REQUIRED_VALUES[spec.name])  # so the defaults hold


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_a_required_parameter_does_not_accept_null(spec: ToolSpec) -> None:
    for name in REQUIRED_VALUES[spec.name]:
        with pytest.raises(ValueError, match=name):
            spec.request_model.model_validate({**REQUIRED_VALUES[spec.name], name: None})


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_the_strict_form_is_what_the_agents_sdk_makes_strict_and_a_valid_json_schema(spec: ToolSpec) -> None:
    function = spec.function_schema(strict=True)
    if spec.name in NOT_STRICT:
        assert function == spec.function_schema()  # the usual form, saying it is not strict
        assert function["strict"] is False
        with pytest.raises(UserError, match="additionalProperties"):  # the SDK cannot make it strict either
            ensure_strict_json_schema(copy.deepcopy(function["parameters"]))
        return
    strict = function["parameters"]
    assert function["strict"] is True
    jsonschema.Draft202012Validator.check_schema(strict)
    assert ensure_strict_json_schema(copy.deepcopy(strict)) == strict  # already strict: nothing to change
    # The SDK's conversion of the usual form (what convert_schemas_to_strict does to the MCP input schema)
    # works too, and leaves every optional parameter nullable.
    converted = ensure_strict_json_schema(copy.deepcopy(spec.parameters_schema()))
    jsonschema.validate(strict_mode_arguments(spec), converted)
    jsonschema.validate(strict_mode_arguments(spec), strict)
    _assert_strict(strict)


def _assert_strict(node: dict[str, Any]) -> None:
    if node.get("type") == "object":
        assert node["additionalProperties"] is False
        assert node["required"] == list(node["properties"])
    assert "default" not in node  # not a strict keyword; the description says what null means
    items = [node["items"]] if "items" in node else []
    for child in [*node.get("properties", {}).values(), *node.get("anyOf", ()), *items]:
        _assert_strict(child)


async def test_get_tools_strict_answers_the_strict_form_of_each_tool(service: ServiceFactory) -> None:
    async with service() as client:
        usual = (await client.get("/tools")).json()["tools"]
        strict = (await client.get("/tools", params={"strict": "true"})).json()["tools"]
    assert strict == [spec.function_schema(strict=True) for spec in TOOLS]
    assert [f["strict"] for f in strict] == [spec.name not in NOT_STRICT for spec in TOOLS]
    assert all(f["strict"] is False for f in usual)


async def test_a_strict_mode_call_of_a_tool_over_http_takes_the_defaults(service: ServiceFactory) -> None:
    # search without a Serper key: the nulls passed validation, and the refusal is about the key, not them
    spec = next(spec for spec in TOOLS if spec.name == "search")
    async with service() as client:
        answer = await client.post("/tools/search", json=strict_mode_arguments(spec))
    assert answer.status_code == 503, answer.text
    assert "SERPER_API_KEY" in answer.json()["error"]
