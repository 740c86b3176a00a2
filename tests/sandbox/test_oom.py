"""`oom_killed` tells the truth under every runtime: the memory cgroup's own OOM notifications, watched
while a container lives (sandbox/oom.py), beside the engine's report, which under runsc misses some."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaagent.sandbox.cgroups import v1_hierarchy
from metaagent.sandbox.oom import OomWatch
from tests.sandbox.conftest import RunJs, Service, metric_value, private_cgroup_branch

pytestmark = [pytest.mark.security]

# Fills memory past any limit with buffers, which live outside node's heap: only the cgroup stops it.
MEMORY_HOG = "const keep = []; for (;;) keep.push(Buffer.alloc(8 << 20, 1))"
KILLS_IN_A_ROW = 20


@pytest.fixture
def hierarchy() -> Iterator[Path]:
    with private_cgroup_branch("memory") as branch:
        yield branch


def cgroup_of(hierarchy: Path, container_id: str, limit_mb: int) -> Path:
    cgroup = hierarchy / "docker" / container_id
    cgroup.mkdir()
    (cgroup / "memory.limit_in_bytes").write_text(f"{limit_mb << 20}")
    if (cgroup / "memory.memsw.limit_in_bytes").exists():  # no swap to escape to
        (cgroup / "memory.memsw.limit_in_bytes").write_text(f"{limit_mb << 20}")
    return cgroup


def signals_seen(watch: OomWatch, container_id: str) -> int:
    watch.saw_oom(container_id)  # takes what the eventfd holds
    return watch._watches[container_id].signals


def test_the_watch_records_an_oom_kill_in_a_cgroup_and_not_the_removal_of_another(hierarchy: Path) -> None:
    watch = OomWatch(hierarchy)
    try:
        hog, quiet = cgroup_of(hierarchy, "hog", 32), cgroup_of(hierarchy, "quiet", 32)
        assert watch.watch("hog")
        assert watch.watch("quiet")
        allocate = (
            "import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
            "blocks = [bytearray(1 << 20) for _ in range(256)]"
        )
        ended = subprocess.run([sys.executable, "-c", allocate, str(hog)], check=False, timeout=60)
        assert ended.returncode == -9  # the OOM killer's SIGKILL
        assert watch.saw_oom("hog")
        quiet.rmdir()  # its one signal is the removal's
        for _ in range(500):
            if signals_seen(watch, "quiet"):
                break
            time.sleep(0.01)
        assert signals_seen(watch, "quiet") == 1
        assert not watch.saw_oom("quiet")
        hog.rmdir()
        assert watch.saw_oom("hog")
    finally:
        watch.close()


def test_a_container_the_watch_cannot_find_is_left_to_the_engines_report(hierarchy: Path) -> None:
    watch = OomWatch(hierarchy)
    try:
        assert not watch.watch("no-such-container")
        assert not watch.saw_oom("no-such-container")
        assert watch.available  # one container that is not there does not turn the watch off
    finally:
        watch.close()


def test_the_memory_hierarchy_is_found_in_mountinfo_and_without_one_the_watch_is_off() -> None:
    v1 = "38 29 0:33 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory\n"
    v2 = "36 25 0:31 / /sys/fs/cgroup rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert v1_hierarchy(v2 + v1, "memory") == Path("/sys/fs/cgroup/memory")
    assert v1_hierarchy(v2, "memory") is None
    watch = OomWatch(None)
    assert not watch.available
    assert watch.failure == "no cgroup v1 memory hierarchy is mounted"
    assert not watch.watch("any")
    assert not watch.saw_oom("any")


def test_twenty_memory_kills_in_a_row_are_each_reported_oom_killed(run_js: RunJs, sandbox_service: Service) -> None:
    unreported_before = metric_value(sandbox_service, "metaagent_oom_kills_unreported_total")
    results = [run_js(MEMORY_HOG, timeout_s=60) for _ in range(KILLS_IN_A_ROW)]
    unreported = metric_value(sandbox_service, "metaagent_oom_kills_unreported_total") - unreported_before
    outcomes = [(result.exit_code, result.body["oom_killed"], result.body["timed_out"]) for result in results]
    odd = [result.body["stderr"][-500:] for result in results if result.exit_code != 137]  # for the diagnosis
    # 137, the kill's SIGKILL; under runsc the kill can land on gVisor's own kernel, whose death exits 2.
    assert [(oom, timed_out) for _, oom, timed_out in outcomes] == [(True, False)] * KILLS_IN_A_ROW, (
        f"{outcomes}; {unreported:g} the engine missed; {odd}"
    )
    assert {exit_code for exit_code, _, _ in outcomes} <= {137, 2}, f"{outcomes}; {odd}"
    print(f"{KILLS_IN_A_ROW} kills: the engine's report missed {unreported:g}, the cgroup's notification none")
