"""`/health` says `starting` (503, to every caller) until each start-up check has run once, and never
reports a check as failed, nor the service as ok, before it has run (issue 23, item 3). The check is
held, not raced: the image look-up waits for the test to let it go, then runs for real. With two served
languages, every image is a check of its own (issue 24): JavaScript's fields stay where they were."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from metaagent.app import create_app
from metaagent.languages import JAVASCRIPT, PYTHON
from metaagent.sandbox.provision import SandboxImage
from tests.conftest import make_settings

pytestmark = pytest.mark.docker

KEY = "k" * 32
TIMEOUT_S = 240  # auto's runsc self-test runs a container: bounded, not timed


@asynccontextmanager
async def held_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> AsyncIterator[tuple[httpx2.AsyncClient, anyio.Event]]:
    """The app started, its image look-up waiting for the event the test sets."""
    release = anyio.Event()
    refresh = SandboxImage.refresh

    async def held_refresh(self: SandboxImage, *, build: bool) -> None:
        await release.wait()
        await refresh(self, build=build)

    monkeypatch.setattr(SandboxImage, "refresh", held_refresh)
    app = create_app(make_settings(tmp_path, pool_enabled=False, **overrides))
    async with app.router.lifespan_context(app):
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1:3102") as client:
            yield client, release


async def until_started(client: httpx2.AsyncClient, headers: dict[str, str] | None = None) -> httpx2.Response:
    while True:
        response = await client.get("/health", headers=headers)
        if response.json()["status"] != "starting":
            return response
        await anyio.sleep(0.05)


async def test_health_is_503_starting_until_the_image_has_been_looked_for_then_200(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with held_start(tmp_path, monkeypatch, languages=("javascript",)) as (client, release):
            for _ in range(3):  # however often it is asked
                starting = await client.get("/health")
                assert starting.status_code == 503
                assert starting.json() == {"status": "starting"}
            release.set()
            started = await until_started(client)
    assert started.status_code == 200
    body = started.json()
    assert body["checks"]["sandbox_image"]["ok"] is True  # the image is there: never reported missing
    assert body["checks"]["container_engine"]["runtime"] in ("runc", "runsc")
    assert body["status"] == "ok"


async def test_health_says_only_starting_to_every_caller_with_api_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with anyio.fail_after(TIMEOUT_S):
        async with held_start(tmp_path, monkeypatch, api_keys=f"ops:{KEY}:admin") as (client, release):
            anonymous = await client.get("/health")
            operator = await client.get("/health", headers=headers)
            release.set()
            started = await until_started(client, headers)
    assert (anonymous.status_code, anonymous.json()) == (503, {"status": "starting"})
    assert (operator.status_code, operator.json()) == (503, {"status": "starting"})
    assert started.status_code == 200
    assert "checks" in started.json()


# docker-py's unix connection leaves the socket of a connect that failed (no engine) to the collector.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_an_engine_that_is_down_at_start_ends_starting_as_degraded_not_a_service_stuck_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with anyio.fail_after(TIMEOUT_S):
        async with held_start(tmp_path, monkeypatch) as (client, release):
            assert (await client.get("/health")).status_code == 503
            release.set()
            started = await until_started(client)
    gc.collect()  # here, under this test's filter: not in whichever test of this worker runs next
    body = started.json()
    assert started.status_code == 200
    assert body["status"] == "degraded"
    assert body["checks"]["container_engine"]["ok"] is False
    assert body["checks"]["sandbox_image"]["ok"] is False  # looked for, and the engine did not answer
    assert body["checks"]["container_engine"]["runtime_reason"].startswith("not chosen yet")


async def test_with_two_languages_health_starts_once_both_images_were_looked_for_and_javascript_runs_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's look-up is held (and made to find no image) while JavaScript's runs at once."""
    python_release = anyio.Event()
    refresh = SandboxImage.refresh

    async def held_refresh(self: SandboxImage, *, build: bool) -> None:
        if self.language is PYTHON:
            await python_release.wait()
            self.tag = "metaagent-sandbox-python:absent-for-this-test"
        await refresh(self, build=build)

    monkeypatch.setattr(SandboxImage, "refresh", held_refresh)
    app = create_app(make_settings(tmp_path, pool_enabled=False, languages=("javascript", "python")))
    with anyio.fail_after(TIMEOUT_S):
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1:3102") as client:
                interpreter = app.state.services.interpreter
                # Polled: JavaScript's checks set no event the test could wait on.
                while not (interpreter.javascript.image.checked and interpreter.runtime.has_run):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
                starting = await client.get("/health")
                javascript = await client.post("/tools/code-interpreter", json={"code": "console.log(1)"})
                python_release.set()
                started = await until_started(client)
                python = await client.post("/tools/code-interpreter", json={"code": "print(1)", "language": "python"})
    assert (starting.status_code, starting.json()) == (503, {"status": "starting"})
    assert (javascript.status_code, javascript.json()["stdout"]) == (200, "1\n")
    assert python.status_code == 503
    assert "metaagent-sandbox-python:absent-for-this-test is missing" in python.json()["error"]
    body = started.json()
    assert (started.status_code, body["status"]) == (200, "degraded")  # Python's requests answer 503
    image = body["checks"]["sandbox_image"]
    assert image["ok"] is True  # JavaScript's, where it always was
    assert image["tag"] == JAVASCRIPT.image_tag()
    assert image["languages"]["javascript"] == {key: value for key, value in image.items() if key != "languages"}
    assert image["languages"]["python"]["ok"] is False
    assert image["languages"]["python"]["tag"] == "metaagent-sandbox-python:absent-for-this-test"
    assert "metaagent sandbox build" in image["languages"]["python"]["error"]
    pools = body["checks"]["warm_pool"]
    assert set(pools["languages"]) == {"javascript", "python"}
    assert pools["languages"]["javascript"] == {key: value for key, value in pools.items() if key != "languages"}
