"""JavaScript's program image: Debian's Node 18 on a minimal root fs, built offline without a registry.

Nothing can be pulled on the machines this runs on, so the image is assembled here:

1. ``debootstrap`` a Debian minbase with ``nodejs``, ``dumb-init`` and ``ca-certificates`` into a cache
   folder (about 40 s, once; a completion marker makes later builds reuse it);
2. copy out only what node needs (the binaries, the libraries ``ldd`` lists, ``/usr/share/nodejs``, the
   CA bundle), add passwd/group entries for uid 1001 and the trusted runner, build the runner's V8 startup
   snapshots with that node (runner/snapshot.js), and check that no shell, package manager or
   setuid/setgid file made it in;
3. hand that tree to the engine as a ``FROM scratch`` build context.

The tag hashes the runner's files and the recipe, so changing the runner makes a new image, and such a
rebuild costs seconds because step 1 is cached. All functions block; call them from a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import docker
import docker.errors

from metaagent.languages.language import ImageBuildError

__all__ = [
    "IMAGE_LABEL",
    "IMAGE_REPOSITORY",
    "RUNNER_DIR",
    "RUNNER_PATH",
    "ImageBuildError",
    "build_image",
    "image_present",
    "image_tag",
    "prune_images",
    "runner_command",
]

logger = logging.getLogger(__name__)

IMAGE_REPOSITORY = "metaagent-sandbox"
IMAGE_LABEL = "org.metaagent.sandbox"
# The runner's files stay with the sandbox (runner/supervisor.js is the trusted half of every session):
# the image carries all of them, and the tag hashes their names and contents, not where this module is.
RUNNER_DIR = Path(__file__).parents[2] / "sandbox" / "runner"
RUNNER_PATH = "/opt/metaagent/runner.js"  # where runner.js lands in the image


RUNNER_SNAPSHOT_ENTRY = "/opt/metaagent/snapshot.js"  # runner/snapshot.js: what the snapshots hold
# Memory sizes whose runner starts from a V8 startup snapshot baked into the image (runner/snapshot.js).
# V8 refuses a snapshot built under another heap limit, and the heap limit follows the memory size, so
# there is one snapshot per size here (about 3 MB each); other sizes load the runner without one.
SNAPSHOT_MEMORY_MB = (64, 128, 256, 512, 1024)


def heap_mb(memory_mb: int) -> int:
    """Node's heap limit for a container of `memory_mb`: below the container's, so that a hog usually ends
    with a JavaScript heap error the program's author can read, rather than a silent OOM kill."""
    return max(32, memory_mb * 3 // 4)


def _node_flags(memory_mb: int) -> list[str]:
    """--experimental-vm-modules: the gate decides import() itself, through vm's importModuleDynamically
    (runner/imports.js), which node honours only with this flag. A snapshot must be built with the flags
    it is started with."""
    return [f"--max-old-space-size={heap_mb(memory_mb)}", "--experimental-vm-modules"]


def _snapshot_path(memory_mb: int) -> str:
    return f"/opt/metaagent/runner-{memory_mb}m.blob"


def runner_command(memory_mb: int) -> list[str]:
    """node running the trusted runner in a container of `memory_mb` MiB, from a snapshot if there is one."""
    snapshot = [f"--snapshot-blob={_snapshot_path(memory_mb)}"] if memory_mb in SNAPSHOT_MEMORY_MB else []
    return ["/usr/bin/node", *_node_flags(memory_mb), *snapshot, RUNNER_PATH]


# Bump when the assembly below changes in a way the runner files do not show (new files, modes...).
RECIPE_VERSION = 2
# Bump to force a fresh debootstrap (for example to pick up Debian security updates).
BOOTSTRAP_RECIPE_VERSION = 1
BOOTSTRAP_SUITE = "bookworm"
BOOTSTRAP_MIRROR = "http://deb.debian.org/debian"
BOOTSTRAP_VARIANT = "minbase"
BOOTSTRAP_PACKAGES = ("nodejs", "dumb-init", "ca-certificates")
BOOTSTRAP_MARKER = ".metaagent-bootstrap-complete"
NODE_MAJOR = 18

SANDBOX_UID = 1001
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_BINARIES = ("/usr/bin/node", "/usr/bin/dumb-init")
_TREES = ("/usr/share/nodejs", "/etc/ssl/certs/ca-certificates.crt")
# Executables that must never be in the image under any name or folder.
_FORBIDDEN_NAMES = frozenset({"sh", "bash", "dash", "busybox", "apt", "apt-get", "dpkg", "su", "sudo", "env"})
_PASSWD = f"root:x:0:0:root:/root:/nonexistent\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/tmp:/nonexistent\n"
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n"
_MAX_SYMLINK_HOPS = 40


def _log_progress(line: str) -> None:
    logger.info("sandbox image: %s", line)


# --- naming -------------------------------------------------------------------------------------------


def _package_version() -> str:
    try:
        version = importlib.metadata.version("metaagent")
    except importlib.metadata.PackageNotFoundError:
        version = "0.0.0"
    # Docker tags allow [A-Za-z0-9_.-] only; local versions such as 1.0+dirty carry a "+".
    return re.sub(r"[^A-Za-z0-9_.-]", "-", version)


def _runner_files() -> list[Path]:
    files = sorted(p for p in RUNNER_DIR.iterdir() if p.is_file() and not p.name.startswith("."))
    if not any(p.name == PurePosixPath(RUNNER_PATH).name for p in files):
        raise ImageBuildError(f"the trusted runner is missing: {RUNNER_DIR / 'runner.js'} does not exist")
    return files


def _bootstrap_key() -> str:
    recipe = {
        "version": BOOTSTRAP_RECIPE_VERSION,
        "suite": BOOTSTRAP_SUITE,
        "mirror": BOOTSTRAP_MIRROR,
        "variant": BOOTSTRAP_VARIANT,
        "packages": list(BOOTSTRAP_PACKAGES),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _recipe_hash() -> str:
    digest = hashlib.sha256(f"recipe {RECIPE_VERSION} bootstrap {_bootstrap_key()}\n".encode())
    for path in _runner_files():
        data = path.read_bytes()
        digest.update(f"{path.name} {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()[:12]


def image_tag() -> str:
    """``metaagent-sandbox:<metaagent version>-<12 hex of the recipe hash>``."""
    return f"{IMAGE_REPOSITORY}:{_package_version()}-{_recipe_hash()}"


def image_present(client: docker.DockerClient) -> bool:
    try:
        client.images.get(image_tag())
    except docker.errors.ImageNotFound:
        return False
    return True


def prune_images(client: docker.DockerClient) -> tuple[list[str], list[str]]:
    """Removes the sandbox image tags other than this version's; returns (removed, kept in use).

    Every change of the runner makes a new tag, and the old ones stay behind. A tag that a container
    still uses (another service's version, say) is kept; the engine refuses to remove it anyway.
    """
    current = image_tag()
    removed: list[str] = []
    in_use: list[str] = []
    for image in client.images.list(filters={"label": IMAGE_LABEL}):
        for tag in image.tags:
            if tag == current or not tag.startswith(f"{IMAGE_REPOSITORY}:"):
                continue
            try:
                client.images.remove(tag)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: a container uses it
                    raise
                in_use.append(tag)
            else:
                removed.append(tag)
    return removed, in_use


# --- build --------------------------------------------------------------------------------------------


def build_image(
    client: docker.DockerClient,
    *,
    cache_dir: Path,
    progress: Callable[[str], None] = _log_progress,
) -> str:
    """Builds the sandbox image unless its tag already exists; returns the image id."""
    tag = image_tag()
    existing = _existing_image_id(client, tag)
    if existing is not None:
        progress(f"{tag} is already built")
        return existing

    tools = _find_tools()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ImageBuildError(f"cannot create the image cache folder {cache_dir}: {exc}") from exc
    with _build_lock(cache_dir):
        # Another process may have finished the same build while we waited for the lock.
        existing = _existing_image_id(client, tag)
        if existing is not None:
            progress(f"{tag} was built meanwhile")
            return existing
        _remove_leftovers(cache_dir, tools)
        bootstrap = _ensure_bootstrap(cache_dir, tools, progress)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
        try:
            progress("assembling the minimal root fs (node, dumb-init, their libraries, the runner)")
            rootfs = work / "rootfs"
            _assemble_rootfs(bootstrap, rootfs, tools)
            _check_rootfs(rootfs)
            progress(f"importing the root fs into Docker as {tag}")
            image_id = _import_rootfs(client, rootfs, work, tag)
        finally:
            _remove_tree(work, tools)
    size = _image_size(client, image_id)
    progress(f"built {tag} ({size / 1e6:.1f} MB)")
    return image_id


def _existing_image_id(client: docker.DockerClient, tag: str) -> str | None:
    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as exc:
        raise ImageBuildError(f"cannot ask the Docker engine about {tag}: {exc}") from exc
    return str(image.id)


def _image_size(client: docker.DockerClient, image_id: str) -> int:
    try:
        return int(client.images.get(image_id).attrs.get("Size", 0))
    except docker.errors.APIError:
        return 0


def _find_tools() -> dict[str, str]:
    if os.geteuid() != 0:
        raise ImageBuildError(
            "building the sandbox image needs root (debootstrap and chroot): run the build as root once"
        )
    search = os.pathsep.join([os.environ.get("PATH", ""), _SBIN_PATH])
    tools: dict[str, str] = {}
    for name in ("debootstrap", "chroot", "umount"):
        found = shutil.which(name, path=search)
        if found is None:
            hint = "run scripts/ensure-docker" if name == "debootstrap" else "install coreutils and mount"
            raise ImageBuildError(f"{name} is not installed: {hint}")
        tools[name] = found
    return tools


@contextlib.contextmanager
def _build_lock(cache_dir: Path) -> Iterator[None]:
    # flock locks belong to the open file, so this serialises threads and processes alike.
    with (cache_dir / ".build.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(argv: list[str], *, what: str, timeout: float) -> str:
    env = {"PATH": _SBIN_PATH, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ImageBuildError(f"{what} did not finish within {timeout:.0f} s") from exc
    except OSError as exc:
        raise ImageBuildError(f"{what} could not start: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise ImageBuildError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


# --- step 1: debootstrap (cached) ---------------------------------------------------------------------


def _ensure_bootstrap(cache_dir: Path, tools: dict[str, str], progress: Callable[[str], None]) -> Path:
    final = cache_dir / f"bootstrap-{_bootstrap_key()}"
    if (final / BOOTSTRAP_MARKER).is_file():
        progress(f"reusing the cached debootstrap in {final}")
        return final
    if final.exists():
        _remove_tree(final, tools)  # an unfinished folder from some older layout
    progress(
        f"running debootstrap for Debian {BOOTSTRAP_SUITE} with {', '.join(BOOTSTRAP_PACKAGES)} "
        "(first build only, about 40 s)"
    )
    temp = Path(tempfile.mkdtemp(prefix=".bootstrap-", dir=cache_dir))
    try:
        _run(
            [
                tools["debootstrap"],
                f"--variant={BOOTSTRAP_VARIANT}",
                f"--include={','.join(BOOTSTRAP_PACKAGES)}",
                BOOTSTRAP_SUITE,
                str(temp),
                BOOTSTRAP_MIRROR,
            ],
            what=f"debootstrap of Debian {BOOTSTRAP_SUITE} from {BOOTSTRAP_MIRROR} "
            "(check that the mirror is reachable and the disk has 400 MB free)",
            timeout=1800,
        )
        version = _run(
            [tools["chroot"], str(temp), "/usr/bin/node", "--version"],
            what="node inside the fresh debootstrap",
            timeout=60,
        ).strip()
        if not version.startswith(f"v{NODE_MAJOR}."):
            raise ImageBuildError(
                f"debootstrap installed node {version}, not {NODE_MAJOR}.x: check BOOTSTRAP_SUITE in image.py"
            )
        (temp / BOOTSTRAP_MARKER).write_text(f"node {version}\n")
        temp.rename(final)
    except BaseException:
        _remove_tree(temp, tools)
        raise
    progress(f"debootstrap done (node {version})")
    return final


def _mounts_below(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    mounts: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point.startswith(prefix):
                mounts.append(point)
    return mounts


def _remove_tree(path: Path, tools: dict[str, str]) -> None:
    """Deletes a build folder, first detaching any /proc or /sys a killed debootstrap left mounted."""
    if not path.exists():
        return
    for point in sorted(_mounts_below(path), key=len, reverse=True):
        subprocess.run([tools["umount"], "-l", point], capture_output=True, check=False, timeout=60)
    if _mounts_below(path):
        raise ImageBuildError(f"{path} still has mounts below it: unmount them, then delete it by hand")
    shutil.rmtree(path)


def _remove_leftovers(cache_dir: Path, tools: dict[str, str]) -> None:
    # Folders left by a build that was killed; safe to delete because we hold the build lock.
    for pattern in (".bootstrap-*", ".build-*"):
        for leftover in cache_dir.glob(pattern):
            _remove_tree(leftover, tools)


# --- step 2: the minimal root fs ----------------------------------------------------------------------


def _inside(root: Path, path: PurePosixPath) -> Path:
    return root / str(path).lstrip("/")


def _resolve_in_root(
    root: Path,
    path: PurePosixPath,
    on_link: Callable[[PurePosixPath, str], None] | None = None,
) -> PurePosixPath:
    """Resolves ``path`` as if ``root`` were ``/``, never following a link out of ``root``."""
    pending = list(path.parts[1:])
    current = PurePosixPath("/")
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        host = _inside(root, candidate)
        if not host.is_symlink():
            current = candidate
            continue
        hops += 1
        if hops > _MAX_SYMLINK_HOPS:
            raise ImageBuildError(f"too many symbolic links resolving {path} in {root}")
        target = os.readlink(host)
        if on_link is not None:
            on_link(candidate, target)
        target_path = PurePosixPath(target)
        if target_path.is_absolute():
            current = PurePosixPath("/")
        pending[:0] = [p for p in target_path.parts if p != "/"]
    return current


def _make_dirs(root: Path, path: PurePosixPath, mode: int = 0o755) -> None:
    current = root
    for part in path.parts[1:]:
        current = current / part
        if current.is_symlink():
            raise ImageBuildError(f"unexpected symbolic link {current} while assembling the root fs")
        if not current.exists():
            current.mkdir()
            current.chmod(mode)


def _copy_in(source: Path, target: Path, path: PurePosixPath) -> None:
    """Copies ``path`` from one root to the other, recreating every symbolic link on the way."""
    links: list[tuple[PurePosixPath, str]] = []
    real = _resolve_in_root(source, path, lambda link, dest: links.append((link, dest)))
    src = _inside(source, real)
    if not src.exists():
        raise ImageBuildError(f"{path} is missing from the debootstrap in {source}: delete that folder")
    for link, dest in links:
        _make_dirs(target, link.parent)
        made = _inside(target, link)
        if made.is_symlink():
            if os.readlink(made) != dest:
                raise ImageBuildError(f"conflicting symbolic links for {link} while assembling the root fs")
        else:
            os.symlink(dest, made)
    _make_dirs(target, real.parent)
    dst = _inside(target, real)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    elif src.is_file():
        if not dst.exists():
            shutil.copy2(src, dst)
    else:
        raise ImageBuildError(f"{path} in {source} is neither a file nor a folder")


_LDD_LINE = re.compile(r"^\s*(?:(\S+)\s+=>\s+)?(\S+)(?:\s+\(0x[0-9a-f]+\))?\s*$")


def _shared_libraries(bootstrap: Path, binary: str, tools: dict[str, str]) -> list[PurePosixPath]:
    # ldd runs inside the chroot so that it resolves against the bootstrap's own libraries and loader.
    argv = [tools["chroot"], str(bootstrap), "/usr/bin/ldd", binary]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False, env={"PATH": _SBIN_PATH, "LC_ALL": "C"}
    )
    output = done.stdout + done.stderr
    if done.returncode != 0:
        if "not a dynamic executable" in output:
            return []  # statically linked: nothing to copy
        raise ImageBuildError(f"ldd {binary} in {bootstrap} failed (exit {done.returncode}): {output.strip()}")
    libraries: list[PurePosixPath] = []
    for line in done.stdout.splitlines():
        if "not found" in line:
            raise ImageBuildError(f"{binary} needs {line.split()[0]}, which the debootstrap lacks")
        match = _LDD_LINE.match(line)
        if match is None:
            continue
        where = match.group(2)
        if where.startswith("/"):
            libraries.append(PurePosixPath(where))  # linux-vdso has no file and no "/"
    return libraries


def _assemble_rootfs(bootstrap: Path, rootfs: Path, tools: dict[str, str]) -> None:
    rootfs.mkdir(mode=0o755)
    rootfs.chmod(0o755)
    paths: list[PurePosixPath] = []
    for binary in _BINARIES:
        paths.append(PurePosixPath(binary))
        paths.extend(_shared_libraries(bootstrap, binary, tools))
    paths.extend(PurePosixPath(tree) for tree in _TREES)
    for path in dict.fromkeys(paths):  # ordered and without repeats
        _copy_in(bootstrap, rootfs, path)

    _make_dirs(rootfs, PurePosixPath("/etc"))
    for name, content in (("passwd", _PASSWD), ("group", _GROUP)):
        (rootfs / "etc" / name).write_text(content)
        (rootfs / "etc" / name).chmod(0o644)

    runner_dir = PurePosixPath(RUNNER_PATH).parent
    _make_dirs(rootfs, runner_dir)
    for runner_file in _runner_files():
        dst = _inside(rootfs, runner_dir / runner_file.name)
        dst.write_bytes(runner_file.read_bytes())
        dst.chmod(0o644)

    for empty, mode in (("tmp", 0o1777), ("app", 0o755)):
        (rootfs / empty).mkdir()
        (rootfs / empty).chmod(mode)
    _build_snapshots(rootfs, tools)


def _build_snapshots(rootfs: Path, tools: dict[str, str]) -> None:
    # In a chroot of the finished root fs, so that each snapshot is built by the very node that starts from it.
    for memory_mb in SNAPSHOT_MEMORY_MB:
        blob = _snapshot_path(memory_mb)
        _run(
            [
                tools["chroot"],
                str(rootfs),
                "/usr/bin/node",
                *_node_flags(memory_mb),
                f"--snapshot-blob={blob}",
                "--build-snapshot",
                RUNNER_SNAPSHOT_ENTRY,
            ],
            what=f"node --build-snapshot of the runner for {memory_mb} MiB",
            timeout=300,
        )
        _inside(rootfs, PurePosixPath(blob)).chmod(0o644)


def _check_rootfs(rootfs: Path) -> None:
    """Fails the build if the tree holds a shell, a package manager, a setuid/setgid file or a dead link."""
    problems: list[str] = []
    usr_bin = sorted(p.name for p in (rootfs / "usr" / "bin").iterdir())
    expected = sorted(PurePosixPath(b).name for b in _BINARIES)
    if usr_bin != expected:
        problems.append(f"/usr/bin holds {usr_bin}, expected only {expected}")
    for directory, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            host = Path(directory) / name
            inner = PurePosixPath("/") / host.relative_to(rootfs).as_posix()
            info = host.lstat()
            if stat.S_ISLNK(info.st_mode):
                real = _resolve_in_root(rootfs, inner)
                if not _inside(rootfs, real).exists():
                    problems.append(f"dangling symbolic link {inner} -> {os.readlink(host)}")
                continue
            if info.st_mode & (stat.S_ISUID | stat.S_ISGID):
                problems.append(f"setuid/setgid bit on {inner}")
            if stat.S_ISREG(info.st_mode) and info.st_mode & 0o111 and name in _FORBIDDEN_NAMES:
                problems.append(f"forbidden executable {inner}")
    if problems:
        raise ImageBuildError(
            "the assembled root fs is not minimal: " + "; ".join(problems) + " (fix the recipe in image.py)"
        )


# --- step 3: import into the engine -------------------------------------------------------------------


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _write_rootfs_tar(rootfs: Path, out: Path) -> None:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                host = Path(directory) / name
                tar.add(host, arcname=host.relative_to(rootfs).as_posix(), recursive=False, filter=_as_root)


def _dockerfile(tag: str) -> bytes:
    return (
        "FROM scratch\n"
        "ADD rootfs.tar /\n"
        f'LABEL {IMAGE_LABEL}="1" {IMAGE_LABEL}.tag="{tag}"\n'
        f"USER {SANDBOX_UID}:{SANDBOX_UID}\n"
        "WORKDIR /tmp\n"
    ).encode()


def _import_rootfs(client: docker.DockerClient, rootfs: Path, work: Path, tag: str) -> str:
    # A FROM scratch build needs no registry; ADD unpacks the nested tar with its modes and 0:0 owners.
    rootfs_tar = work / "rootfs.tar"
    _write_rootfs_tar(rootfs, rootfs_tar)
    context = work / "context.tar"
    with tarfile.open(context, "w") as tar:
        dockerfile = _dockerfile(tag)
        info = _as_root(tarfile.TarInfo("Dockerfile"))
        info.size, info.mode = len(dockerfile), 0o644
        tar.addfile(info, io.BytesIO(dockerfile))
        tar.add(rootfs_tar, arcname="rootfs.tar", filter=_as_root)
    try:
        with context.open("rb") as fileobj:
            image, _logs = client.images.build(
                fileobj=fileobj,
                custom_context=True,
                tag=tag,
                rm=True,
                forcerm=True,
                pull=False,
            )
    except docker.errors.BuildError as exc:
        raise ImageBuildError(f"the Docker engine refused to build {tag}: {exc.msg}") from exc
    except docker.errors.APIError as exc:
        raise ImageBuildError(f"the Docker engine failed while building {tag}: {exc}") from exc
    return str(image.id)
