"""Installing an allowed set of npm packages with the host's npm, so that none of their code runs.

Each installation gets a fresh temporary folder holding only a generated package.json (no .npmrc can
be there), an empty user and global npm configuration, a clean environment (no variable of the
service, so no key, except how this host reaches a registry: its CA bundle and proxy), and npm's own
cache under the service's cache folder. Lifecycle scripts are off
(`--ignore-scripts`: no preinstall, install, postinstall or implicit node-gyp build), as are audit and
funding calls, bin links (no symlinks in the tree) and npm's log files. npm runs in its own process
group, which is killed as a whole at the deadline or when the request is cancelled.

What comes back: the installed `node_modules` (checked against the app directory's size), the
resolved tree from package-lock.json (name, version, integrity of every package), and a tar of the
tree with root ownership and read-only modes, ready for the sandbox volume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import anyio.abc

from metaagent.errors import ConfigError, RequestRefused, Unavailable, UpstreamError, UpstreamTimeout

log = logging.getLogger("metaagent.packages")

# npm error codes that mean the request asked for something the registry does not have.
_NOT_FOUND_CODES = frozenset({"ETARGET", "E404", "ENOVERSIONS", "EINVALIDTAGNAME", "EINVALIDPACKAGENAME"})
_OUTPUT_CAP = 256 * 1024
# What npm may take from the service's environment: how this host reaches a registry (its trust store
# and proxy), nothing else. These go to npm only; no package code runs, and the sandbox gets none.
_PASSED_THROUGH = (
    "NODE_EXTRA_CA_CERTS",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "NO_PROXY",
    "no_proxy",
)


@dataclass(frozen=True)
class ResolvedPackage:
    name: str
    version: str
    integrity: str | None

    def record(self) -> dict[str, str | None]:
        return {"name": self.name, "version": self.version, "integrity": self.integrity}


@dataclass(frozen=True)
class Installation:
    node_modules: Path
    resolved: tuple[ResolvedPackage, ...]
    size_bytes: int


def check_registry(url: str) -> str:
    """The registry URL with a trailing slash; ConfigError unless it is an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise ConfigError(
            f"METAAGENT_NPM_REGISTRY is not a registry URL: {url!r}",
            ["write it like https://registry.npmjs.org/ (http or https, a host, no credentials)"],
        )
    return url if url.endswith("/") else url + "/"


class NpmInstaller:
    def __init__(self, registry: str, cache_dir: Path, timeout_s: float, max_bytes: int) -> None:
        self.registry = check_registry(registry)
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def _npm(self) -> tuple[str, str]:
        """npm's path and a PATH with the node it runs on; 503 when the host has no npm."""
        npm = shutil.which("npm")
        node = shutil.which("node")
        if npm is None or node is None:
            raise Unavailable("npm is not installed on the service's host: install it (apt-get install npm)")
        return npm, os.pathsep.join(dict.fromkeys([str(Path(node).parent), "/usr/bin", "/bin"]))

    async def install(self, dependencies: dict[str, str], workdir: Path) -> Installation:
        """Installs `dependencies` ({name: spec}) into `workdir`/node_modules; raises a MetaAgentError
        that says what to do when npm fails, is too slow, or the tree is too large."""
        npm, path = self._npm()
        names = ", ".join(sorted(dependencies))
        home = workdir / "home"
        home.mkdir(parents=True)
        user_config, global_config = workdir / "user.npmrc", workdir / "global.npmrc"
        user_config.write_text("")
        global_config.write_text("")
        manifest = {"name": "metaagent-sandbox-packages", "version": "0.0.0", "private": True}
        (workdir / "package.json").write_text(json.dumps({**manifest, "dependencies": dependencies}))
        npm_cache = self.cache_dir / "npm"
        npm_cache.mkdir(parents=True, exist_ok=True)
        command = [
            npm,
            "install",
            "--ignore-scripts",
            "--no-audit",
            "--no-fund",
            "--omit=dev",
            "--no-bin-links",
            "--no-update-notifier",
            "--logs-max=0",
            "--json",
            # A refused or failing registry ends the install in seconds instead of npm's backoff of minutes.
            "--fetch-retries=1",
            "--fetch-retry-mintimeout=1000",
            "--fetch-retry-maxtimeout=3000",
            f"--registry={self.registry}",
            f"--userconfig={user_config}",
            f"--globalconfig={global_config}",
            f"--cache={npm_cache}",
        ]
        env = {name: os.environ[name] for name in _PASSED_THROUGH if name in os.environ}
        env.update(PATH=path, HOME=str(home), LANG="C.UTF-8", NO_COLOR="1")
        log.info("npm install %s from %s", names, self.registry)
        # Shielded: a cancel during the spawn would lose a running npm; it lands below, which kills it.
        with anyio.CancelScope(shield=True):
            process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, cwd=workdir, env=env, start_new_session=True
            )
        stdout, stderr = bytearray(), bytearray()
        try:
            with anyio.move_on_after(self.timeout_s) as deadline:
                async with anyio.create_task_group() as group:
                    group.start_soon(_drain, process.stdout, stdout)
                    group.start_soon(_drain, process.stderr, stderr)
                    await process.wait()
        finally:
            with anyio.CancelScope(shield=True):  # reaped and its pipes closed, even when cancelled
                if process.returncode is None:  # the deadline, or the request was cancelled
                    _kill_group(process)
                    await process.wait()
                await process.aclose()
        if deadline.cancelled_caught:
            raise UpstreamTimeout(
                f"npm did not finish installing {names} within {self.timeout_s:g} s "
                f"(the registry {self.registry} is slow or unreachable); retry later or ask for fewer packages"
            )
        if process.returncode != 0:
            raise self._failure(bytes(stdout), bytes(stderr), names, workdir)
        node_modules = workdir / "node_modules"
        size = tree_size(node_modules)
        if size > self.max_bytes:
            raise RequestRefused(
                f"The packages {names} take {size / 2**20:.1f} MB installed, more than the "
                f"{self.max_bytes / 2**20:g} MB app directory holds; ask for fewer or smaller packages",
                packages=sorted(dependencies),
            )
        return Installation(node_modules, resolved_tree(workdir / "package-lock.json"), size)

    def _failure(self, stdout: bytes, stderr: bytes, names: str, workdir: Path) -> Exception:
        code, summary = _npm_error(stdout, stderr)
        # npm's messages may name our folders; the caller needs neither.
        for folder in (str(workdir), str(self.cache_dir)):
            summary = summary.replace(folder, "<dir>")
        log.warning("npm install %s failed: %s %s", names, code, summary)
        if code in _NOT_FOUND_CODES:
            return RequestRefused(f"npm could not install {names}: {summary} Check the name and version", npm_code=code)
        return UpstreamError(f"npm could not install {names} from {self.registry}: {code} {summary}", npm_code=code)


