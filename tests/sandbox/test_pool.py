"""The warm pool's correctness (not its speed, which bench/ measures): single use, limits, queue, refill,
a size that follows demand within a ceiling and a memory budget."""

from __future__ import annotations

import itertools
import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import anyio
import docker
import docker.errors
import httpx2
import pytest
from prometheus_client import REGISTRY

from metaagent.client import Client, Finished, Output
from metaagent.languages.container import container_spec
from metaagent.sandbox.engine import OWNER_PID_LABEL, ContainerSpec, Engine
from metaagent.sandbox.pool import PARALLEL_STARTS, Warm, WarmPool
from metaagent.sandbox.provision import SandboxImage
from metaagent.sandbox.runtime import RUNC, Runtime
from metaagent.sandbox.sizing import PoolLimits
from metaagent.tools.code_interpreter import CodeInterpreterResponse
from tests.sandbox.conftest import (
    Service,
    audit_record,
    code_runner,
    labelled_containers,
    metric_value,
    owned_containers,
    running_service,
    wait_for_warm_containers,
)

pytestmark = pytest.mark.docker

# Holds its execution slot until the test lets it end: it says on stderr that it is armed (its listener in
# place), then prints once the test sends its container SIGUSR2 (`_let_it_end`; the container's init passes it
# on to the runner). It runs as long as the test needs, not for a time that a busy machine may outlast.
GATED_PRINT = (
    "const keep = setInterval(() => {}, 1000);"
    " process.once('SIGUSR2', () => { clearInterval(keep); console.log('ok'); });"
    " console.error('armed');"
)


def _run_gated(service: Service, armed: threading.Event) -> CodeInterpreterResponse:
    """Runs GATED_PRINT, streamed so that `armed` is set as soon as it is; its answer once released."""
    stderr = ""
    with Client(service.base_url, timeout_s=180) as client:
        for event in client.stream_code(GATED_PRINT, timeout_s=120):
            if isinstance(event, Output) and event.stream == "stderr":
                stderr += event.text
                if "armed" in stderr:
                    armed.set()
            elif isinstance(event, Finished):
                return event.result
    raise AssertionError("the stream ended without a result")


def _let_it_end(client: docker.DockerClient, container_id: str) -> None:
    """Lets a running GATED_PRINT end."""
    client.containers.get(container_id).kill("SIGUSR2")


ONE = PoolLimits(floor=1, ceiling=1, memory_budget_mb=128)  # a fixed pool of one 128 MB container


def test_each_warm_container_serves_one_execution_and_is_gone_afterwards(
    sandbox_service: Service, docker_client: docker.DockerClient
) -> None:
    run = code_runner(sandbox_service, "warm")  # asserts that each execution took a warm container
    results = [run("console.log(1)") for _ in range(5)]
    containers = [audit_record(sandbox_service, r.execution_id)["container_id"] for r in results]
    assert len(set(containers)) == len(containers)
    for container_id in containers:
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(container_id)


def test_the_pool_reports_what_its_starts_cost_and_the_pace_of_starts_this_machine_sustains(
    sandbox_service: Service,
) -> None:
    starts = wait_for_warm_containers(sandbox_service)["starts"]
    assert starts["measured"] >= 1
    assert starts["wall_ms"] > 0
    assert starts["cpu_ms"] > 0  # the container's own CPU to its ready line, from its cgroup
    by_wall, by_cpu = PARALLEL_STARTS / (starts["wall_ms"] / 1000), (os.cpu_count() or 1) / (starts["cpu_ms"] / 1000)
    assert starts["per_second"] == pytest.approx(min(by_wall, by_cpu), rel=0.01)
    gauge = 'metaagent_pool_starts_per_second{language="javascript"}'
    assert metric_value(sandbox_service, gauge) > 0


