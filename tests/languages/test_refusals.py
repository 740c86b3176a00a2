"""What a language does not support is a 400 that says what to do, before anything starts: over HTTP for
one-shot runs and sessions alike, and over MCP as a tool error; a language the settings leave out is a
400 naming the setting. The service runs in-process; no container starts (none of these gets that far)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from metaagent.app import create_app
from metaagent.languages import PYTHON
from tests.conftest import ServiceFactory, make_settings

TIMEOUT_S = 60
# Each request Python refuses, and how its refusal begins.
PYTHON_REFUSALS = [
    pytest.param({"packages": ["lodash"]}, "packages are npm packages, for JavaScript only; ", id="packages"),
    pytest.param(
        {"memory_mb": PYTHON.min_memory_mb - 64},
        f"memory_mb {PYTHON.min_memory_mb - 64} is below Python 3.11's minimum of {PYTHON.min_memory_mb} MiB",
        id="memory",
    ),
]
# Python served beside JavaScript; no warm pool: each refusal comes before anything would start.
PYTHON_SERVED: dict[str, Any] = {
    "allow_http_hosts": '["api.example.com"]',
    "languages": ("javascript", "python"),
    "pool_enabled": False,
}
DISABLED = "Language 'python' is not served here (METAAGENT_LANGUAGES=javascript); use javascript (Node.js 18)"


@pytest.mark.parametrize(("fields", "refusal"), PYTHON_REFUSALS)
async def test_a_one_shot_python_run_is_refused_with_a_400_for_what_python_does_not_support(
    service: ServiceFactory, fields: dict[str, Any], refusal: str
) -> None:
    async with service(**PYTHON_SERVED) as client:
        response = await client.post(
            "/tools/code-interpreter", json={"code": "print(1)", "language": "python", **fields}
        )
    assert response.status_code == 400
    assert response.json()["error"].startswith(refusal)


@pytest.mark.parametrize(("fields", "refusal"), PYTHON_REFUSALS)
async def test_a_python_session_is_refused_with_a_400_for_what_python_does_not_support(
    service: ServiceFactory, fields: dict[str, Any], refusal: str
) -> None:
    async with service(**PYTHON_SERVED) as client:
        response = await client.post("/sessions", json={"language": "python", **fields})
        listed = (await client.get("/sessions")).json()
    assert response.status_code == 400
    assert response.json()["error"].startswith(refusal)
    assert listed == {"sessions": []}


@pytest.mark.parametrize(("fields", "refusal"), PYTHON_REFUSALS)
async def test_over_mcp_pythons_refusals_are_tool_errors_with_the_same_message(
    tmp_path: Path, fields: dict[str, Any], refusal: str
) -> None:
    app = create_app(make_settings(tmp_path, **PYTHON_SERVED))
    with anyio.fail_after(TIMEOUT_S):
        async with app.router.lifespan_context(app), Client(app.state.mcp_server) as client:
            one_shot = await client.call_tool("code_interpreter", {"code": "print(1)", "language": "python", **fields})
            session = await client.call_tool("session_create", {"language": "python", **fields})
    for result in (one_shot, session):
        assert result.is_error is True
        assert getattr(result.content[0], "text", "").startswith(refusal)


async def test_a_language_the_settings_leave_out_is_a_400_naming_the_setting(service: ServiceFactory) -> None:
    async with service(languages=("javascript",)) as client:
        one_shot = await client.post("/tools/code-interpreter", json={"code": "print(1)", "language": "python"})
        session = await client.post("/sessions", json={"language": "python"})
        health = (await client.get("/health")).json()
    for response in (one_shot, session):
        assert response.status_code == 400
        assert response.json()["error"].startswith(DISABLED)
    assert set(health["checks"]["sandbox_image"]["languages"]) == {"javascript"}
