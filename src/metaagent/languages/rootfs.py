"""The build every language's image shares: a cached debootstrap, a minimal root fs copied out of it, and
a ``FROM scratch`` import into the engine, without a registry.

Nothing can be pulled on the machines this runs on, so each image is assembled here from a recipe
(`languages.javascript.image`, `languages.python.image`):

1. ``debootstrap`` a Debian minbase with the recipe's packages into a cache folder (`BootstrapRecipe`;
   once per package list: a completion marker makes later builds reuse it);
2. the recipe copies out only what its runtime needs (`copy_in`, `shared_libraries`), adds its runner's
   files (`runner_files`, `install_files`; the tag hashes them, `files_record`) and checks that no shell,
   package manager or setuid/setgid file made it in (`check_rootfs`);
3. that tree goes to the engine as a ``FROM scratch`` build context, labelled `IMAGE_LABEL` and run as
   uid `SANDBOX_UID` (`build_rootfs_image`). `prune_repository` removes a repository's other tags.

All functions block; call them from a worker thread.
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
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import docker
import docker.errors

from metaagent.languages.language import ImageBuildError

__all__ = [
    "BOOTSTRAP_MARKER",
    "GROUP",
    "IMAGE_LABEL",
    "LDD_LINE",
    "PASSWD",
    "SANDBOX_UID",
    "BootstrapRecipe",
    "ImageBuildError",
    "bootstrap_key",
    "build_rootfs_image",
    "check_rootfs",
    "copy_in",
    "files_record",
    "inside",
    "install_files",
    "log_progress",
    "make_dirs",
    "package_version",
    "prune_repository",
    "require_file",
    "resolve_in_root",
    "run",
    "runner_files",
    "shared_libraries",
]

logger = logging.getLogger(__name__)

IMAGE_LABEL = "org.metaagent.sandbox"
# Bump to force a fresh debootstrap (for example to pick up Debian security updates).
BOOTSTRAP_RECIPE_VERSION = 1
BOOTSTRAP_SUITE = "bookworm"
BOOTSTRAP_MIRROR = "http://deb.debian.org/debian"
BOOTSTRAP_VARIANT = "minbase"
BOOTSTRAP_MARKER = ".metaagent-bootstrap-complete"

SANDBOX_UID = 1001
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Executables that must never be in an image under any name or folder.
_FORBIDDEN_NAMES = frozenset({"sh", "bash", "dash", "busybox", "apt", "apt-get", "dpkg", "su", "sudo", "env"})
PASSWD = f"root:x:0:0:root:/root:/nonexistent\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/tmp:/nonexistent\n"
GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n"
_MAX_SYMLINK_HOPS = 40


def log_progress(line: str) -> None:
    logger.info("sandbox image: %s", line)


# --- naming -------------------------------------------------------------------------------------------


def package_version() -> str:
    try:
        version = importlib.metadata.version("metaagent")
    except importlib.metadata.PackageNotFoundError:
        version = "0.0.0"
    # Docker tags allow [A-Za-z0-9_.-] only; local versions such as 1.0+dirty carry a "+".
    return re.sub(r"[^A-Za-z0-9_.-]", "-", version)


def bootstrap_key(packages: tuple[str, ...]) -> str:
    recipe = {
        "version": BOOTSTRAP_RECIPE_VERSION,
        "suite": BOOTSTRAP_SUITE,
        "mirror": BOOTSTRAP_MIRROR,
        "variant": BOOTSTRAP_VARIANT,
        "packages": list(packages),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def runner_files(folder: Path) -> list[Path]:
    """The files a runner folder holds (not its dot files or subfolders), by name; none if it is missing."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def require_file(files: list[Path], folder: Path, name: str, what: str) -> None:
    """Fails the build unless `files` (of `folder`) holds `name`: `what` names the runner in the message."""
    if not any(p.name == name for p in files):
        raise ImageBuildError(f"{what} is missing: {folder / name} does not exist")


def files_record(files: list[Path]) -> bytes:
    """The names, sizes and contents of `files` as one byte string, for a tag's hash: a change of any file
    (or a file more or less) changes it."""
    record = bytearray()
    for path in files:
        data = path.read_bytes()
        record += f"{path.name} {len(data)}\n".encode()
        record += data
    return bytes(record)


def prune_repository(client: docker.DockerClient, repository: str, current: str) -> tuple[list[str], list[str]]:
    """Removes the labelled tags of `repository` other than `current`; returns (removed, kept in use)."""
    removed: list[str] = []
    in_use: list[str] = []
    for image in client.images.list(filters={"label": IMAGE_LABEL}):
        for tag in image.tags:
            if tag == current or not tag.startswith(f"{repository}:"):
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


@dataclass(frozen=True)
class BootstrapRecipe:
    """A cached debootstrap: the packages it installs, and a check of the fresh tree that names what it
    found (written into the completion marker)."""

    packages: tuple[str, ...]
    check: Callable[[Path, dict[str, str]], str]
    duration: str  # what the first build's progress line promises

    def key(self) -> str:
        return bootstrap_key(self.packages)


def build_rootfs_image(
    client: docker.DockerClient,
    *,
    tag: str,
    bootstrap: BootstrapRecipe,
    assemble: Callable[[Path, Path, dict[str, str]], None],
    contents: str,
    cache_dir: Path,
    progress: Callable[[str], None] = log_progress,
) -> str:
    """Builds `tag` from a root fs that `assemble(bootstrap folder, root fs, tools)` makes and checks,
    unless the tag already exists; returns the image id. Builds of every image share one lock."""
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
        bootstrap_dir = _ensure_bootstrap(cache_dir, tools, progress, bootstrap)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
        try:
            progress(f"assembling the minimal root fs ({contents})")
            rootfs = work / "rootfs"
            assemble(bootstrap_dir, rootfs, tools)
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


