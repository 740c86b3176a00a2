"""Schemathesis over the service's own OpenAPI description: no generated request gets a 5xx.

Both fuzzers are extended with the hostile text of `tests.strategies` (lone UTF-16 surrogates, strings
longer than their field allows): schemathesis puts it into the bodies it generates, and hypothesis puts
it into every string slot of every tool's request model, each of which must answer a 422 that names the
field, over HTTP and over MCP.

The service runs for real (uvicorn on 127.0.0.1, lifespan included) with an empty allow-list, dummy
upstream keys and no container engine (`DOCKER_HOST` points at a closed loopback port), so no
request leaves the machine. Every operation is fuzzed with valid and invalid data, except one case: a
*valid* code interpreter request. With no engine that is a 503 ("the container engine is unavailable"),
which is the contract's answer, not a crash; valid executions are proven against a real engine in
tests/sandbox. The code interpreter is fuzzed with invalid data only, where every answer must be a 4xx.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from metaagent.app import TOOLS, create_app
from tests.conftest import make_settings
from tests.live_service import serving
from tests.strategies import Slot, lone_surrogates, longest_bound, over_long, place, string_slots, with_hostile_strings
from tests.test_cli import free_port
from tests.test_mcp import INITIALIZE, MCP_HEADERS
from tests.test_strict_schemas import REQUIRED_VALUES

CODE_INTERPRETER = ("tool_code_interpreter", "tool_code_interpreter_by_name")
SESSION_CREATE = ("session_create", "tool_session_create")
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        # A closed loopback port, not a missing unix socket: docker-py leaks the socket of a failed unix connect.
        patch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{free_port()}")
        workdir: Path = tmp_path_factory.mktemp("fuzz")
        app = create_app(make_settings(workdir, serper_api_key="dummy-serper", openai_api_key="dummy-openai"))
        with serving(app) as url:
            yield url


# The description of an app built (not started) here, at collection; requests go to `service_url`.
DESCRIPTION = create_app(make_settings(Path("unused"))).openapi()
# Hostile over-long text is longer than any field allows, so it never makes an invalid body valid.
LONGEST_BOUND = longest_bound(DESCRIPTION)


def _schema(*modes: GenerationMode) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_dict(DESCRIPTION)
    schema.config.generation.update(modes=list(modes))
    return schema


everything = _schema(GenerationMode.POSITIVE, GenerationMode.NEGATIVE).exclude(operation_id=list(CODE_INTERPRETER))
code_interpreter = _schema(GenerationMode.NEGATIVE).include(operation_id=list(CODE_INTERPRETER))
# A valid session_create (its body is optional) reaches the container engine, which this service lacks on
# purpose: that 503 is the documented answer, and says so.
ENGINE_DOWN = "The container engine is unavailable"


def _hostile_bodies(_context: Any, body: Any) -> st.SearchStrategy[Any]:
    return with_hostile_strings(body, longer_than=LONGEST_BOUND)


for _fuzzed in (everything, code_interpreter):
    _fuzzed.hook("flatmap_body")(_hostile_bodies)


@everything.parametrize()
@FUZZ
def test_no_request_to_any_endpoint_gets_a_5xx(service_url: str, case: schemathesis.Case) -> None:
    response = case.call(base_url=service_url, timeout=30)
    if case.operation.definition.raw.get("operationId") in SESSION_CREATE and response.status_code == 503:
        assert response.json()["error"].startswith(ENGINE_DOWN)
        return
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    assert "error" in response.json() or response.status_code < 400


@code_interpreter.parametrize()
@FUZZ
def test_invalid_code_interpreter_requests_get_a_4xx(service_url: str, case: schemathesis.Case) -> None:
    response = case.call(base_url=service_url, timeout=30)
    assert 400 <= response.status_code < 500, f"{case.body!r}: {response.status_code} {response.text}"
    assert response.json()["error"]


# A request of each tool that its model accepts; each slot of each is then filled with hostile text.
VALID = REQUIRED_VALUES  # a valid call of each tool
# Where each tool takes a JSON body over HTTP (session_close's one field is in the URL of DELETE /sessions/{id}).
HTTP_PATHS = {spec.name: spec.path for spec in TOOLS if spec.path is not None} | {"session_create": "/sessions"}
ALL_SLOTS = [(spec, slot) for spec in TOOLS for slot in string_slots(spec.parameters_schema())]
SLOTS = [(spec, slot) for spec, slot in ALL_SLOTS if spec.name in HTTP_PATHS]


def _post(service_url: str, path: str, body: dict[str, Any]) -> httpx2.Response:
    # json.dumps writes a lone surrogate as its `\udfff` escape, as a hostile client sends it.
    data = json.dumps(body)
    return httpx2.post(f"{service_url}{path}", content=data, headers={"Content-Type": "application/json"}, timeout=30)


def test_every_string_field_of_every_tool_has_a_slot() -> None:
    fields = {(spec.name, slot.path) for spec, slot in SLOTS}
    assert {("http", ("headers", "*")), ("http", ("headers", "X-Value")), ("http", ("body",))} <= fields
    assert {("code_interpreter", ("packages", 0)), ("code_interpreter", ("network", "allow", 0))} <= fields
    assert {("embeddings", ("input",)), ("embeddings", ("input", 0)), ("search", ("q",))} <= fields


@pytest.mark.parametrize(
    ("spec", "slot"), SLOTS, ids=[f"{spec.name}:{'.'.join(map(str, s.path))}" for spec, s in SLOTS]
)
@FUZZ
@given(text=lone_surrogates())
def test_a_lone_surrogate_in_any_string_field_is_a_422_naming_the_field(
    service_url: str, spec: Any, slot: Slot, text: str
) -> None:
    response = _post(service_url, HTTP_PATHS[spec.name], place(VALID[spec.name], slot.path, text))
    assert response.status_code == 422, response.text
    assert response.json()["details"][0]["field"].startswith(slot.field), response.text


@pytest.mark.parametrize(
    ("spec", "slot"), SLOTS, ids=[f"{spec.name}:{'.'.join(map(str, s.path))}" for spec, s in SLOTS]
)
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_an_over_long_string_in_any_field_is_refused_or_served_never_a_500(
    service_url: str, spec: Any, slot: Slot, data: st.DataObject
) -> None:
    text = data.draw(over_long(slot.max_length))
    response = _post(service_url, HTTP_PATHS[spec.name], place(VALID[spec.name], slot.path, text))
    if slot.max_length is not None:
        assert response.status_code == 422, response.text
        assert response.json()["details"][0]["field"].startswith(slot.field)
    else:
        # Served as far as this service can (no engine, no allowed host): a refusal, never a failure.
        assert response.status_code in (400, 413, 422, 503), response.text
        assert response.json()["error"]


def test_a_lone_surrogate_in_any_field_over_mcp_is_refused_as_unreadable_json(service_url: str) -> None:
    """The MCP SDK reads JSON-RPC with a strict parser: the call never reaches a tool, and the caller is
    told why (never "Internal error"). Sent raw, since the official client cannot send such text at all."""
    with httpx2.Client(base_url=service_url, headers=MCP_HEADERS, timeout=30) as client:
        opened = client.post("/mcp", json=INITIALIZE)
        session = {"mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
        client.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session)
        for spec, slot in ALL_SLOTS:
            arguments = place(VALID[spec.name], slot.path, "x\udfff")
            call = {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": spec.name, "arguments": arguments},
            }
            answer = client.post("/mcp", content=json.dumps(call), headers=session)
            assert answer.status_code == 400, (spec.name, slot.path, answer.text)
            assert "surrogate" in answer.json()["error"]["message"]
