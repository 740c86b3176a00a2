"""The Python sandbox image: built once per session (`scripts/test` builds it before the suite), checked
file by file, and run with the sandbox's locked-down container settings."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import cast

import anyio
import docker
import docker.errors
import pytest

from metaagent.executions import Execution, new_execution_id
from metaagent.languages.javascript import image as javascript_image
from metaagent.languages.language import ImageBuildError
from metaagent.languages.python import image as python_image
from metaagent.languages.python.image import (
    PYTHON_IMAGE_REPOSITORY,
    build_python_image,
    python_image_tag,
)
from metaagent.languages.rootfs import IMAGE_LABEL, runner_files
from metaagent.sandbox.engine import OWNER_PID_LABEL, SERVICE_LABEL, ContainerSpec, Engine
from metaagent.sandbox.execute import Outcome, execute
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime
from tests.sandbox.test_image import CACHE_DIR, Run, exported_files
from tests.test_cli import run as run_cli

pytestmark = pytest.mark.docker

PYTHON = ["/usr/bin/dumb-init", "--", "/usr/bin/python3", "-I", "-c"]
SCIENCE = """
import os, sys
import numpy as np, pandas as pd, scipy, scipy.optimize, scipy.stats, matplotlib
import matplotlib.pyplot as plt
frame = pd.DataFrame({"x": np.arange(10), "y": np.arange(10) ** 2})
figure, axes = plt.subplots()
axes.plot(frame.x, frame.y)
axes.set_title("squares, ÄÖÜ")
figure.savefig("/tmp/plot.png")
with open("/tmp/plot.png", "rb") as png:
    assert png.read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
best = scipy.optimize.minimize_scalar(lambda v: (v - 2) ** 2).x
print(matplotlib.get_backend(), round(float(best), 3), int(frame.y.sum()), os.getuid(), sys.flags.isolated)
"""
# Timestamp pycs stay valid only if the image keeps the sources' times: otherwise every import compiles
# again (the root is read-only, so nothing is written), which costs seconds for pandas and scipy.
STALE_BYTECODE = """
import importlib.util, os, sys
import numpy, pandas, scipy.stats, matplotlib.pyplot
stale = []
for module in list(sys.modules.values()):
    source = getattr(module, "__file__", None) or ""
    if not source.endswith(".py"):
        continue
    cached = importlib.util.cache_from_source(source)
    if not os.path.exists(cached):
        stale.append(source)
        continue
    with open(cached, "rb") as pyc:
        header = pyc.read(16)
    info = os.stat(source)
    flags, mtime, size = (int.from_bytes(header[i : i + 4], "little") for i in (4, 8, 12))
    if flags == 0 and (mtime, size) != (int(info.st_mtime) & 0xFFFFFFFF, info.st_size & 0xFFFFFFFF):
        stale.append(source)
