"""npm packages in the sandbox, through the real service: the real registry with the default allow-list,
and a fake registry on 127.0.0.1 that records every request npm makes."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import docker
import pytest

from metaagent.audit import AuditLog
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard
from metaagent.executions import new_execution_id
from metaagent.languages.javascript.image import image_tag
from metaagent.packages.install import NpmInstaller
from metaagent.packages.policy import PackagePolicy
from metaagent.packages.store import PACKAGES_LABEL, PackageStore, PreparedPackages
from metaagent.sandbox.engine import Engine, EngineUnavailable
from metaagent.sandbox.network import NetworkLimits, SandboxNetwork
from tests.fake_registry import FakePackage, FakeRegistry, running_registry
from tests.sandbox.conftest import Service, audit_record, running_service

pytestmark = [pytest.mark.docker, pytest.mark.security]

FAKE_PACKAGES = (
    FakePackage("needs-fs", files={"index.js": b"module.exports = require('fs').readFileSync('/etc/hostname');\n"}),
    FakePackage("cache-probe", files={"index.js": b"module.exports = 'cache-probe works';\n"}),
    FakePackage("concurrent-probe", files={"index.js": b"module.exports = 'concurrent-probe works';\n"}),
    FakePackage("@fake-scope/tiny", "2.0.0", files={"index.js": b"module.exports = 'scoped';\n"}),
    FakePackage("slow-package"),
    FakePackage("big-package", files={"index.js": b"1", "data.bin": os.urandom(1_500_000)}),
)
FAKE_ALLOWED = [p.name for p in FAKE_PACKAGES] + ["fs-extra"]


def post(service: Service, code: str, packages: list[str]) -> tuple[int, dict[str, Any]]:
    response = service.post("/tools/code-interpreter", {"code": code, "timeout_s": 10, "packages": packages})
    return response.status_code, response.json()


@pytest.fixture(scope="session")
def fake_registry() -> Iterator[FakeRegistry]:
    with running_registry(*FAKE_PACKAGES) as registry:
        registry.slow["slow-package"] = 30
        yield registry


def _npm_service(
    tmp_path_factory: pytest.TempPathFactory, fake_registry: FakeRegistry, install_timeout_s: int
) -> AbstractContextManager[Service]:
    """A service whose npm registry is the fake one, with a 1 MB cap."""
    return running_service(
        tmp_path_factory.mktemp("npm-service"),
        METAAGENT_NPM_REGISTRY=fake_registry.url,
        METAAGENT_NPM_ALLOWED_PACKAGES=json.dumps(FAKE_ALLOWED),
        METAAGENT_NPM_INSTALL_TIMEOUT_S=str(install_timeout_s),
        METAAGENT_NPM_MAX_INSTALL_MB="1",
    )


@pytest.fixture(scope="session")
def npm_service(
    tmp_path_factory: pytest.TempPathFactory, fake_registry: FakeRegistry, sandbox_service: Service
) -> Iterator[Service]:
    """The fake registry's service, with an install deadline no install of its packages comes near on a
    busy machine (it starts after `sandbox_service`, which builds the image). CI's run of 968c9c2 saw
    the 1.5 MB package's install outlast the 3 s one this service had, and answer 504 for its 400."""
    with _npm_service(tmp_path_factory, fake_registry, install_timeout_s=120) as service:
        yield service


@pytest.fixture
def npm_service_with_a_short_deadline(
    tmp_path_factory: pytest.TempPathFactory, fake_registry: FakeRegistry, sandbox_service: Service
) -> Iterator[Service]:
    """The same with a 3 s install deadline, which the registry's slow package (30 s) outlasts."""
    with _npm_service(tmp_path_factory, fake_registry, install_timeout_s=3) as service:
        yield service


# The real registry, through npm's ordinary client, with the default allow-list.


