"""Finding a container's cgroup: Docker's default places, and an engine's own `--cgroup-parent`, which is
searched for once and then looked in first (a fleet node's engine, a deployment's own parent)."""

from __future__ import annotations

from pathlib import Path

from metaagent.sandbox import cgroups
from metaagent.sandbox.cgroups import container_cgroup


def test_a_container_is_found_at_the_defaults_and_under_another_parent_which_is_remembered(tmp_path: Path) -> None:
    hierarchy = tmp_path / "cpu"
    (hierarchy / "docker" / "c1").mkdir(parents=True)
    (hierarchy / "system.slice" / "docker-c2.scope").mkdir(parents=True)
    (hierarchy / "metaagent-node-a" / "c3").mkdir(parents=True)
    (hierarchy / "kubepods" / "burstable" / "c4").mkdir(parents=True)
    assert container_cgroup(hierarchy, "c1") == hierarchy / "docker" / "c1"
    assert container_cgroup(hierarchy, "c2") == hierarchy / "system.slice" / "docker-c2.scope"
    assert container_cgroup(hierarchy, "c3") == hierarchy / "metaagent-node-a" / "c3"
    assert container_cgroup(hierarchy, "c4") == hierarchy / "kubepods" / "burstable" / "c4"
    assert cgroups._learned_parents[hierarchy] == [hierarchy / "metaagent-node-a", hierarchy / "kubepods" / "burstable"]
    (hierarchy / "metaagent-node-a" / "c5").mkdir()
    assert container_cgroup(hierarchy, "c5") == hierarchy / "metaagent-node-a" / "c5"
    assert container_cgroup(hierarchy, "gone") is None
    assert len(cgroups._learned_parents[hierarchy]) == 2  # looked in, not searched for again
