"""`GET /tools`: the OpenAI function-calling view of the catalogue, generated from the request models."""

from __future__ import annotations

import inspect
import json

from metaagent.app import TOOLS
from tests.conftest import ServiceFactory


async def test_get_tools_lists_every_tool_in_the_openai_function_shape(service: ServiceFactory) -> None:
    async with service() as client:
        functions = (await client.get("/tools")).json()["tools"]
    assert [f["name"] for f in functions] == [spec.name for spec in TOOLS]
    assert {"http", "code_interpreter", "search", "embeddings", "session_create", "session_close"} <= {
        f["name"] for f in functions
    }
    for function, spec in zip(functions, TOOLS, strict=True):
        assert set(function) == {"type", "name", "description", "parameters", "strict"}
        assert function["type"] == "function"
        assert function["strict"] is False  # the usual form; ?strict=true asks for the strict one
        assert function["description"] == inspect.cleandoc(spec.request_model.__doc__)  # type: ignore[arg-type]
        assert function["parameters"] == spec.parameters_schema()
        assert "$ref" not in json.dumps(function["parameters"])  # flat: no definitions to chase


async def test_the_schema_states_the_bounds_that_validation_enforces(service: ServiceFactory) -> None:
    async with service() as client:
        functions = {f["name"]: f for f in (await client.get("/tools")).json()["tools"]}
        timeout = functions["code_interpreter"]["parameters"]["properties"]["timeout_s"]["anyOf"][0]  # or null
        too_long = await client.post("/tools/code-interpreter", json={"code": "1", "timeout_s": timeout["maximum"] + 1})
        network = functions["code_interpreter"]["parameters"]["properties"]["network"]
    assert functions["code_interpreter"]["parameters"]["required"] == ["code"]
    assert too_long.status_code == 422
    assert "timeout_s" in too_long.json()["error"]
    assert network["anyOf"][0]["properties"]["allow"]["type"] == "array"  # the nested model, inlined