def test_a_warm_execution_gets_its_whole_timeout_however_long_the_container_waited(sandbox_service: Service) -> None:
    # A timeout counted from the container's start would have run out before the code came (the wait
    # below is longer), so the program's 500 ms timer would never fire; counted from the code's hand-over,
    # the program has 4.5 s to spare for a busy machine.
    timeout_s = 5
    wait_for_warm_containers(sandbox_service)
    time.sleep(timeout_s + 1)  # the ready containers have now waited longer than the whole timeout below
    result = code_runner(sandbox_service, "warm")("setTimeout(() => console.log('in time'), 500)", timeout_s=timeout_s)
    assert result.timed_out is False
    assert result.stdout == "in time\n"


@pytest.mark.security
def test_a_warm_container_has_the_cold_ones_security_context(sandbox_service: Service, cold_service: Service) -> None:
    warm = code_runner(sandbox_service, "warm")("console.log(1)")
    cold = code_runner(cold_service, "cold")("console.log(1)")
    warm_record, cold_record = (
        audit_record(sandbox_service, warm.execution_id),
        audit_record(cold_service, cold.execution_id),
    )
    assert warm_record["security"] == cold_record["security"]
    assert warm_record["limits"] == cold_record["limits"]


def test_the_queue_answers_429_when_full_and_serves_everything_it_accepted(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    settings = {"METAAGENT_MAX_CONCURRENT_EXECUTIONS": "1", "METAAGENT_EXECUTION_QUEUE_SIZE": "2"}
    queued_timeout_s = 3
    with running_service(tmp_path, **settings) as service, ThreadPoolExecutor(6) as threads:

        def post(body: dict[str, object]) -> httpx2.Response:
            return service.post("/tools/code-interpreter", body)

        # The first holds the one slot until the test releases it, so the five after it find the slot
        # busy however slow the machine is (a timer in the program raced their arrival).
        armed = threading.Event()
        first = threads.submit(_run_gated, service, armed)
        deadline = time.monotonic() + 120
        while not armed.wait(0.1):
            assert not first.done(), first.result()  # its answer came before it was armed: it failed
            assert time.monotonic() < deadline, "the first execution never said it was armed"
        (running,) = service.get("/executions").json()["executions"]
        rest = [threads.submit(post, {"code": "console.log('ok')", "timeout_s": queued_timeout_s}) for _ in range(5)]
        # Two wait in the queue; the three refused answer at once. A refusal means the queue was full, so once
        # one has come back both queued ones are waiting: they then wait longer than their whole timeout.
        answered = as_completed(rest, timeout=120)
        refused = [next(answered).result() for _ in range(3)]
        time.sleep(queued_timeout_s + 1)
        _let_it_end(docker_client, running["container_id"])
        first_answer = first.result(timeout=120)
        served = [r.json() for f in rest if (r := f.result()).status_code == 200]
    assert (first_answer.stdout, first_answer.timed_out) == ("ok\n", False), first_answer
    assert [r.status_code for r in refused] == [429] * 3, [r.text for r in refused]
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"].startswith("At capacity")
    assert len(served) == 2  # the two queued (the first was the third accepted)
    for body in served:
        assert body["stdout"] == "ok\n", body
        # Each waited in the queue longer than its whole timeout: had that counted, it timed out.
        assert body["timed_out"] is False, body
        assert body["queued_ms"] > queued_timeout_s * 1000, body


def test_the_pool_refills_after_a_burst_and_is_emptied_at_shutdown(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    with running_service(tmp_path, METAAGENT_POOL_SIZE="2", METAAGENT_POOL_MIN="2") as service:
        wait_for_warm_containers(service, 2)
        with ThreadPoolExecutor(4) as threads:
            body = {"code": "console.log('burst')", "timeout_s": 5}
            responses = list(threads.map(lambda _: service.post("/tools/code-interpreter", body), range(4)))
        assert [r.status_code for r in responses] == [200] * 4
        paths = [audit_record(service, r.json()["execution_id"])["container_path"] for r in responses]
        assert paths.count("warm") >= 2  # the two that were ready were used
        pool = wait_for_warm_containers(service, 2)
        assert (pool["size"], pool["floor"], pool["ceiling"]) == (2, 2, 2)
        metrics = service.get("/metrics").text
        assert 'metaagent_pool_containers{language="javascript"} 2.0' in metrics
        assert 'metaagent_pool_target{language="javascript"} 2.0' in metrics
        assert pool["served"] == paths.count("warm")
        assert len(owned_containers(docker_client, service.pid)) == 2  # just the refilled pool: nothing left over

        service.process.send_signal(signal.SIGTERM)
        assert service.process.wait(timeout=60) == 0
        assert owned_containers(docker_client, service.pid) == []


def test_no_pool_when_it_is_off(tmp_path: Path, docker_client: docker.DockerClient) -> None:
    with running_service(tmp_path, METAAGENT_POOL_ENABLED="false") as service:
        result = code_runner(service, "cold")("console.log('cold')")
        pool = service.get("/health").json()["checks"]["warm_pool"]
        assert result.stdout == "cold\n"
        off = {"ok": True, "floor": 0, "ceiling": 0, "memory_budget_mb": 0, "ready": 0, "size": 0, "served": 0}
        off["starts"] = None  # no start yet: nothing to tell of what one costs
        assert pool == {**off, "languages": {"javascript": off}}
        assert owned_containers(docker_client, service.pid) == []


def _start_retries() -> float:
    return REGISTRY.get_sample_value("metaagent_pool_start_retries_total", {"language": "javascript"}) or 0.0


def test_a_warm_container_whose_runner_dies_at_start_is_counted_and_another_started(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    """A crash at start (here node aborting before the runner's ready line, as V8 can at start-up) is
    retried in the pool, before any code exists: never lent to an execution, counted in /metrics."""
    crash = ["/usr/bin/node", "-e", "process.abort()"]

    async def go() -> tuple[float, int, bool]:
        engine = Engine()
        image = SandboxImage(engine, tag=None, cache_dir=tmp_path)

        async def crashing(execution_id: str, tag: str) -> ContainerSpec:
            return container_spec(execution_id, tag, 128, 0.5, command=crash, runtime=sandbox_runtime)

        pool = WarmPool(engine, image, limits=ONE, memory_mb=128, make_spec=crashing)
        before = _start_retries()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):  # a bound: two starts on a loaded machine
                    while _start_retries() < before + 2:  # noqa: ASYNC110 - a Prometheus counter has no event to wait on
                        await anyio.sleep(0.05)
                lent = pool.take(image.tag) is not None
                pool.close()
            return _start_retries() - before, pool.ready, lent
        finally:
            engine.close()

    retries, ready, lent = anyio.run(go)
    assert retries >= 2  # the pool went on starting containers after the first crash
    assert (ready, lent) == (0, False)
    assert owned_containers(docker_client, os.getpid()) == []  # no crashed container left behind


def test_a_warm_runner_that_dies_while_it_waits_is_never_lent_and_its_end_is_logged(
    sandbox_runtime: Runtime, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Ready, then dead before any code comes: the pool must notice at the take and say how it ended.
    program = "process.stderr.write('metaagent-runner: ready\\n'); console.error('bye'); process.exit(7)"
    dies = ["/usr/bin/node", "-e", program]

    async def go() -> tuple[bool, float]:
        engine = Engine()
        image = SandboxImage(engine, tag=None, cache_dir=tmp_path)

        async def dying(execution_id: str, tag: str) -> ContainerSpec:
            return container_spec(execution_id, tag, 128, 0.5, command=dies, runtime=sandbox_runtime)

        pool = WarmPool(engine, image, limits=ONE, memory_mb=128, make_spec=dying)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):  # a bound: one start on a loaded machine
                    while pool.ready < 1:  # noqa: ASYNC110 - the pool has no event for this
                        await anyio.sleep(0.05)
                    # The take must come after the death, however slow the machine: wait until the engine
                    # says the container exited, and until its end has reached the attach socket (EOF or
                    # more output makes it readable), the only sign the take reads.
                    waiting = pool._ready[0].prepared
                    assert await engine.wait(waiting.container_id) == 7
                    ended = select.poll()
                    ended.register(waiting.sock, select.POLLIN)
                    while not ended.poll(0):  # noqa: ASYNC110 - a socket's readability, without reading it
                        await anyio.sleep(0.05)
                    before = _start_retries()
                    lent = pool.take(image.tag) is not None
                    while "ended while it waited" not in caplog.text:  # noqa: ASYNC110 - a log line
                        await anyio.sleep(0.05)
                pool.close()
            return lent, _start_retries() - before
        finally:
            engine.close()

    with caplog.at_level("WARNING", logger="metaagent.pool"):
        lent, counted = anyio.run(go)
    assert (lent, counted) == (False, 1)
    line = next(r.getMessage() for r in caplog.records if "ended while it waited" in r.getMessage())
    assert "exit 7" in line
    assert "bye" in line


def _runner_pool(
    engine: Engine, tmp_path: Path, runtime: Runtime, limits: PoolLimits = ONE, **sizing: float
) -> WarmPool:
    image = SandboxImage(engine, tag=None, cache_dir=tmp_path)

    async def spec(execution_id: str, tag: str) -> ContainerSpec:
        return container_spec(execution_id, tag, 128, 0.5, runtime=runtime)

    return WarmPool(engine, image, limits=limits, memory_mb=128, make_spec=spec, **sizing)


@pytest.mark.usefixtures("sandbox_service")  # only so that the image is there
def test_an_execution_that_finds_the_pool_empty_takes_the_container_starting_for_it(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    async def go() -> tuple[str, str | None, int]:
        engine = Engine()
        pool = _runner_pool(engine, tmp_path, sandbox_runtime)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):  # a bound: starts on a loaded machine
                    while pool.ready < 1:  # noqa: ASYNC110 - the pool has no event for this
                        await anyio.sleep(0.05)
                tag = pool.image.tag
                assert tag is not None
                first = pool.take(tag)
                assert first is not None
                pool.finished()  # the first execution ended: its replacement starts now
                while pool._starting < 1:  # noqa: ASYNC110 - the pool's loop begins that start
                    await anyio.sleep(0.01)
                assert pool.ready == 0
                second = await pool.take_or_wait(tag)  # the pool is empty: this waits for that start
                served = pool.served
                for warm in (first, second):
                    if warm is not None:
                        warm.prepared.sock.close()
                        await engine.remove(warm.prepared.container_id)
                pool.close()
            return first.execution_id, second.execution_id if second else None, served
        finally:
            engine.close()

    first, second, served = anyio.run(go)
    assert second is not None  # not the cold path
    assert second != first  # a fresh container, never the same one twice
    assert served == 2
    assert owned_containers(docker_client, os.getpid()) == []


@pytest.mark.usefixtures("sandbox_service")
def test_a_pool_that_closes_sends_its_waiting_executions_to_the_cold_path(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    async def go() -> tuple[bool, int]:
        engine = Engine()
        pool = _runner_pool(engine, tmp_path, sandbox_runtime)
        result: list[bool] = []
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                with anyio.fail_after(120):
                    while pool._starting < 1:  # noqa: ASYNC110 - the first start is in flight
                        await anyio.sleep(0.01)

                    async def wait() -> None:
                        result.append(await pool.take_or_wait(await pool.image.require()) is None)

                    group.start_soon(wait)
                    while not pool._takers:  # noqa: ASYNC110 - the execution waits now
                        await anyio.sleep(0.01)
                    pool.close()
            return result[0], pool.served
        finally:
            engine.close()

    went_cold, served = anyio.run(go)
    assert (went_cold, served) == (True, 0)
    assert owned_containers(docker_client, os.getpid()) == []


async def _release(engine: Engine, pool: WarmPool, warm: Warm) -> None:
    """What an execution does with a taken container once it ends: removes it, then tells the pool."""
    warm.prepared.sock.close()
    await engine.remove(warm.prepared.container_id)
    pool.finished()


async def _settled(pool: WarmPool) -> None:
    """Until the pool holds its target, with nothing starting or being removed (the caller bounds the wait)."""
    while pool._starting or pool._removing or pool.ready + pool._lent != pool.size:  # noqa: ASYNC110 - no event for this
        await anyio.sleep(0.02)


async def _hold(pool: WarmPool, tag: str, held: list[Warm], count: int, taken: set[str] | None = None) -> None:
    """Takes containers until `held` has `count`, asking again after a miss (a cold start, in the service)."""
    while len(held) < count:
        warm = await pool.take_or_wait(tag)
        if warm is None:
            await anyio.sleep(0.05)
            continue
        if taken is not None:
            taken.add(warm.prepared.container_id)
        held.append(warm)


@pytest.mark.usefixtures("sandbox_service")  # only so that the image is there
def test_concurrent_takers_are_never_handed_the_same_container_twice(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    wanted = 16

    async def go() -> tuple[list[str], list[str], int]:
        engine = Engine()
        pool = _runner_pool(engine, tmp_path, sandbox_runtime, PoolLimits(floor=2, ceiling=4, memory_budget_mb=512))
        handed: list[str] = []
        executions: list[str] = []
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                tag = await pool.image.require()

                async def taker(waits: bool) -> None:
                    while len(handed) < wanted:
                        warm = await pool.take_or_wait(tag) if waits else pool.take(tag)
                        if warm is None:
                            await anyio.sleep(0.02)
                            continue
                        handed.append(warm.prepared.container_id)
                        executions.append(warm.execution_id)
                        await _release(engine, pool, warm)

                with anyio.fail_after(600):  # a bound: 16 starts or more on a loaded machine
                    async with anyio.create_task_group() as takers:
                        for n in range(12):
                            takers.start_soon(taker, n % 2 == 0)
                pool.close()
            return handed, executions, pool.served
        finally:
            engine.close()

    handed, executions, served = anyio.run(go)
    assert len(handed) >= wanted
    assert len(set(handed)) == len(handed)  # each container handed out once
    assert len(set(executions)) == len(executions)
    assert served == len(handed)
    assert owned_containers(docker_client, os.getpid()) == []


@pytest.mark.usefixtures("sandbox_service")
def test_the_pool_never_holds_more_than_its_ceiling_nor_idle_containers_past_its_memory_budget(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    """A ceiling of 4 and a budget that holds 2 idle 128 MB containers: the engine's own list of this
    process's containers, sampled through a burst, never shows more than 4 in all nor more than 2 that no
    taker was handed. At rest both bounds bind: 2 idle where the ceiling allows 4, and 4 lent where the
    budget alone would let 2 more start."""
    ceiling, idle_max = 4, 2
    limits = PoolLimits(floor=1, ceiling=ceiling, memory_budget_mb=idle_max * 128 + 64)
    label = f"{OWNER_PID_LABEL}={os.getpid()}"
    samples: list[tuple[int, int]] = []  # (all the pool's containers, those no taker was handed)

    async def go() -> tuple[int, int, int, int, bool]:
        engine = Engine()
        pool = _runner_pool(engine, tmp_path, sandbox_runtime, limits, decay_s=3600)  # no decay in this test
        taken: set[str] = set()
        stop = anyio.Event()

        async def sample() -> None:
            while not stop.is_set():
                listed = set(await anyio.to_thread.run_sync(labelled_containers, docker_client, label))
                samples.append((len(listed), len(listed - taken)))  # `taken` read after the listing
                await anyio.sleep(0.02)

        async def burst_taker() -> None:
            for _ in range(4):
                held: list[Warm] = []
                await _hold(pool, tag, held, 1, taken)
                await anyio.sleep(0.1)  # an execution runs; others take meanwhile
                await _release(engine, pool, held[0])

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                group.start_soon(sample)
                tag = await pool.image.require()
                with anyio.fail_after(600):  # a bound: a few dozen starts on a loaded machine
                    async with anyio.create_task_group() as takers:
                        for _ in range(6):
                            takers.start_soon(burst_taker)
                    await _settled(pool)
                    at_rest = len(await anyio.to_thread.run_sync(labelled_containers, docker_client, label))
                    idle, size = pool.ready, pool.size
                    held: list[Warm] = []
                    await _hold(pool, tag, held, ceiling, taken)
                    await _settled(pool)
                    all_lent = len(await anyio.to_thread.run_sync(labelled_containers, docker_client, label))
                    one_more = pool.take(tag) is None
                    for warm in held:
                        await _release(engine, pool, warm)
                stop.set()
                pool.close()
            return at_rest, idle, size, all_lent, one_more
        finally:
            engine.close()

    at_rest, idle, size, all_lent, one_more = anyio.run(go)
    assert (at_rest, idle, size) == (idle_max, idle_max, idle_max)  # the budget binds, below the ceiling
    assert (all_lent, one_more) == (ceiling, True)  # the ceiling binds, lent ones included
    assert samples
    assert max(total for total, _ in samples) <= ceiling
    assert max(untaken for _, untaken in samples) <= idle_max
    assert owned_containers(docker_client, os.getpid()) == []


class _Clock:
    """The pool's sizing clock, moved by the test: nothing decays until the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.usefixtures("sandbox_service")
def test_the_pool_grows_with_demand_and_shrinks_back_to_its_floor_one_step_at_a_time_when_demand_stops(
    sandbox_runtime: Runtime, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    limits = PoolLimits(floor=1, ceiling=3, memory_budget_mb=3 * 128)
    label = f"{OWNER_PID_LABEL}={os.getpid()}"
    clock = _Clock()

    async def go() -> tuple[int, int, list[tuple[int, int, int]]]:
        engine = Engine()
        # The window (0.5, or what a start took) ends within a few decay steps (1.0) of the clock; the pool
        # looks again each second.
        pool = _runner_pool(engine, tmp_path, sandbox_runtime, limits, window_s=0.5, decay_s=1.0, clock=clock)

        async def level() -> tuple[int, int, int]:
            await _settled(pool)
            containers = await anyio.to_thread.run_sync(labelled_containers, docker_client, label)
            return pool.size, pool.ready, len(containers)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(pool.run)
                tag = await pool.image.require()
                with anyio.fail_after(600):  # a bound: starts on a loaded machine
                    await _settled(pool)
                    before = pool.size
                    held: list[Warm] = []
                    await _hold(pool, tag, held, 3)  # demand: three executions at once
                    grown = pool.size
                    for warm in held:
                        await _release(engine, pool, warm)
                    levels = [await level()]  # the level holds while the clock stands: refilled to 3
                    while levels[-1][0] > limits.floor:
                        clock.now += 1.0  # one decay step with no demand
                        levels.append(await level())
                pool.close()
            return before, grown, levels
        finally:
            engine.close()

    before, grown, levels = anyio.run(go)
    assert (before, grown) == (1, 3)
    # (target, ready, the engine's count): each step removes an idle container, down to the floor. The
    # pool counts demand over at least the time its starts took (real seconds, here the clock's steps),
    # so the level may hold for a step or two before it falls.
    targets = [target for target, _, _ in levels]
    assert all(level == (target, target, target) for level, target in zip(levels, targets, strict=True))
    assert sorted(set(targets), reverse=True) == [3, 2, 1]
    assert all(0 <= earlier - later <= 1 for earlier, later in itertools.pairwise(targets))
    assert targets.count(2) == 1
    assert owned_containers(docker_client, os.getpid()) == []


@pytest.mark.parametrize(("start_s", "left"), [(None, 2), (2.0, 3)])
def test_demand_is_counted_over_at_least_the_time_a_start_takes_on_this_machine(
    start_s: float | None, left: int, tmp_path: Path
) -> None:
    """Pure logic: the pool is never run (no container starts; a start's cost is recorded by hand)."""
    clock = _Clock()
    engine = Engine()
    try:
        pool = _runner_pool(engine, tmp_path, RUNC, PoolLimits(1, 8, 1024), window_s=1.0, decay_s=1.0, clock=clock)
        if start_s is not None:
            pool.record_start(start_s, None)
        for _ in range(3):
            assert pool.take("any") is None  # empty: three executions go cold, a demand of three
        assert pool.size == 3
        clock.now += 1.5  # one decay step; the three are past a 1 s window, within a 2 s one
        assert pool.size == left
    finally:
        engine.close()
