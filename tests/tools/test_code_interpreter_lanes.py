"""The code interpreter's lanes: one image and one warm pool per served language, and every execution
goes through its request's lane (its image, its pool, its runner). No container starts here: the engine
answers image look-ups only, the pools' takes are recorded, and `execute` is a stand-in that records the
container it was given."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from prometheus_client import REGISTRY

from metaagent import metrics
from metaagent.audit import AuditLog
from metaagent.errors import RequestRefused, Unavailable
from metaagent.executions import ExecutionRegistry
from metaagent.languages import JAVASCRIPT, PYTHON
from metaagent.sandbox.cgroups import CpuControl
from metaagent.sandbox.engine import ContainerSpec, Engine
from metaagent.sandbox.execute import Outcome
from metaagent.sandbox.output import CappedBuffer
from metaagent.sandbox.pool import Warm
from metaagent.sandbox.provision import SandboxImage
from metaagent.sandbox.runtime import RUNC, RuntimeChoice
from metaagent.sandbox.sizing import PoolLimits
from metaagent.tools import code_interpreter
from metaagent.tools.code_interpreter import CodeInterpreter, CodeInterpreterRequest

JS_TAG, PY_TAG = "metaagent-sandbox:test", "metaagent-sandbox-python:test"
LIMITS = PoolLimits(floor=1, ceiling=2, memory_budget_mb=512)


class ImagesOnlyEngine:
    """Answers which images exist; anything else would start a container, which these tests never do."""

    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.cpu_control = CpuControl(None)  # the limits are the engine's to set, at create

    async def image_id(self, tag: str) -> str | None:
        return f"sha256:{tag}" if tag in self.present else None


class Recorder:
    """Stands in for the pools' takes and for `execute`: what each lane was asked, what ran where."""

    def __init__(self) -> None:
        self.taken: list[str] = []  # the lanes whose pool was asked for a warm container
        self.finished: list[str] = []  # the lanes whose pool was told a taken container's execution ended
        self.ran: list[ContainerSpec] = []
        self.warm: dict[str, Warm] = {}  # what a lane's pool hands out (none: the cold path)

    async def execute(self, engine: object, spec: ContainerSpec, *args: Any, **kwargs: Any) -> Outcome:
        self.ran.append(spec)
        return Outcome("c1", 0, CappedBuffer(10), CappedBuffer(10, "stderr"), False, False, False, 1)


def interpreter(tmp_path: Path, recorder: Recorder, present: set[str] | None = None) -> CodeInterpreter:
    engine = cast(Engine, ImagesOnlyEngine({JS_TAG, PY_TAG} if present is None else present))
    images = [
        SandboxImage(engine, tag=JS_TAG, cache_dir=tmp_path, language=JAVASCRIPT),
        SandboxImage(engine, tag=PY_TAG, cache_dir=tmp_path, language=PYTHON),
    ]
    made = CodeInterpreter(
        engine,
        images,
        ExecutionRegistry(),
        AuditLog(tmp_path / "audit.jsonl"),
        capacity=2,
        queue_size=2,
        cpus=0.5,
        grace_s=1,
        runtime=RuntimeChoice.parse("runc"),
        pool_limits={"javascript": LIMITS, "python": LIMITS},
    )
    for name, lane in made.lanes.items():

        async def take_or_wait(image_tag: str, name: str = name) -> Warm | None:
            recorder.taken.append(name)
            warm = recorder.warm.pop(name, None)
            assert warm is None or warm.spec.image == image_tag
            return warm

        def finished(name: str = name) -> None:
            recorder.finished.append(name)

        lane.pool.take_or_wait = take_or_wait  # type: ignore[method-assign]  # the recorder's stand-in
        lane.pool.finished = finished  # type: ignore[method-assign]  # the recorder's stand-in
    return made


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(code_interpreter, "execute", recorder.execute)
    return recorder


def test_each_served_language_has_a_lane_of_its_own_image_and_pool(tmp_path: Path, recorder: Recorder) -> None:
    lanes = interpreter(tmp_path, recorder).lanes
    assert list(lanes) == ["javascript", "python"]
    assert (lanes["javascript"].image.tag, lanes["python"].image.tag) == (JS_TAG, PY_TAG)
    assert (lanes["javascript"].image.language, lanes["python"].image.language) == (JAVASCRIPT, PYTHON)
    assert lanes["javascript"].pool is not lanes["python"].pool
    assert lanes["python"].pool.image is lanes["python"].image
    assert lanes["python"].pool.memory_mb == PYTHON.min_memory_mb


async def test_a_python_request_runs_in_pythons_image_with_its_runner_and_asks_only_pythons_pool(
    tmp_path: Path, recorder: Recorder
) -> None:
    await interpreter(tmp_path, recorder)(CodeInterpreterRequest(code="print(1)", language="python"))
    (spec,) = recorder.ran
    assert spec.image == PY_TAG
    assert spec.command[2:] == PYTHON.runner_command(256)
    assert recorder.taken == ["python"]


