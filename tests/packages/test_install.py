"""The installer with the real npm against a fake registry on 127.0.0.1 (no Docker)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import anyio
import pytest

from metaagent.errors import ConfigError, MetaAgentError, RequestRefused, UpstreamTimeout
from metaagent.packages.install import Installation, NpmInstaller, ResolvedPackage, archive, check_registry
from tests.fake_registry import FakePackage, FakeRegistry, running_registry

pytestmark = pytest.mark.security


def scripted_package(marker_dir: Path) -> FakePackage:
    """Writes a marker file from every lifecycle script npm would run at install time."""

    def script(stage: str) -> str:
        return f"node -e \"require('fs').writeFileSync('{marker_dir / stage}', 'ran')\""

    stages = ("preinstall", "install", "postinstall", "prepare")
    return FakePackage("install-scripts", scripts={stage: script(stage) for stage in stages})


def install(registry: FakeRegistry, dependencies: dict[str, str], workdir: Path, **options: float) -> Installation:
    installer = NpmInstaller(
        registry.url,
        workdir / "cache",
        timeout_s=options.get("timeout_s", 30),
        max_bytes=int(options.get("max_bytes", 50 * 2**20)),
    )

    async def go() -> Installation:
        return await installer.install(dependencies, workdir / "project")

    return anyio.run(go)


def test_lifecycle_scripts_never_run(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    with running_registry(scripted_package(markers)) as registry:
        installation = install(registry, {"install-scripts": "latest"}, tmp_path / "ours")
        assert (installation.node_modules / "install-scripts" / "index.js").is_file()
        assert list(markers.iterdir()) == []
        # The same package with plain npm does write the markers: the test would see them.
        control = tmp_path / "control"
        control.mkdir()
        (control / "package.json").write_text('{"dependencies": {"install-scripts": "latest"}}')
        subprocess.run(
            ["npm", "install", f"--registry={registry.url}", f"--cache={tmp_path / 'cache2'}", "--no-audit"],
            cwd=control, check=True, capture_output=True, env={**os.environ, "npm_config_userconfig": "/dev/null"},
        )  # fmt: skip
    assert sorted(p.name for p in markers.iterdir()) == ["install", "postinstall", "preinstall"]


def test_the_resolved_tree_has_every_package_with_its_integrity(tmp_path: Path) -> None:
    dependency = FakePackage("tiny-dependency", "2.1.0")
    top = FakePackage("tiny-top", "1.2.3", dependencies={"tiny-dependency": "^2.0.0"})
    with running_registry(dependency, FakePackage("tiny-top", "1.0.0"), top) as registry:
        installation = install(registry, {"tiny-top": "^1.1"}, tmp_path)
        assert installation.resolved == (
            ResolvedPackage("tiny-dependency", "2.1.0", registry.integrity_of(dependency)),
            ResolvedPackage("tiny-top", "1.2.3", registry.integrity_of(top)),
        )


def test_a_registry_that_does_not_answer_in_time_gives_the_timeout_error(tmp_path: Path) -> None:
    with running_registry(FakePackage("slow-package")) as registry:
        registry.slow["slow-package"] = 20
        with pytest.raises(UpstreamTimeout) as caught:
            install(registry, {"slow-package": "latest"}, tmp_path, timeout_s=2)
    assert caught.value.status_code == 504
    assert "did not finish installing slow-package within 2 s" in caught.value.message


def test_a_version_the_registry_lacks_is_the_callers_to_fix(tmp_path: Path) -> None:
    with running_registry(FakePackage("tiny", "1.0.0")) as registry, pytest.raises(RequestRefused) as caught:
        install(registry, {"tiny": "^2"}, tmp_path)
    assert caught.value.extra["npm_code"] == "ETARGET"
    assert "No matching version found for tiny@^2" in caught.value.message
    assert str(tmp_path) not in caught.value.message


def test_a_tree_larger_than_the_app_directory_is_refused(tmp_path: Path) -> None:
    big = FakePackage("big-package", files={"index.js": b"1", "data.bin": os.urandom(300_000)})
    with running_registry(big) as registry, pytest.raises(RequestRefused) as caught:
        install(registry, {"big-package": "latest"}, tmp_path, max_bytes=200_000)
    assert "more than the" in caught.value.message
    assert "MB app directory" in caught.value.message


def test_an_unreachable_registry_is_an_upstream_error(tmp_path: Path) -> None:
    with running_registry() as registry:
        url = registry.url  # nothing listens there any more
    with pytest.raises(MetaAgentError) as caught:
        install(_at(url), {"tiny": "latest"}, tmp_path, timeout_s=60)
    assert caught.value.status_code == 502


def _at(url: str) -> FakeRegistry:
    registry = FakeRegistry()
    registry.url = url
    return registry


def test_the_archive_is_owned_by_root_and_read_only(tmp_path: Path) -> None:
    tree = tmp_path / "node_modules"
    (tree / "pkg" / "lib").mkdir(parents=True)
    (tree / "pkg" / "lib" / "a.js").write_text("1")
    (tree / "pkg" / "lib" / "a.js").chmod(0o777)
    (tree / "pkg" / "link.js").symlink_to("/etc/passwd")
    with tarfile.open(archive(tree, tmp_path / "t.tar")) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"pkg", "pkg/lib", "pkg/lib/a.js"}
    assert all(m.uid == 0 and m.gid == 0 for m in members.values())
    assert members["pkg/lib/a.js"].mode == 0o644
    assert members["pkg/lib"].mode == 0o755


@pytest.mark.parametrize("url", ["ftp://registry.example/", "registry.npmjs.org", "https://user:pw@r.example/"])
def test_a_registry_setting_that_is_not_an_http_url_refuses_start_up(url: str) -> None:
    with pytest.raises(ConfigError):
        check_registry(url)


def test_npm_is_on_this_machine() -> None:
    assert shutil.which("npm"), "install npm (apt-get install npm): the package tests need it"