def run(argv: list[str], *, what: str, timeout: float) -> str:
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


def _ensure_bootstrap(
    cache_dir: Path, tools: dict[str, str], progress: Callable[[str], None], recipe: BootstrapRecipe
) -> Path:
    final = cache_dir / f"bootstrap-{recipe.key()}"
    if (final / BOOTSTRAP_MARKER).is_file():
        progress(f"reusing the cached debootstrap in {final}")
        return final
    if final.exists():
        _remove_tree(final, tools)  # an unfinished folder from some older layout
    progress(
        f"running debootstrap for Debian {BOOTSTRAP_SUITE} with {', '.join(recipe.packages)} "
        f"(first build only, {recipe.duration})"
    )
    temp = Path(tempfile.mkdtemp(prefix=".bootstrap-", dir=cache_dir))
    try:
        run(
            [
                tools["debootstrap"],
                f"--variant={BOOTSTRAP_VARIANT}",
                f"--include={','.join(recipe.packages)}",
                BOOTSTRAP_SUITE,
                str(temp),
                BOOTSTRAP_MIRROR,
            ],
            what=f"debootstrap of Debian {BOOTSTRAP_SUITE} from {BOOTSTRAP_MIRROR} "
            "(check that the mirror is reachable and the disk has 400 MB free)",
            timeout=1800,
        )
        found = recipe.check(temp, tools)
        (temp / BOOTSTRAP_MARKER).write_text(f"{found}\n")
        temp.rename(final)
    except BaseException:
        _remove_tree(temp, tools)
        raise
    progress(f"debootstrap done ({found})")
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


def inside(root: Path, path: PurePosixPath) -> Path:
    return root / str(path).lstrip("/")


def resolve_in_root(
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
        host = inside(root, candidate)
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


def make_dirs(root: Path, path: PurePosixPath, mode: int = 0o755) -> None:
    current = root
    for part in path.parts[1:]:
        current = current / part
        if current.is_symlink():
            raise ImageBuildError(f"unexpected symbolic link {current} while assembling the root fs")
        if not current.exists():
            current.mkdir()
            current.chmod(mode)


def copy_in(
    source: Path,
    target: Path,
    path: PurePosixPath,
    ignore: Callable[[str, list[str]], set[str]] | None = None,
) -> None:
    """Copies ``path`` from one root to the other, recreating every symbolic link on the way; of a folder,
    the entries `ignore(host folder, names)` names are left out (as with shutil.copytree)."""
    links: list[tuple[PurePosixPath, str]] = []
    real = resolve_in_root(source, path, lambda link, dest: links.append((link, dest)))
    src = inside(source, real)
    if not src.exists():
        raise ImageBuildError(f"{path} is missing from the debootstrap in {source}: delete that folder")
    for link, dest in links:
        make_dirs(target, link.parent)
        made = inside(target, link)
        if made.is_symlink():
            if os.readlink(made) != dest:
                raise ImageBuildError(f"conflicting symbolic links for {link} while assembling the root fs")
        else:
            os.symlink(dest, made)
    make_dirs(target, real.parent)
    dst = inside(target, real)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    elif src.is_file():
        if not dst.exists():
            shutil.copy2(src, dst)
    else:
        raise ImageBuildError(f"{path} in {source} is neither a file nor a folder")


def install_files(rootfs: Path, files: list[Path], folder: PurePosixPath) -> None:
    """Writes `files` (from the checkout) into `folder` of the root fs, mode 0644 (root's, once imported)."""
    make_dirs(rootfs, folder)
    for path in files:
        dst = inside(rootfs, folder / path.name)
        dst.write_bytes(path.read_bytes())
        dst.chmod(0o644)


LDD_LINE = re.compile(r"^\s*(?:(\S+)\s+=>\s+)?(\S+)(?:\s+\(0x[0-9a-f]+\))?\s*$")


def shared_libraries(bootstrap: Path, binary: str, tools: dict[str, str]) -> list[PurePosixPath]:
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
        match = LDD_LINE.match(line)
        if match is None:
            continue
        where = match.group(2)
        if where.startswith("/"):
            libraries.append(PurePosixPath(where))  # linux-vdso has no file and no "/"
    return libraries


def check_rootfs(rootfs: Path, programs: tuple[str, ...]) -> None:
    """Fails the build if the tree holds a program besides `programs` (in /usr/bin), a shell, a package
    manager, a setuid/setgid file or a dead link."""
    problems: list[str] = []
    usr_bin = sorted(p.name for p in (rootfs / "usr" / "bin").iterdir())
    expected = sorted(PurePosixPath(b).name for b in programs)
    if usr_bin != expected:
        problems.append(f"/usr/bin holds {usr_bin}, expected only {expected}")
    for directory, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            host = Path(directory) / name
            inner = PurePosixPath("/") / host.relative_to(rootfs).as_posix()
            info = host.lstat()
            if stat.S_ISLNK(info.st_mode):
                real = resolve_in_root(rootfs, inner)
                if not inside(rootfs, real).exists():
                    problems.append(f"dangling symbolic link {inner} -> {os.readlink(host)}")
                continue
            if info.st_mode & (stat.S_ISUID | stat.S_ISGID):
                problems.append(f"setuid/setgid bit on {inner}")
            if stat.S_ISREG(info.st_mode) and info.st_mode & 0o111 and name in _FORBIDDEN_NAMES:
                problems.append(f"forbidden executable {inner}")
    if problems:
        raise ImageBuildError(
            "the assembled root fs is not minimal: " + "; ".join(problems) + " (fix the image's recipe)"
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