print(stale)
"""


@pytest.fixture(scope="session")
def python_tag(docker_client: docker.DockerClient) -> str:
    build_python_image(docker_client, cache_dir=CACHE_DIR)
    return python_image_tag()


@pytest.fixture(scope="session")
def python_files(
    docker_client: docker.DockerClient, python_tag: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tarfile.TarInfo]:
    return exported_files(docker_client, python_tag, tmp_path_factory.mktemp("python-export"))


def run_python(tag: str, code: str, runtime: Runtime, memory_mb: int = 512) -> Outcome:
    """`python3 -I -c code` in a container of the engine's production settings (read-only root, no
    network, no capabilities, uid 1001, noexec tmpfs, limits), without any runner."""

    async def go() -> Outcome:
        engine = Engine()
        execution = Execution(new_execution_id(), 120, memory_mb)
        spec = ContainerSpec(
            name=f"metaagent-{execution.execution_id}",
            image=tag,
            command=[*PYTHON, code],
            memory_mb=memory_mb,
            cpus=0.5,
            labels={SERVICE_LABEL: "metaagent", OWNER_PID_LABEL: str(os.getpid())},
            runtime=runtime.name,
            pids_limit=runtime.pids_limit(),
            nproc=runtime.nproc(),
        )
        try:
            return await execute(engine, spec, b"", execution, timeout_s=120, grace_s=2, ready_marker=b"")
        finally:
            engine.close()

    return anyio.run(go)


def run_command(client: docker.DockerClient, tag: str, command: list[str]) -> Run:
    """`command` in a container without network, with a read-only root, as uid 1001; removed in the end."""
    container = client.containers.create(
        tag, command=command, network_mode="none", read_only=True, cap_drop=["ALL"], mem_limit="256m"
    )
    try:
        container.start()
        status = container.wait(timeout=60)
        stdout, stderr = (container.logs(stdout=out, stderr=not out).decode() for out in (True, False))
        return Run(int(status["StatusCode"]), stdout, stderr)
    finally:
        container.remove(force=True)


def runtimes_of(client: docker.DockerClient) -> list[Runtime]:
    registered = client.info().get("Runtimes", {})
    return [runtime for runtime in (RUNC, RUNSC) if runtime.name in registered]


# --- the build ----------------------------------------------------------------------------------------


def test_python_image_tag_names_its_repository_version_and_recipe_hash(python_tag: str) -> None:
    repository, _, version_hash = python_tag.partition(":")
    version, _, recipe = version_hash.rpartition("-")
    assert repository == PYTHON_IMAGE_REPOSITORY == "metaagent-sandbox-python"
    assert version == "0.1.0"
    assert len(recipe) == 12
    assert int(recipe, 16) >= 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MATPLOTLIBRC", "backend: svg\n"),
        ("STDLIB_LEFT_OUT", python_image.STDLIB_LEFT_OUT - {"lib2to3"}),
        ("DIST_PACKAGES_LEFT_OUT_PREFIXES", ("pythran",)),
        ("RECIPE_VERSION", python_image.RECIPE_VERSION + 1),
    ],
)
def test_changing_the_recipe_changes_the_tag(monkeypatch: pytest.MonkeyPatch, name: str, value: object) -> None:
    original = python_image_tag()
    assert python_image_tag() == original  # the same recipe, the same tag
    monkeypatch.setattr(python_image, name, value)
    assert python_image_tag() != original


def test_changing_a_trusted_runner_file_changes_the_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = python_image_tag()
    runner_copy = tmp_path / "runner"
    shutil.copytree(javascript_image.RUNNER_DIR, runner_copy)
    monkeypatch.setattr(javascript_image, "RUNNER_DIR", runner_copy)
    assert python_image_tag() == original
    (runner_copy / "supervisor.js").write_text((runner_copy / "supervisor.js").read_text() + "\n// changed\n")
    assert python_image_tag() != original


def test_changing_adding_or_renaming_a_python_runner_file_changes_the_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "runner.py").write_text("print('one')\n")
    monkeypatch.setattr(python_image, "PYTHON_RUNNER_DIR", tmp_path)
    tags = [python_image_tag()]
    (tmp_path / "runner.py").write_text("print('two')\n")
    tags.append(python_image_tag())
    (tmp_path / "wire.py").write_text("")
    tags.append(python_image_tag())
    (tmp_path / "wire.py").rename(tmp_path / "files.py")
    tags.append(python_image_tag())
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("folder", ["empty", "missing"])
def test_building_without_the_python_runner_fails_before_the_engine_and_names_the_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    runner_dir = tmp_path / "runner"
    if folder == "empty":
        runner_dir.mkdir()
    monkeypatch.setattr(python_image, "PYTHON_RUNNER_DIR", runner_dir)
    python_image_tag()  # naming the image (prune does) needs no runner
    no_engine = cast(docker.DockerClient, object())
    with pytest.raises(ImageBuildError, match=f"the Python runner is missing: {runner_dir / 'runner.py'} does not"):
        build_python_image(no_engine, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_changing_the_debian_packages_changes_the_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    original = python_image_tag()
    packages = (*python_image.PYTHON_BOOTSTRAP.packages, "python3-sympy")
    monkeypatch.setattr(
        python_image, "PYTHON_BOOTSTRAP", dataclasses.replace(python_image.PYTHON_BOOTSTRAP, packages=packages)
    )
    assert python_image_tag() != original


def test_second_build_is_served_from_the_existing_image(docker_client: docker.DockerClient, python_tag: str) -> None:
    lines: list[str] = []
    image_id = build_python_image(docker_client, cache_dir=CACHE_DIR, progress=lines.append)
    assert image_id == docker_client.images.get(python_tag).id
    assert lines == [f"{python_tag} is already built"]


def test_python_image_is_labelled_and_runs_as_sandbox_user(docker_client: docker.DockerClient, python_tag: str) -> None:
    config = docker_client.images.get(python_tag).attrs["Config"]
    assert config["Labels"][IMAGE_LABEL] == "1"
    assert config["User"] == "1001:1001"
    assert config["WorkingDir"] == "/tmp"


def test_sandbox_build_builds_the_python_image_only_when_python_is_enabled(tmp_path: Path, python_tag: str) -> None:
    both = run_cli(tmp_path, "sandbox", "build")
    assert both.returncode == 0, both.stderr
    assert f"{python_tag} is already built" in both.stdout
    javascript_only = run_cli(tmp_path, "sandbox", "build", METAAGENT_LANGUAGES="javascript")
    assert javascript_only.returncode == 0, javascript_only.stderr
    assert PYTHON_IMAGE_REPOSITORY not in javascript_only.stdout
    assert "metaagent-sandbox:" in javascript_only.stdout


# --- the image's file system --------------------------------------------------------------------------


def test_python_image_has_only_python_dumb_init_and_node_as_programs(python_files: dict[str, tarfile.TarInfo]) -> None:
    programs = {name for name in python_files if name.startswith(("usr/bin/", "usr/sbin/", "sbin/", "bin/"))}
    assert programs == {"usr/bin/python3", "usr/bin/python3.11", "usr/bin/dumb-init", "usr/bin/node"}
    assert "bin" not in python_files


def test_python_image_carries_both_runners_read_only_and_of_nodes_files_only_its_builtins(
    python_files: dict[str, tarfile.TarInfo],
) -> None:
    expected = {f"opt/metaagent/{p.name}" for p in javascript_image.trusted_runner_files()}
    expected |= {f"opt/metaagent/python/{p.name}" for p in runner_files(python_image.PYTHON_RUNNER_DIR)}
    assert {"opt/metaagent/runner.js", "opt/metaagent/python/runner.py"} <= expected
    carried = {n for n, info in python_files.items() if n.startswith("opt/metaagent/") and not info.isdir()}
    assert carried == expected
    assert {python_files[n].mode & 0o7777 for n in carried} == {0o644}
    assert python_files["opt/metaagent/python"].mode & 0o7777 == 0o755
    # Of /usr/share/nodejs, only the built-in modules Debian's node loads from there at every start.
    node_share = {n for n, info in python_files.items() if n.startswith("usr/share/nodejs/") and not info.isdir()}
    assert node_share == {
        "usr/share/nodejs/acorn/dist/acorn.js",
        "usr/share/nodejs/acorn-walk/dist/walk.js",
        "usr/share/nodejs/cjs-module-lexer/lexer.js",
        "usr/share/nodejs/cjs-module-lexer/dist/lexer.js",
        "usr/share/nodejs/undici/undici-fetch.js",
    }
    assert not any(n.startswith("etc/ssl") for n in python_files)


def test_python_image_has_no_shell_pip_compiler_or_package_manager(python_files: dict[str, tarfile.TarInfo]) -> None:
    forbidden = {"sh", "bash", "dash", "busybox", "apt", "apt-get", "dpkg", "su", "sudo", "env", "ld", "as"}
    forbidden |= {"gcc", "g++", "cc", "c++", "cpp", "gfortran", "cc1", "cc1plus", "collect2", "pythran", "f2py"}
    names = {name.rsplit("/", 1)[-1]: name for name, info in python_files.items() if not info.isdir()}
    assert sorted(names[n] for n in forbidden if n in names) == []
    tops = {name.split("/")[4] for name in python_files if name.startswith("usr/lib/python3/dist-packages/")}
    assert not {t for t in tops if t.lower().startswith(("pip", "pythran", "setuptools", "gast", "beniget"))}
    assert not any(n.startswith(("usr/lib/python3.11/ensurepip", "usr/lib/gcc", "usr/include")) for n in python_files)
    stdlib = "usr/lib/python3.11/"
    assert not any(n.startswith((f"{stdlib}tkinter", f"{stdlib}idlelib", f"{stdlib}test/")) for n in python_files)
    assert not any("/tests/" in n for n in python_files)


def test_python_image_has_no_setuid_setgid_or_writable_files(python_files: dict[str, tarfile.TarInfo]) -> None:
    assert [n for n, info in python_files.items() if info.mode & (stat.S_ISUID | stat.S_ISGID)] == []
    writable = [n for n, info in python_files.items() if not info.issym() and info.mode & 0o022 and n != "tmp"]
    assert writable == []
    assert {(info.uid, info.gid) for info in python_files.values()} == {(0, 0)}
    assert python_files["tmp"].mode & 0o7777 == 0o1777


def test_python_image_keeps_ctypes_and_the_agg_matplotlibrc(python_files: dict[str, tarfile.TarInfo]) -> None:
    dynload = "usr/lib/python3.11/lib-dynload/"
    assert f"{dynload}_ctypes.cpython-311-x86_64-linux-gnu.so" in python_files  # pandas and scipy need it
    assert f"{dynload}readline.cpython-311-x86_64-linux-gnu.so" not in python_files
    assert f"{dynload}_testcapi.cpython-311-x86_64-linux-gnu.so" not in python_files
    assert "etc/matplotlibrc" in python_files
    assert "usr/share/matplotlib/mpl-data/fonts/ttf/DejaVuSans.ttf" in python_files


# --- python in a locked-down container ----------------------------------------------------------------


def test_node_starts_in_the_python_image(docker_client: docker.DockerClient, python_tag: str) -> None:
    run = run_command(docker_client, python_tag, ["/usr/bin/node", "-e", "console.log(1 + 1, process.getuid())"])
    assert run == Run(0, "2 1001\n", "")


def test_numpy_pandas_scipy_and_a_matplotlib_png_work_in_the_locked_down_container(
    docker_client: docker.DockerClient, python_tag: str
) -> None:
    for runtime in runtimes_of(docker_client):
        outcome = run_python(python_tag, SCIENCE, runtime)
        assert outcome.exit_code == 0, (runtime.name, outcome.stderr.text())
        assert outcome.stdout.text() == "agg 2.0 285 1001 1\n", runtime.name


def test_every_imported_module_has_up_to_date_bytecode(python_tag: str) -> None:
    outcome = run_python(python_tag, STALE_BYTECODE, RUNC)
    assert outcome.exit_code == 0, outcome.stderr.text()
    assert outcome.stdout.text() == "[]\n"
