"""The isolation runtime setting and what each runtime's containers get (pure logic, no engine), and the
daemon.json registration that scripts/ensure-docker makes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from metaagent.errors import ConfigError
from metaagent.languages.container import container_spec
from metaagent.sandbox.leftovers import is_sandbox_spec
from metaagent.sandbox.runtime import (
    PROCESS_LIMIT,
    REQUIRED_RUNSC_ARGS,
    RUNC,
    RUNSC,
    RuntimeChoice,
    parse_setting,
    registration_problem,
)
from tests.test_cli import run

REGISTER = Path(__file__).parent.parent / "scripts" / "register-runsc"


@pytest.mark.parametrize(
    ("value", "setting"), [("auto", "auto"), ("runc", "runc"), ("runsc", "runsc"), (" RunSC ", "runsc")]
)
def test_the_setting_takes_auto_runc_and_runsc(value: str, setting: str) -> None:
    assert parse_setting(value) == setting


@pytest.mark.parametrize("value", ["", "gvisor", "kata", "runc,runsc"])
def test_any_other_setting_is_a_config_error_naming_the_values(value: str) -> None:
    with pytest.raises(ConfigError, match="METAAGENT_SANDBOX_RUNTIME must be runc, runsc or auto") as raised:
        parse_setting(value)
    assert any("auto (the default)" in problem for problem in raised.value.problems)


def test_an_unknown_runtime_refuses_to_start_with_exit_2(tmp_path: Path) -> None:
    result = run(tmp_path, "serve", METAAGENT_SANDBOX_RUNTIME="kata")
    assert result.returncode == 2
    assert "METAAGENT_SANDBOX_RUNTIME must be runc, runsc or auto, not 'kata'" in result.stderr


def test_runc_is_in_force_at_once_and_the_others_only_once_chosen() -> None:
    assert RuntimeChoice.parse("runc").runtime is RUNC
    assert RuntimeChoice.parse("auto").runtime is None
    assert RuntimeChoice.parse("runsc").runtime is None


def test_under_runc_the_pids_cgroup_is_the_process_limit_and_the_runner_starts_on_every_cpu() -> None:
    spec = container_spec("exe_1", "image", 256, 0.5, runtime=RUNC)
    assert spec.runtime == "runc"
    assert spec.pids_limit == PROCESS_LIMIT
    assert spec.nproc is None  # under runc RLIMIT_NPROC would count uid 1001 across every container
    assert spec.start_cpus is not None  # lowered to 0.5 before the code is handed over
    assert spec.security_context()["runtime"] == "runc"


def test_under_runsc_the_guest_rlimit_is_the_process_limit_and_the_share_holds_from_the_start() -> None:
    spec = container_spec("exe_1", "image", 256, 0.5, runtime=RUNSC)
    assert spec.runtime == "runsc"
    assert spec.nproc == PROCESS_LIMIT
    assert spec.pids_limit > PROCESS_LIMIT  # room for gVisor's own host threads
    assert spec.start_cpus is None  # runsc cannot update a running container's quota
    assert spec.security_context()["nproc"] == PROCESS_LIMIT


def test_registration_without_runsc_or_without_its_arguments_is_named() -> None:
    assert "is not registered" in (registration_problem({"runc": []}) or "")
    assert "--host-uds=open" in (registration_problem({"runc": [], "runsc": ["--network=none"]}) or "")
    assert registration_problem({"runsc": list(REQUIRED_RUNSC_ARGS)}) is None
    assert registration_problem({"runsc": ["--network=none", "--host-uds=all", "--debug"]}) is None


def test_a_sandbox_spec_is_known_by_its_hostname_user_and_engine_data_root() -> None:
    ours = {
        "hostname": "sandbox",
        "process": {"user": {"uid": 1001, "gid": 1001}},
        "root": {"path": "/var/lib/docker/overlay2/0123/merged"},
    }
    assert is_sandbox_spec(ours, "sandbox", 1001, "/var/lib/docker")
    assert is_sandbox_spec(ours, "sandbox", 1001, "/var/lib/docker/")
    assert not is_sandbox_spec({**ours, "hostname": "web"}, "sandbox", 1001, "/var/lib/docker")
    assert not is_sandbox_spec({**ours, "process": {"user": {"uid": 0}}}, "sandbox", 1001, "/var/lib/docker")
    # Another engine's sandbox on the same host (its own data root), and a look-alike prefix:
    assert not is_sandbox_spec(ours, "sandbox", 1001, "/srv/engine-b/docker")
    assert not is_sandbox_spec({**ours, "root": {"path": "/var/lib/docker-b/x"}}, "sandbox", 1001, "/var/lib/docker")
    assert not is_sandbox_spec({**ours, "root": None}, "sandbox", 1001, "/var/lib/docker")
    assert not is_sandbox_spec(None, "sandbox", 1001, "/var/lib/docker")


# --- scripts/register-runsc (what ensure-docker writes into /etc/docker/daemon.json) -------------------


def register(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REGISTER), str(path), "/usr/bin/runsc"], capture_output=True, text=True, check=False)


def test_registration_writes_runsc_with_its_arguments_into_a_missing_daemon_json(tmp_path: Path) -> None:
    path = tmp_path / "docker" / "daemon.json"
    assert register(path).stdout == "changed\n"
    assert json.loads(path.read_text()) == {
        "runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--host-uds=open"]}}
    }


def test_registration_keeps_what_an_operator_has_and_adds_only_the_missing_arguments(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    operator = {
        "log-level": "warn",
        "runtimes": {
            "kata": {"path": "/usr/bin/kata-runtime"},
            "runsc": {"path": "/opt/gvisor/runsc", "runtimeArgs": ["--debug", "--network=none"]},
        },
    }
    path.write_text(json.dumps(operator))
    assert register(path).stdout == "changed\n"
    written = json.loads(path.read_text())
    assert written["log-level"] == "warn"
    assert written["runtimes"]["kata"] == {"path": "/usr/bin/kata-runtime"}
    assert written["runtimes"]["runsc"] == {
        "path": "/opt/gvisor/runsc",
        "runtimeArgs": ["--debug", "--network=none", "--host-uds=open"],
    }


def test_registration_a_second_time_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    register(path)
    before = path.read_text()
    assert register(path).stdout == ""
    assert path.read_text() == before


def test_registration_refuses_a_malformed_daemon_json_and_leaves_it_alone(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    path.write_text('{"runtimes": ')
    result = register(path)
    assert result.returncode == 1
    assert "is not valid JSON" in result.stderr
    assert "fix it" in result.stderr
    assert path.read_text() == '{"runtimes": '
