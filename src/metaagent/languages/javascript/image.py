"""JavaScript's program image: Debian's Node 18 on a minimal root fs, built offline without a registry.

Nothing can be pulled on the machines this runs on, so the image is assembled here:

1. ``debootstrap`` a Debian minbase with ``nodejs``, ``dumb-init`` and ``ca-certificates`` into a cache
   folder (about 40 s, once; a completion marker makes later builds reuse it);
2. copy out only what node needs (the binaries, the libraries ``ldd`` lists, ``/usr/share/nodejs``, the
   CA bundle), add passwd/group entries for uid 1001 and the trusted runner, build the runner's V8 startup
   snapshots with that node (runner/snapshot.js), and check that no shell, package manager or
   setuid/setgid file made it in;
3. hand that tree to the engine as a ``FROM scratch`` build context.

Steps 1 and 3, and the copying and checks of step 2, are `languages.rootfs`, which every language's
image shares; this module is Node's recipe.

The tag hashes the runner's files and the recipe, so changing the runner makes a new image, and such a
rebuild costs seconds because step 1 is cached. All functions block; call them from a worker thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import docker
import docker.errors

from metaagent.languages.language import ImageBuildError
from metaagent.languages.rootfs import (
    GROUP,
    IMAGE_LABEL,
    PASSWD,
    BootstrapRecipe,
    build_rootfs_image,
    check_rootfs,
    copy_in,
    files_record,
    inside,
    install_files,
    log_progress,
    make_dirs,
    package_version,
    prune_repository,
    require_file,
    run,
    runner_files,
    shared_libraries,
)

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
    "trusted_runner_files",
]


IMAGE_REPOSITORY = "metaagent-sandbox"
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
BOOTSTRAP_PACKAGES = ("nodejs", "dumb-init", "ca-certificates")
NODE_MAJOR = 18

_BINARIES = ("/usr/bin/node", "/usr/bin/dumb-init")
_TREES = ("/usr/share/nodejs", "/etc/ssl/certs/ca-certificates.crt")


# --- naming -------------------------------------------------------------------------------------------


def trusted_runner_files() -> list[Path]:
    """The trusted runner's files, which every language's image carries in /opt/metaagent."""
    files = runner_files(RUNNER_DIR)
    require_file(files, RUNNER_DIR, PurePosixPath(RUNNER_PATH).name, "the trusted runner")
    return files


def _recipe_hash() -> str:
    header = f"recipe {RECIPE_VERSION} bootstrap {NODE_BOOTSTRAP.key()}\n".encode()
    return hashlib.sha256(header + files_record(trusted_runner_files())).hexdigest()[:12]


def image_tag() -> str:
    """``metaagent-sandbox:<metaagent version>-<12 hex of the recipe hash>``."""
    return f"{IMAGE_REPOSITORY}:{package_version()}-{_recipe_hash()}"


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
    return prune_repository(client, IMAGE_REPOSITORY, image_tag())


# --- build --------------------------------------------------------------------------------------------


def build_image(
    client: docker.DockerClient,
    *,
    cache_dir: Path,
    progress: Callable[[str], None] = log_progress,
) -> str:
    """Builds the sandbox image unless its tag already exists; returns the image id."""
    return build_rootfs_image(
        client,
        tag=image_tag(),
        bootstrap=NODE_BOOTSTRAP,
        assemble=_assemble_rootfs,
        contents="node, dumb-init, their libraries, the runner",
        cache_dir=cache_dir,
        progress=progress,
    )


# --- step 1: debootstrap (cached) ---------------------------------------------------------------------


def _check_node_bootstrap(bootstrap: Path, tools: dict[str, str]) -> str:
    version = run(
        [tools["chroot"], str(bootstrap), "/usr/bin/node", "--version"],
        what="node inside the fresh debootstrap",
        timeout=60,
    ).strip()
    if not version.startswith(f"v{NODE_MAJOR}."):
        raise ImageBuildError(
            f"debootstrap installed node {version}, not {NODE_MAJOR}.x: check BOOTSTRAP_SUITE in languages/rootfs.py"
        )
    return f"node {version}"


NODE_BOOTSTRAP = BootstrapRecipe(BOOTSTRAP_PACKAGES, _check_node_bootstrap, "about 40 s")


# --- step 2: the minimal root fs ----------------------------------------------------------------------


def _assemble_rootfs(bootstrap: Path, rootfs: Path, tools: dict[str, str]) -> None:
    rootfs.mkdir(mode=0o755)
    rootfs.chmod(0o755)
    paths: list[PurePosixPath] = []
    for binary in _BINARIES:
        paths.append(PurePosixPath(binary))
        paths.extend(shared_libraries(bootstrap, binary, tools))
    paths.extend(PurePosixPath(tree) for tree in _TREES)
    for path in dict.fromkeys(paths):  # ordered and without repeats
        copy_in(bootstrap, rootfs, path)

    make_dirs(rootfs, PurePosixPath("/etc"))
    for name, content in (("passwd", PASSWD), ("group", GROUP)):
        (rootfs / "etc" / name).write_text(content)
        (rootfs / "etc" / name).chmod(0o644)

    install_files(rootfs, trusted_runner_files(), PurePosixPath(RUNNER_PATH).parent)

    for empty, mode in (("tmp", 0o1777), ("app", 0o755)):
        (rootfs / empty).mkdir()
        (rootfs / empty).chmod(mode)
    _build_snapshots(rootfs, tools)
    check_rootfs(rootfs, _BINARIES)


def _build_snapshots(rootfs: Path, tools: dict[str, str]) -> None:
    # In a chroot of the finished root fs, so that each snapshot is built by the very node that starts from it.
    for memory_mb in SNAPSHOT_MEMORY_MB:
        blob = _snapshot_path(memory_mb)
        run(
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
        inside(rootfs, PurePosixPath(blob)).chmod(0o644)