def test_lodash_installs_and_works(sandbox_service: Service) -> None:
    status, body = post(
        sandbox_service, "const _ = require('lodash'); console.log(JSON.stringify(_.chunk([1, 2, 3], 2)))", ["lodash"]
    )
    assert status == 200, body
    assert body["exit_code"] == 0, body["stderr"]
    assert body["stdout"] == "[[1,2],[3]]\n"
    packages = audit_record(sandbox_service, body["execution_id"])["packages"]
    assert packages["requested"] == ["lodash"]
    [lodash] = packages["resolved"]
    assert lodash["name"] == "lodash"
    assert lodash["integrity"].startswith("sha512-")


def test_a_scoped_package_installs_and_works_with_require_and_import(sandbox_service: Service) -> None:
    code = """
      const { LocalDate } = require('@js-joda/core');
      console.log(LocalDate.of(2024, 2, 28).plusDays(1).toString());
      import('@js-joda/core').then((m) => console.log(m.LocalDate.of(2023, 12, 31).plusDays(1).toString()));
    """
    status, body = post(sandbox_service, code, ["@js-joda/core"])
    assert status == 200, body
    assert body["stdout"] == "2024-02-29\n2024-01-01\n", body["stderr"]


def test_a_version_range_installs_a_version_in_it(sandbox_service: Service) -> None:
    status, body = post(sandbox_service, "console.log(require('dayjs/package.json').version)", ["dayjs@~1.11.0"])
    assert status == 200, body
    assert body["stdout"].startswith("1.11."), body["stderr"]
    [dayjs] = audit_record(sandbox_service, body["execution_id"])["packages"]["resolved"]
    assert dayjs["version"] == body["stdout"].strip()


# A fake registry on 127.0.0.1 that records what npm asks for.

REFUSED = [
    ("left-pad", "not-allowed"),
    ("fs", "blocked"),
    ("node:child_process", "blocked"),
    ("fs-extra", "blocked"),  # blocked although the allow-list lists it
    ("cache-probe@npm:evil", "alias"),
    ("https://127.0.0.1/cache-probe.tgz", "url"),
    ("git+ssh://git@127.0.0.1/x/cache-probe.git", "git"),
    ("x/cache-probe", "git"),
    ("cache-probe-1.0.0.tgz", "tarball"),
    ("file:../cache-probe", "path"),
    ("link:../cache-probe", "path"),
    ("../cache-probe", "path"),
    ("cache-probe;id", "characters"),
    ("cache-probe\nneeds-fs", "whitespace"),
    ("Cache-Probe", "case"),
    ("cache-probe@latest", "version"),
]


@pytest.mark.parametrize(("spec", "rule"), REFUSED)
def test_refused_packages_get_a_400_naming_the_package_and_never_reach_npm(
    npm_service: Service, fake_registry: FakeRegistry, spec: str, rule: str
) -> None:
    before = len(fake_registry.requests)
    status, body = post(npm_service, "console.log(1)", ["@fake-scope/tiny", spec])
    assert status == 400
    assert body["error"].startswith(f"Package not allowed: {spec.encode('unicode_escape').decode()}")
    assert body["package"] == spec
    assert body["rule"] == rule
    assert fake_registry.requests[before:] == []


def test_a_package_that_requires_fs_fails_with_the_blocked_module_error(npm_service: Service) -> None:
    status, body = post(npm_service, "require('needs-fs')", ["needs-fs"])
    assert status == 200, body
    assert body["exit_code"] != 0
    assert 'Module "fs" is blocked in the sandbox' in body["stderr"], body
    assert "ERR_METAAGENT_BLOCKED_MODULE" in body["stderr"]


def test_the_cache_serves_a_repeat_request_without_running_npm(
    npm_service: Service, fake_registry: FakeRegistry
) -> None:
    first_status, first = post(npm_service, "console.log(require('cache-probe'))", ["cache-probe"])
    assert first_status == 200, first
    fetched = len(fake_registry.requests_for("cache-probe"))
    assert fetched >= 1
    second_status, second = post(npm_service, "console.log(require('cache-probe'))", ["cache-probe"])
    assert second_status == 200, second
    assert second["stdout"] == first["stdout"] == "cache-probe works\n"
    assert len(fake_registry.requests_for("cache-probe")) == fetched
    assert audit_record(npm_service, first["execution_id"])["packages"]["cache_hit"] is False
    assert audit_record(npm_service, second["execution_id"])["packages"]["cache_hit"] is True


