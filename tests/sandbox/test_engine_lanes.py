"""Every engine call has its own deadline and a lane of threads sized for its purpose (issue 22, item 4):
kills and removals never queue behind blocked calls, and an engine that does not answer costs a call its
deadline, with an error that names the call.

The engine is made slow only on a private dockerd (tests/sandbox/private_engine.py), never the shared one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import anyio
import docker
import pytest

from metaagent.executions import new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import image_tag
from metaagent.sandbox.engine import (
    CALLS,
    CONTROL,
    OWNER_PID_LABEL,
    SERVICE_LABEL,
    WIRE_VOLUME_PREFIX,
    ContainerSpec,
    Engine,
    EngineTimeout,
    EngineUnavailable,
)
from tests.sandbox.private_engine import PrivateEngine, private_engine

pytestmark = [pytest.mark.docker]

# Failsafes only: far above a deadline under test, far below docker-py's 60 s socket timeout that a
# call without a deadline of its own used to wait.
FAILSAFE_S = 45


@pytest.fixture
def engine() -> Iterator[PrivateEngine]:
    with private_engine() as started:
        yield started


@pytest.mark.slow
async def test_a_call_the_engine_never_answers_is_abandoned_at_its_deadline_with_an_error_naming_it(
    engine: PrivateEngine,
) -> None:
    driver = Engine(engine.url, lanes=(replace(CONTROL, deadline_s=1.0), replace(CALLS, deadline_s=1.0)))
    assert engine.process is not None
    try:
        await driver.ping()  # it answers while it runs
        with engine.hung(), anyio.fail_after(FAILSAFE_S):  # it accepts and never answers
            with pytest.raises(EngineTimeout, match=r"did not answer \(kill\) within 1 s"):
                await driver.kill("0" * 64, "SIGKILL")
            with pytest.raises(EngineTimeout, match=r"did not answer \(remove\) within 1 s"):
                await driver.remove("0" * 64)
            with pytest.raises(EngineTimeout, match=r"did not answer \(inspect_container\) within 1 s"):
                await driver.state("0" * 64)
        with anyio.fail_after(FAILSAFE_S):
            await driver.ping()  # the lanes' threads came back: the engine is served again
    finally:
        driver.close()


async def test_kills_and_removals_do_not_queue_behind_calls_that_hold_every_thread_of_their_lane(
    docker_client: docker.DockerClient,
) -> None:
    def sleeper(name: str) -> str:
        container = docker_client.containers.run(
            image_tag(),
            ["/usr/bin/node", "-e", "setTimeout(() => {}, 600000)"],
            name=f"metaagent-lanes-{name}-{os.getpid()}",
            detach=True,
            network_disabled=True,
        )
        return str(container.id)

    blocker, victim = sleeper("blocker"), sleeper("victim")
    driver = Engine(lanes=(replace(CALLS, threads=2),))
    try:
        done: list[str] = []

        async def hold_a_thread() -> None:  # a call of the CALLS lane that blocks until `blocker` exits
            await driver._run(driver.api.wait, blocker, timeout=None)
            done.append("wait")

        async def inspect_behind_them() -> None:
            await driver.state(blocker)
            done.append("inspect")

        with anyio.fail_after(FAILSAFE_S):
            async with anyio.create_task_group() as group:
                group.start_soon(hold_a_thread)
                group.start_soon(hold_a_thread)
                await anyio.sleep(0.5)
                group.start_soon(inspect_behind_them)  # queued: its lane has no thread free
                await driver.kill(victim, "SIGKILL")
                await driver.remove(victim)
                assert done == []  # the kill and the removal went through while the CALLS lane was full
                assert victim not in [c.id for c in docker_client.containers.list(all=True, sparse=True)]
                await driver.kill(blocker, "SIGKILL")  # the waits return, then the queued inspect runs
        assert sorted(done) == ["inspect", "wait", "wait"]
    finally:
        driver.close()
        for container_id in (blocker, victim):
            with contextlib.suppress(docker.errors.NotFound):
                docker_client.api.remove_container(container_id, force=True)


async def test_the_last_step_of_a_shutdown_removes_what_its_engine_made_and_nothing_of_another_engine(
    docker_client: docker.DockerClient,
) -> None:
    """A removal abandoned on the way out (a busy engine past its lane's deadline) left a container that
    nothing removed until the next start: `remove_owned` finds every container and volume its own Engine
    made, whatever its owner still knows of them, and leaves another service's in the same process alone."""
    ours, theirs = Engine(), Engine()
    labels = {SERVICE_LABEL: "metaagent", OWNER_PID_LABEL: str(os.getpid())}  # as every execution's carry

    async def forgotten_container(engine: Engine) -> str:
        spec = container_spec(new_execution_id(), image_tag(), 64, 0.5, command=["/usr/bin/node", "-e", "0"])
        return await engine.create(spec)

    made = [await forgotten_container(ours), await forgotten_container(ours)]
    volume = f"metaagent-owned-test-{new_execution_id()}"
    await ours.create_volume(volume, labels)
    other = await forgotten_container(theirs)
    try:
        with anyio.fail_after(FAILSAFE_S):
            assert await ours.remove_owned(within_s=30) == 4  # its two containers, the volume, its wire volume
        left = {c.id for c in docker_client.containers.list(all=True, sparse=True)}
        assert left.isdisjoint(made)
        assert other in left
        volumes = [v.name for v in docker_client.volumes.list()]
        assert volume not in volumes
        assert ours.wire_volume not in volumes
        assert theirs.wire_volume in volumes
        assert await ours.remove_owned(within_s=30) == 0  # nothing more of its own
    finally:
        await theirs.remove(other)
        ours.close()
        theirs.close()


def _spec_named(name: str) -> ContainerSpec:
    return replace(
        container_spec(new_execution_id(), image_tag(), 64, 0.5, command=["/usr/bin/node", "-e", "0"]), name=name
    )


async def test_a_create_that_a_shutdown_overtakes_leaves_neither_its_container_nor_a_wire_volume(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shutdown's `close` removes the wire volume while a create is on its way to the engine: the engine
    then makes the volume again for the new container's mount, with no labels, so that no sweep would ever
    find it. The create undoes both and fails as a create after `close` does."""
    engine = Engine()
    await engine.wire_folder()
    name = f"metaagent-overtaken-{new_execution_id()}"
    real_create = engine._create_container

    def overtaken(spec: ContainerSpec, host_config: dict[str, Any]) -> dict[str, Any]:
        engine.close()  # the shutdown's last step, between the create's check and its engine call
        return real_create(spec, host_config)

    monkeypatch.setattr(engine, "_create_container", overtaken)
    try:
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await engine.create(_spec_named(name))
        assert docker_client.containers.list(all=True, sparse=True, filters={"name": name}) == []
        assert engine.wire_volume not in [v.name for v in docker_client.volumes.list()]
        with pytest.raises(EngineUnavailable, match="shutting down"):  # and any create after it
            await engine.create(_spec_named(name))
        assert docker_client.containers.list(all=True, sparse=True, filters={"name": name}) == []
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.api.remove_container(name, force=True)
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.api.remove_volume(engine.wire_volume)


def test_an_unlabelled_wire_volume_is_an_orphans_once_the_process_its_name_gives_is_gone(
    docker_client: docker.DockerClient,
) -> None:
    """What a create overtaken by a shutdown left before the create undid it: a wire volume with no labels.
    The start's orphan sweep reads the owner's pid from the name; a live owner's volume is kept."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    gone = f"{WIRE_VOLUME_PREFIX}{ended.pid}-{secrets.token_hex(6)}"
    alive = f"{WIRE_VOLUME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    for name in (gone, alive):
        docker_client.api.create_volume(name=name, driver="local")
    engine = Engine()
    try:
        anyio.run(engine.remove_orphans)
        volumes = [v.name for v in docker_client.volumes.list()]
        assert gone not in volumes
        assert alive in volumes
    finally:
        engine.close()
        for name in (gone, alive):
            with contextlib.suppress(docker.errors.NotFound):
                docker_client.api.remove_volume(name)
