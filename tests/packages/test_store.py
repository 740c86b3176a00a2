"""The package store's bookkeeping around installs, with the real npm against a fake registry on
127.0.0.1. No install here gets as far as a volume, so no Docker is needed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from metaagent.audit import AuditLog
from metaagent.errors import AtCapacity, RequestRefused, Unavailable
from metaagent.packages.install import NpmInstaller
from metaagent.packages.policy import PackagePolicy
from metaagent.packages.store import PackageStore
from metaagent.sandbox.engine import Engine
from tests.fake_registry import FakePackage, FakeRegistry, running_registry

# Distinct ranges of one package: each is a set of its own, as a caller could ask for many.
SLOW_RANGES = ["slow-package@1.0.0", "slow-package@^1.0.0", "slow-package@~1.0.0", "slow-package@>=1"]


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    with running_registry(FakePackage("tiny", "1.0.0"), FakePackage("slow-package")) as registry:
        registry.slow["slow-package"] = 60
        yield registry


def make_store(registry: FakeRegistry, tmp_path: Path, **options: int) -> PackageStore:
    installer = NpmInstaller(registry.url, tmp_path / "cache", timeout_s=120, max_bytes=2**20)
    policy = PackagePolicy.parse("tiny,slow-package")
    return PackageStore(policy, installer, Engine(), AuditLog(tmp_path / "audit.jsonl"), **options)


async def provide(store: PackageStore, spec: str, caller: str | None = None) -> None:
    async with store.provide([spec], store.check([spec]), "unused-image", caller):
        pytest.fail(f"{spec} was installed")


async def eventually(condition: Callable[[], object]) -> None:
    """Waits (at most a minute) until `condition()` is true: what it watches sets no event."""
    with anyio.fail_after(60):
        while not condition():  # noqa: ASYNC110  # the store and the registry expose state, not events
            await anyio.sleep(0.02)


def audit_records(tmp_path: Path, event: str) -> list[dict[str, Any]]:
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == event]


def test_a_failed_install_leaves_an_audit_record_with_the_caller_and_the_error(
    registry: FakeRegistry, tmp_path: Path
) -> None:
    store = make_store(registry, tmp_path)
    with pytest.raises(RequestRefused):
        anyio.run(provide, store, "tiny@^2", "key-1")
    [record] = audit_records(tmp_path, "package.install_failed")
    assert record["caller"] == "key-1"
    assert record["requested"] == ["tiny@^2"]
    assert record["dependencies"] == {"tiny": "^2"}
    assert "No matching version found for tiny@^2" in record["error"]
    assert str(tmp_path) not in json.dumps(record)


def test_lock_entries_go_once_no_request_holds_or_waits_for_them(registry: FakeRegistry, tmp_path: Path) -> None:
    store = make_store(registry, tmp_path)

    async def go() -> None:
        async with anyio.create_task_group() as group:
            for spec in ["tiny@^2", "tiny@^2", "tiny@^3", "tiny@>=4"]:
                group.start_soon(refused, spec)

    async def refused(spec: str) -> None:
        with pytest.raises(RequestRefused):
            await provide(store, spec)

    anyio.run(go)
    assert store._locks == {}
    assert len(audit_records(tmp_path, "package.install_failed")) == 4


def test_installs_past_the_waiting_limit_get_429_with_retry_after(registry: FakeRegistry, tmp_path: Path) -> None:
    store = make_store(registry, tmp_path, max_waiting_installs=1)

    async def go() -> AtCapacity:
        async with anyio.create_task_group() as group:
            for spec in SLOW_RANGES[:3]:  # two run npm, one waits
                group.start_soon(provide, store, spec)
            await eventually(lambda: store.pending >= 3)
            with pytest.raises(AtCapacity) as caught:
                await provide(store, SLOW_RANGES[3])
            group.cancel_scope.cancel()  # the three callers hang up: npm is killed
        return caught.value

    refused = anyio.run(go)
    assert refused.status_code == 429
    assert refused.retry_after_s > 0
    assert refused.message.startswith("At capacity: the service's package installs are running")
    assert "3" not in refused.message  # other tenants' installs are not counted to the caller
    assert store.pending == 0
    cancelled = audit_records(tmp_path, "package.install_failed")
    assert sorted(r["requested"] for r in cancelled) == sorted([spec] for spec in SLOW_RANGES[:3])
    assert {r["error"] for r in cancelled} == {"cancelled (the caller hung up or the service stopped)"}


def test_an_install_waiting_for_npm_when_the_service_stops_never_starts_npm(
    registry: FakeRegistry, tmp_path: Path
) -> None:
    store = make_store(registry, tmp_path)

    async def go() -> None:
        hang_up = anyio.CancelScope()
        async with anyio.create_task_group() as group:
            group.start_soon(install_slowly, hang_up)
            await eventually(lambda: store.pending >= 2)
            await eventually(lambda: registry.requests_for("slow-package"))  # npm runs
            group.start_soon(refused_at_shutdown)
            await eventually(lambda: store.pending >= 3)
            store.stop_installing()
            hang_up.cancel()

    async def install_slowly(hang_up: anyio.CancelScope) -> None:
        with hang_up:
            async with anyio.create_task_group() as group:
                for spec in SLOW_RANGES[:2]:
                    group.start_soon(provide, store, spec)

    async def refused_at_shutdown() -> None:
        with pytest.raises(Unavailable, match="shutting down"):
            await provide(store, "tiny")

    anyio.run(go)
    assert registry.requests_for("tiny") == []
