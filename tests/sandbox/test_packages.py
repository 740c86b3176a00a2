"""npm packages in the sandbox, through the real service: the real registry with the default allow-list,
and a fake registry on 127.0.0.1 that records every request npm makes."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import docker
import pytest

from metaagent.audit import AuditLog
from metaagent.packages.install import NpmInstaller
from metaagent.packages.policy import PackagePolicy
from metaagent.packages.store import PackageStore
from metaagent.sandbox.engine import Engine
from metaagent.sandbox.image import image_tag
from tests.fake_registry import FakePackage, FakeRegistry, running_registry
from tests.sandbox.conftest import Service, running_service

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


def audit_of(service: Service, execution_id: str) -> dict[str, Any]:
    for line in service.audit_log.read_text().splitlines():
        record: dict[str, Any] = json.loads(line)
        if record.get("execution_id") == execution_id:
            return record
    raise AssertionError(f"no audit record for {execution_id}")


@pytest.fixture(scope="session")
def fake_registry() -> Iterator[FakeRegistry]:
    with running_registry(*FAKE_PACKAGES) as registry:
        registry.slow["slow-package"] = 30
        yield registry


@pytest.fixture(scope="session")
def npm_service(
    tmp_path_factory: pytest.TempPathFactory, fake_registry: FakeRegistry, sandbox_service: Service
) -> Iterator[Service]:
    """A second service whose npm registry is the fake one, with a short install deadline and a 1 MB cap
    (it starts after `sandbox_service`, which builds the image)."""
    with running_service(
        tmp_path_factory.mktemp("npm-service"),
        METAAGENT_NPM_REGISTRY=fake_registry.url,
        METAAGENT_NPM_ALLOWED_PACKAGES=json.dumps(FAKE_ALLOWED),
        METAAGENT_NPM_INSTALL_TIMEOUT_S="3",
        METAAGENT_NPM_MAX_INSTALL_MB="1",
    ) as service:
        yield service


# The real registry, through npm's ordinary client, with the default allow-list.


def test_lodash_installs_and_works(sandbox_service: Service) -> None:
    status, body = post(
        sandbox_service, "const _ = require('lodash'); console.log(JSON.stringify(_.chunk([1, 2, 3], 2)))", ["lodash"]
    )
    assert status == 200, body
    assert body["exit_code"] == 0, body["stderr"]
    assert body["stdout"] == "[[1,2],[3]]\n"
    packages = audit_of(sandbox_service, body["execution_id"])["packages"]
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
    [dayjs] = audit_of(sandbox_service, body["execution_id"])["packages"]["resolved"]
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
    assert 'Module "fs" is blocked in the sandbox' in body["stderr"]
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
    assert audit_of(npm_service, first["execution_id"])["packages"]["cache_hit"] is False
    assert audit_of(npm_service, second["execution_id"])["packages"]["cache_hit"] is True


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
    hits = sorted(audit_of(npm_service, body["execution_id"])["packages"]["cache_hit"] for _, body in results)
    assert hits == [False, True, True]


def test_a_registry_that_does_not_answer_in_time_gives_the_timeout_error(npm_service: Service) -> None:
    status, body = post(npm_service, "console.log(1)", ["slow-package"])
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