def test_concurrent_identical_requests_install_once(npm_service: Service, fake_registry: FakeRegistry) -> None:
    results: list[tuple[int, dict[str, Any]]] = []
    start = threading.Barrier(3)

    def request() -> None:
        start.wait(timeout=30)
        results.append(post(npm_service, "console.log(require('concurrent-probe'))", ["concurrent-probe"]))

    threads = [threading.Thread(target=request) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [status for status, _ in results] == [200, 200, 200]
    assert all(body["stdout"] == "concurrent-probe works\n" for _, body in results)
    tarballs = [r for r in fake_registry.requests_for("concurrent-probe") if r.endswith(".tgz")]
    assert tarballs == ["/concurrent-probe/-/concurrent-probe-1.0.0.tgz"]
    hits = sorted(audit_record(npm_service, body["execution_id"])["packages"]["cache_hit"] for _, body in results)
    assert hits == [False, True, True]


def test_a_registry_that_does_not_answer_in_time_gives_the_timeout_error(
    npm_service_with_a_short_deadline: Service,
) -> None:
    status, body = post(npm_service_with_a_short_deadline, "console.log(1)", ["slow-package"])
    assert status == 504
    assert body["error"].startswith("npm did not finish installing slow-package within 3 s")


def test_packages_larger_than_the_app_directory_are_refused(npm_service: Service) -> None:
    status, body = post(npm_service, "console.log(1)", ["big-package"])
    assert status == 400
    assert "more than the 1 MB app directory holds" in body["error"]


def test_the_store_removes_its_volumes_when_it_closes(
    fake_registry: FakeRegistry, sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    async def go() -> str:
        engine = Engine()
        installer = NpmInstaller(fake_registry.url, tmp_path / "cache", timeout_s=30, max_bytes=2**20)
        store = PackageStore(PackagePolicy.parse("@fake-scope/tiny"), installer, engine, AuditLog(tmp_path / "a"))
        try:
            requested = ["@fake-scope/tiny"]
            async with store.provide(requested, store.check(requested), image_tag()) as prepared:
                assert docker_client.volumes.get(prepared.volume).attrs["Labels"]["org.metaagent.owner-pid"]
            await store.close()
            return prepared.volume
        finally:
            engine.close()

    volume = anyio.run(go)
    with pytest.raises(docker.errors.NotFound):
        docker_client.volumes.get(volume)


# Volumes and the cache under concurrency and hang-ups: the real engine, with a hook where a test must
# act at a precise moment (while a volume is being removed, filled or created).

T = TypeVar("T")
EVICTION_PACKAGES = [FakePackage(f"evict-{n}") for n in "abcd"]


class ObservedEngine(Engine):
    """The real engine. The removal of `gated` waits until `gate` is set; the removal of `failing` fails once.
    With `hold_fill`, the fill reaches the engine only once `finish_fill` is set or a removal has ended: a
    busy engine that still fills a volume after its caller gave up waiting."""

    def __init__(self, hold_fill: bool = False) -> None:
        super().__init__()
        self.gated: str | None = None
        self.gate = anyio.Event()
        self.removal_started = anyio.Event()
        self.failing: str | None = None
        self.removals = 0
        self.filling = anyio.Event()
        self.filled: list[str] = []
        self.hold_fill = hold_fill
        self.finish_fill = threading.Event()
        self.fill_started = threading.Event()
        self.fill_done = threading.Event()
        self._fill_call_next = False

    async def remove_volume(self, name: str) -> bool:
        self.removals += 1
        if name == self.gated:
            self.removal_started.set()
            await self.gate.wait()
        if name == self.failing:
            self.failing = None
            raise EngineUnavailable("The container engine is unavailable (the test's injected failure)")
        try:
            return await super().remove_volume(name)
        finally:
            self.finish_fill.set()

    async def fill_volume(self, volume: str, image: str, archive: Path, labels: dict[str, str]) -> None:
        self.filled.append(volume)
        self.filling.set()
        self._fill_call_next = self.hold_fill
        await super().fill_volume(volume, image, archive, labels)

    async def _run(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not self._fill_call_next:
            return await super()._run(func, *args, **kwargs)
        self._fill_call_next = False

        def held(*args: Any, **kwargs: Any) -> T:
            self.fill_started.set()
            try:
                self.finish_fill.wait(timeout=60)
                return func(*args, **kwargs)
            finally:
                self.fill_done.set()

        return await super()._run(held, *args, **kwargs)


@pytest.fixture
def eviction_registry() -> Iterator[FakeRegistry]:
    with running_registry(*EVICTION_PACKAGES) as registry:
        yield registry


def eviction_store(registry: FakeRegistry, engine: Engine, tmp_path: Path, max_sets: int) -> PackageStore:
    installer = NpmInstaller(registry.url, tmp_path / "cache", timeout_s=60, max_bytes=2**20)
    policy = PackagePolicy.parse(",".join(p.name for p in EVICTION_PACKAGES))
    return PackageStore(policy, installer, engine, AuditLog(tmp_path / "audit.jsonl"), max_sets=max_sets)


@asynccontextmanager
async def holding(store: PackageStore, name: str) -> AsyncIterator[PreparedPackages]:
    async with store.provide([name], store.check([name]), image_tag()) as prepared:
        yield prepared


async def hold_until(store: PackageStore, name: str, got: anyio.Event, release: anyio.Event) -> None:
    async with holding(store, name):
        got.set()
        await release.wait()


async def eventually(condition: Callable[[], object]) -> None:
    """Waits (at most a minute) until `condition()` is true: what it watches sets no event."""
    with anyio.fail_after(60):
        while not condition():  # noqa: ASYNC110  # the store and the registry expose state, not events
            await anyio.sleep(0.02)


def volume_exists(docker_client: docker.DockerClient, name: str) -> bool:
    try:
        docker_client.volumes.get(name)
    except docker.errors.NotFound:
        return False
    return True


def test_eviction_spares_a_set_that_a_request_got_while_another_was_being_removed(
    eviction_registry: FakeRegistry, sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    async def go() -> None:
        engine = ObservedEngine()
        store = eviction_store(eviction_registry, engine, tmp_path, max_sets=3)
        try:
            async with holding(store, "evict-a") as a:
                engine.gated = a.volume
            async with holding(store, "evict-b"):
                pass
            store.max_sets = 1  # the next install evicts a, then b
            got_c, release_c = anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as group:
                group.start_soon(hold_until, store, "evict-c", got_c, release_c)
                with anyio.fail_after(60):
                    await engine.removal_started.wait()
                async with holding(store, "evict-b") as b:  # a cache hit while a's volume is being removed
                    assert b.cache_hit
                    engine.gate.set()
                    with anyio.fail_after(60):
                        await got_c.wait()  # c's eviction is over
                    volume = docker_client.volumes.get(b.volume)
                    assert volume.attrs["Labels"][PACKAGES_LABEL] == "evict-b@latest"
                release_c.set()
        finally:
            await store.close()
            engine.close()

    anyio.run(go)


def test_two_evictions_at_once_fail_neither_request(
    eviction_registry: FakeRegistry, sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    async def go() -> list[str]:
        engine = ObservedEngine()
        store = eviction_store(eviction_registry, engine, tmp_path, max_sets=3)
        try:
            async with holding(store, "evict-a") as a:
                engine.gated = a.volume
            async with holding(store, "evict-b"):
                pass
            store.max_sets = 1
            got_c, got_d, release = anyio.Event(), anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as group:
                group.start_soon(hold_until, store, "evict-c", got_c, release)
                with anyio.fail_after(60):
                    await engine.removal_started.wait()
                group.start_soon(hold_until, store, "evict-d", got_d, release)
                await eventually(lambda: store.key(store.check(["evict-d"])) in store._sets)  # d is installed
                engine.gate.set()
                with anyio.fail_after(60):
                    await got_c.wait()
                    await got_d.wait()
                release.set()
            volumes = [cached.volume for cached in store._sets.values()]
        finally:
            await store.close()
            engine.close()
        return volumes

    volumes = anyio.run(go)
    assert len(volumes) == 2  # c and d, both in use when the evictions ran
    assert not any(volume_exists(docker_client, volume) for volume in volumes)


def test_a_set_whose_removal_failed_stays_cached_and_goes_at_close(
    eviction_registry: FakeRegistry, sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    async def go() -> str:
        engine = ObservedEngine()
        store = eviction_store(eviction_registry, engine, tmp_path, max_sets=1)
        try:
            async with holding(store, "evict-a") as a:
                engine.failing = a.volume
            async with holding(store, "evict-b") as b:  # its install worked: the failed eviction is not its error
                assert not b.cache_hit
            assert volume_exists(docker_client, a.volume)
            async with holding(store, "evict-a") as again:
                assert again.cache_hit
        finally:
            await store.close()
            engine.close()
        return a.volume

    assert not volume_exists(docker_client, anyio.run(go))


def test_a_caller_hanging_up_while_its_volume_is_filled_leaves_no_volume(
    eviction_registry: FakeRegistry, sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    async def go() -> ObservedEngine:
        engine = ObservedEngine(hold_fill=True)
        store = eviction_store(eviction_registry, engine, tmp_path, max_sets=4)
        hang_up = anyio.CancelScope()

        async def hang_up_while_filling() -> None:
            await anyio.to_thread.run_sync(engine.fill_started.wait, 60)  # the engine has the call
            hang_up.cancel()
            await anyio.wait_all_tasks_blocked()
            if not engine.removals:  # the fill is not abandoned: let the engine finish it
                engine.finish_fill.set()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(hang_up_while_filling)
                with hang_up, anyio.fail_after(60):
                    async with holding(store, "evict-a"):
                        await anyio.sleep_forever()
        finally:
            await store.close()
            engine.close()
        return engine

    engine = anyio.run(go)
    assert engine.fill_done.wait(timeout=60)  # the fill, abandoned or not, has reached the engine
    [volume] = engine.filled
    assert not volume_exists(docker_client, volume)
    assert docker_client.containers.list(all=True, filters={"name": f"{volume}-fill"}) == []


class SlowCreationEngine(Engine):
    """The real engine, whose volume creation completes only when `finish_creation` is set: a busy engine
    that still creates a volume after its caller gave up waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.creation_started = threading.Event()
        self.finish_creation = threading.Event()
        self.removal_started = False
        self.created: list[str] = []

    async def create_volume(self, name: str, labels: dict[str, str]) -> str:
        def create() -> str:
            self.creation_started.set()
            self.finish_creation.wait(timeout=60)
            self.created.append(name)
            return str(self.api.create_volume(name=name, driver="local", labels=labels)["Mountpoint"])

        return await anyio.to_thread.run_sync(create, abandon_on_cancel=True)

    async def remove_volume(self, name: str) -> bool:
        self.removal_started = True
        try:
            return await super().remove_volume(name)
        finally:
            self.finish_creation.set()


def test_a_caller_hanging_up_while_its_tunnel_volume_is_created_leaves_no_volume(
    sandbox_service: Service, docker_client: docker.DockerClient
) -> None:
    async def go() -> list[str]:
        engine = SlowCreationEngine()
        network = SandboxNetwork(engine, EgressGuard(AllowList(["127.0.0.1"])), NetworkLimits(4, 2**20))
        hang_up = anyio.CancelScope()

        async def hang_up_while_creating() -> None:
            await anyio.to_thread.run_sync(engine.creation_started.wait, 60)  # the engine has the call
            hang_up.cancel()
            await anyio.wait_all_tasks_blocked()
            if not engine.removal_started:  # the creation is not abandoned: let the engine finish it
                engine.finish_creation.set()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(hang_up_while_creating)
                with hang_up, anyio.fail_after(60):
                    async with network.for_execution(new_execution_id(), AllowList(["127.0.0.1"])):
                        await anyio.sleep_forever()
            await eventually(lambda: engine.created)  # the creation, abandoned or not, has reached the engine
        finally:
            engine.close()
        return engine.created

    [volume] = anyio.run(go)
    assert not volume_exists(docker_client, volume)