async def _drain(stream: anyio.abc.ByteReceiveStream | None, into: bytearray) -> None:
    if stream is None:
        return
    async for chunk in stream:
        if len(into) < _OUTPUT_CAP:
            into.extend(chunk[: _OUTPUT_CAP - len(into)])


def _kill_group(process: anyio.abc.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # npm and every child it started


def _npm_error(stdout: bytes, stderr: bytes) -> tuple[str, str]:
    """npm's error code and summary, from its --json report or, failing that, its stderr."""
    try:
        report = json.loads(stdout.decode("utf-8", "replace") or "{}")
        error = report.get("error") or {}
        code, summary = str(error.get("code") or "EUNKNOWN"), str(error.get("summary") or "").strip()
        if summary:
            return code, summary
    except (json.JSONDecodeError, AttributeError):
        code = "EUNKNOWN"
    lines = [ln.removeprefix("npm error ").strip() for ln in stderr.decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("A complete log")]
    return code, " ".join(lines)[:500] or "npm failed without a message"


def resolved_tree(lock_path: Path) -> tuple[ResolvedPackage, ...]:
    """Every installed package (transitive ones included) from package-lock.json, sorted by name."""
    lock = json.loads(lock_path.read_text())
    found: list[ResolvedPackage] = []
    for key, entry in lock.get("packages", {}).items():
        if not key or "node_modules/" not in key or entry.get("link"):
            continue
        name = entry.get("name") or key.rsplit("node_modules/", 1)[1]
        found.append(ResolvedPackage(name, str(entry.get("version", "")), entry.get("integrity")))
    return tuple(sorted(found, key=lambda p: (p.name, p.version)))


def tree_size(root: Path) -> int:
    """Bytes of the regular files under root (symbolic links are not followed)."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def archive(node_modules: Path, into: Path) -> Path:
    """A tar of the tree's contents for the volume: owned by root, directories 0755, files 0644
    (readable by the sandbox's uid 1001, writable by nobody there); anything but regular files and
    directories (links, devices, fifos) is left out."""

    def normalise(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not (member.isdir() or member.isfile()):
            log.info("left out of the package volume (not a file or folder): %s", member.name)
            return None
        member.uid = member.gid = 0
        member.uname = member.gname = ""
        member.mode = 0o755 if member.isdir() else 0o644
        return member

    with tarfile.open(into, "w") as tar:
        for child in sorted(node_modules.iterdir()):
            tar.add(child, arcname=child.name, filter=normalise)
    return into