async def test_a_javascript_request_never_asks_pythons_pool(tmp_path: Path, recorder: Recorder) -> None:
    await interpreter(tmp_path, recorder)(CodeInterpreterRequest(code="console.log(1)"))
    (spec,) = recorder.ran
    assert (spec.image, spec.command[2:]) == (JS_TAG, JAVASCRIPT.runner_command(256))
    assert recorder.taken == ["javascript"]


async def test_a_warm_container_is_told_back_to_the_pool_of_its_own_lane(tmp_path: Path, recorder: Recorder) -> None:
    made = interpreter(tmp_path, recorder)
    spec = code_interpreter.container_spec("ex_warm", PY_TAG, 256, 0.5, language=PYTHON)
    recorder.warm["python"] = Warm("ex_warm", spec, prepared=cast(Any, None))
    response = await made(CodeInterpreterRequest(code="print(1)", language="python"))
    assert response.execution_id == "ex_warm"
    assert recorder.ran == [spec]
    assert (recorder.taken, recorder.finished) == (["python"], ["python"])


async def test_a_python_request_while_its_image_is_missing_is_a_503_and_javascript_still_runs(
    tmp_path: Path, recorder: Recorder
) -> None:
    made = interpreter(tmp_path, recorder, present={JS_TAG})
    with pytest.raises(Unavailable, match=r"metaagent-sandbox-python:test is missing"):
        await made(CodeInterpreterRequest(code="print(1)", language="python"))
    await made(CodeInterpreterRequest(code="console.log(1)"))
    assert [spec.image for spec in recorder.ran] == [JS_TAG]


async def test_pythons_refusals_come_before_its_image_is_looked_for(tmp_path: Path, recorder: Recorder) -> None:
    made = interpreter(tmp_path, recorder, present=set())  # no image at all: a refusal is still a 400
    for fields in ({"packages": ["lodash"]}, {"network": {"allow": ["api.example.com"]}}, {"memory_mb": 128}):
        with pytest.raises(RequestRefused):
            await made(CodeInterpreterRequest.model_validate({"code": "print(1)", "language": "python", **fields}))
    assert (recorder.taken, recorder.ran) == ([], [])


async def test_a_language_without_a_lane_is_refused_naming_the_served_ones(tmp_path: Path, recorder: Recorder) -> None:
    engine = cast(Engine, ImagesOnlyEngine({JS_TAG}))
    made = CodeInterpreter(
        engine,
        [SandboxImage(engine, tag=JS_TAG, cache_dir=tmp_path)],
        ExecutionRegistry(),
        AuditLog(tmp_path / "audit.jsonl"),
        capacity=1,
        queue_size=0,
        cpus=0.5,
        grace_s=1,
        runtime=RuntimeChoice.parse("runc"),
    )
    with pytest.raises(RequestRefused, match=r"not served here \(METAAGENT_LANGUAGES=javascript\)"):
        await made(CodeInterpreterRequest(code="print(1)", language="python"))


def test_an_interpreter_without_javascripts_image_is_refused(tmp_path: Path) -> None:
    engine = cast(Engine, ImagesOnlyEngine(set()))
    with pytest.raises(ValueError, match="needs JavaScript's image"):
        CodeInterpreter(
            engine,
            [SandboxImage(engine, tag=PY_TAG, cache_dir=tmp_path, language=PYTHON)],
            ExecutionRegistry(),
            AuditLog(tmp_path / "audit.jsonl"),
            capacity=1,
            queue_size=0,
            cpus=0.5,
            grace_s=1,
            runtime=RuntimeChoice.parse("runc"),
        )


async def test_the_runtime_self_test_runs_in_javascripts_image_for_a_python_request(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = interpreter(tmp_path, recorder)
    made.runtime = RuntimeChoice.parse("auto")
    probed: list[ContainerSpec] = []

    async def require(engine: object, image_tag: str, probe: Any) -> Any:
        probed.append(probe(image_tag, RUNC))
        return RUNC

    monkeypatch.setattr(made.runtime, "require", require)
    with anyio.fail_after(5):
        await made(CodeInterpreterRequest(code="print(1)", language="python"))
    (probe,) = probed
    assert (probe.image, probe.command[2:]) == (JS_TAG, JAVASCRIPT.runner_command(256))


def test_each_lanes_pool_gauges_carry_its_language(tmp_path: Path, recorder: Recorder) -> None:
    made = interpreter(tmp_path, recorder)
    for name, lane in made.lanes.items():
        metrics.watch_pool(lane.pool, name)
    for name, lane in made.lanes.items():
        assert REGISTRY.get_sample_value("metaagent_pool_target", {"language": name}) == lane.pool.size
        assert REGISTRY.get_sample_value("metaagent_pool_containers", {"language": name}) == lane.pool.ready
