"""The Python sandbox image: Debian's CPython 3.11 with numpy, pandas, matplotlib and scipy, and node for the
trusted runner, without a shell.

Built like the Node image, with the build every image shares (`languages.rootfs`), from its own cached
debootstrap: Debian's ``python3-scipy`` hard-depends on pythran, which brings gcc, g++ and the boost
headers, and every debootstrap holds the Essential set (dash, bash, coreutils, apt...). So the packages
are installed in the build stage only, and the image gets a runtime tree copied out of it:

- ``/usr/bin/python3.11`` (and its ``python3`` link), ``dumb-init`` and ``/usr/bin/node``, with the
  libraries ``ldd`` lists. node is there because the container's first process is the trusted runner of
  every language (``sandbox/runner/``, in ``/opt/metaagent``): the session supervisor and its wire are one
  program, and Python (``runner/``, in ``/opt/metaagent/python``) is its child
  (`python_runner_command`). Of ``/usr/share/nodejs``, only the files Debian's node loads as its own
  built-in modules at every start (acorn, cjs-module-lexer, undici's fetch: `NODE_BUILTIN_FILES`;
  without them node aborts before running a line). The packages there serve JavaScript code (the
  runner's top-level await in a JavaScript session), which a Python container never runs. No CA bundle
  either: node starts without one, and only node's own TLS clients would read it;
- the standard library without its test suites and the tools that need a display, a compiler or pip
  (`STDLIB_LEFT_OUT`), and without Debian's ``sitecustomize`` (it reads ``/etc/python3.11``);
- ``/usr/lib/python3/dist-packages`` without pythran and what only it needs, the test suites, the Tk
  bindings, and sympy and lxml, which fonttools brings and the four never import
  (`DIST_PACKAGES_LEFT_OUT_*`), with the libraries its extension modules link to (OpenBLAS, LAPACK,
  libgfortran, freetype, libpng...) and whatever its symbolic links point to;
- matplotlib's data (Debian keeps it in ``/usr/share/matplotlib``, DejaVu and STIX fonts included) and
  a ``/etc/matplotlibrc`` that selects the Agg backend (Debian's says TkAgg);
- the time zone database (pandas and dateutil read it) and the loader's cache as ldconfig left it;
- bytecode for every module: the pycs Debian's install compiled, kept with their sources' times (they
  are timestamp pycs, and copies and the image keep file times), and any missing ones compiled by the
  image's own interpreter. The root is read-only at run time, so Python could never write one, and
  pandas or scipy would otherwise compile their sources on every import (seconds).

``_ctypes`` stays: pandas and scipy do not import without ctypes (`PYTHON_HARDENING.md`). Keeping code
away from it is the job of the Python gate, and the container is the boundary either way.

The tag hashes the recipe below and the names and contents of both runners' files, so a change of any
runner file makes a new image; such a rebuild redoes only the assembly (the debootstrap is cached). All
functions block; call them from a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import docker

from metaagent.languages.javascript.image import NODE_MAJOR, RUNNER_PATH, trusted_runner_files
from metaagent.languages.language import ImageBuildError
from metaagent.languages.rootfs import (
    GROUP,
    LDD_LINE,
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
    resolve_in_root,
    run,
    runner_files,
    shared_libraries,
)

__all__ = [
    "PYTHON_IMAGE_REPOSITORY",
    "build_python_image",
    "prune_python_images",
    "python_image_tag",
    "python_runner_command",
]

PYTHON_IMAGE_REPOSITORY = "metaagent-sandbox-python"
# Bump when the assembly below changes in a way the constants do not show.
RECIPE_VERSION = 2
PYTHON_VERSION = "3.11"
BOOTSTRAP_PACKAGES = (
    "python3",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "python3-scipy",
    "dumb-init",
    "fonts-dejavu-core",
    "nodejs",  # the session supervisor (sandbox/runner/supervisor.js) is the same in every language
)
NODE = "/usr/bin/node"
PROGRAMS = (f"/usr/bin/python{PYTHON_VERSION}", "/usr/bin/python3", "/usr/bin/dumb-init", NODE)
STDLIB = f"/usr/lib/python{PYTHON_VERSION}"
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
TREES = (STDLIB, DIST_PACKAGES, "/usr/share/matplotlib", "/usr/share/zoneinfo", "/etc/ld.so.cache")
# Names (files or folders, at any depth of the standard library) left out: the test suites and the C
# modules built for them, the Tk GUI with its IDE and turtle, 2to3, pip's bootstrapper (it holds a pip
# wheel), the static library and makefiles for building extensions, Debian's sitecustomize (a link into
# /etc/python3.11, which the image lacks) and readline (for interactive prompts only; it reads any file
# without an audit event, PYTHON_HARDENING.md).
STDLIB_LEFT_OUT = frozenset(
    {
        "test",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "turtle.py",
        "lib2to3",
        "ensurepip",
        f"config-{PYTHON_VERSION}-x86_64-linux-gnu",
        "sitecustomize.py",
        "dist-packages",  # python3-numpy's second copy of _multiarray_umath, shadowed on sys.path
    }
)
STDLIB_LEFT_OUT_PREFIXES = (
    "_tkinter.",
    "readline.",
    "_test",  # _testcapi, _testbuffer, _testinternalcapi...
    "_ctypes_test.",
    "_xxtestfuzz.",
    "xxlimited",
)
# Top-level entries of dist-packages left out: pythran and what only it needs (gast, beniget, ply, omp),
# and what fonttools brings but numpy, pandas, scipy and matplotlib never import: sympy with mpmath
# (125 MB) and lxml (with libxml2, libxslt and ICU, 40 MB).
DIST_PACKAGES_LEFT_OUT_PREFIXES = (
    "pythran",
    "gast",
    "beniget",
    "ply",
    "omp",
    "sympy",
    "isympy",
    "mpmath",
    "lxml",
)
# Anywhere in dist-packages: the libraries' own test suites (150 MB; no module outside them imports
# them: numpy.testing, pandas._testing and scipy._lib._testutils stay), matplotlib's WebAgg files (links
# into libjs-jquery; WebAgg needs tornado, which is not there), and, by prefix, the Tk bindings of Pillow
# and matplotlib.
DIST_PACKAGES_LEFT_OUT_NAMES = frozenset({"tests", "web_backend"})
DIST_PACKAGES_LEFT_OUT_ANYWHERE = ("_imagingtk.", "ImageTk.py", "_tkagg.", "backend_tkagg.", "backend_tkcairo.")
MATPLOTLIBRC = "backend: Agg\n"
# What must import in the finished tree (checked in a chroot of it, before the image is made).
SMOKE_TEST = (
    "import os; os.environ['MPLCONFIGDIR'] = '/tmp/matplotlib'\n"
    "import numpy, pandas, scipy, scipy.linalg, scipy.stats, scipy.optimize, matplotlib\n"
    "import matplotlib.pyplot as plt\n"
    "assert matplotlib.get_backend().lower() == 'agg', matplotlib.get_backend()\n"
    "print(numpy.__version__, pandas.__version__, scipy.__version__, matplotlib.__version__)\n"
)
NODE_SMOKE_TEST = "process.stdout.write(process.versions.node)"
# Debian's node takes some of its built-in modules from /usr/share/nodejs (its build's
# NODE_SHARED_BUILTIN_<name>_PATH defines) and aborts at start if one is missing: this lists them.
NODE_BUILTIN_FILES = (
    "process.stdout.write(JSON.stringify(process.config.target_defaults.defines"
    ".filter((d) => d.startsWith('NODE_SHARED_BUILTIN_')).map((d) => d.split('=')[1])))"
)
_LDD_BATCH = 64

# The Python runner's files (`runner/`), and where the image carries them. The container's first process is
# the trusted runner of every language (`sandbox/runner/runner.js`, on node): in a Python container it
# starts `PYTHON_PROGRAM` as its child at once, so that a warm container holds a Python that has
# imported numpy, pandas and matplotlib, and then relays a one-shot run to it or becomes a session's
# supervisor with it as the session's program. The supervisor and its wire are one program in every
# language; what is Python's is the child.
PYTHON_RUNNER_DIR = Path(__file__).parent / "runner"
PYTHON_RUNNER_PATH = "/opt/metaagent/python/runner.py"
PYTHON_RUNNER_FOLDER = PurePosixPath(PYTHON_RUNNER_PATH).parent
PYTHON_PROGRAM = (f"/usr/bin/python{PYTHON_VERSION}", "-I", "-S", PYTHON_RUNNER_PATH)
# node's heap in a Python container: it only relays bytes and runs the supervisor, never user code.
SUPERVISOR_HEAP_MB = 48
# node in a Python container compiles every function of its runner and built-ins as it loads them, not on
# their first call: Debian's node has no code cache, so otherwise the first payload's relay (streams,
# pipes, JSON) is compiled on the execution's clock, 2-3 ms of a pooled run here. It runs no user code.
SUPERVISOR_NODE_FLAGS = ("--no-lazy", f"--max-old-space-size={SUPERVISOR_HEAP_MB}")


def python_runner_command(memory_mb: int) -> list[str]:
    """The container's command: node's trusted runner with the Python program as its child. The program's
    memory is bounded by the container's limit (`memory_mb`); node's heap is bounded by its own."""
    del memory_mb  # the container's limit bounds Python; node's heap is fixed
    return [NODE, *SUPERVISOR_NODE_FLAGS, RUNNER_PATH, "--program", *PYTHON_PROGRAM]


def _python_runner_files() -> list[Path]:
    """The Python runner's files, for the build: it fails without runner.py."""
    files = runner_files(PYTHON_RUNNER_DIR)
    require_file(files, PYTHON_RUNNER_DIR, PurePosixPath(PYTHON_RUNNER_PATH).name, "the Python runner")
    return files


def _recipe() -> dict[str, object]:
    return {
        "version": RECIPE_VERSION,
        "bootstrap": PYTHON_BOOTSTRAP.key(),
        "programs": list(PROGRAMS),
        "trees": list(TREES),
        "node_builtin_files": NODE_BUILTIN_FILES,
        "stdlib_left_out": sorted(STDLIB_LEFT_OUT),
        "stdlib_left_out_prefixes": list(STDLIB_LEFT_OUT_PREFIXES),
        "dist_packages_left_out": list(DIST_PACKAGES_LEFT_OUT_PREFIXES),
        "dist_packages_left_out_names": sorted(DIST_PACKAGES_LEFT_OUT_NAMES),
        "dist_packages_left_out_files": list(DIST_PACKAGES_LEFT_OUT_ANYWHERE),
        "matplotlibrc": MATPLOTLIBRC,
        "passwd": PASSWD,
        "group": GROUP,
        # The runners' names and contents. The Python runner's as they are, runner.py or not, so that
        # naming the image (prune does) never fails; building it does without runner.py.
        "trusted_runner": hashlib.sha256(files_record(trusted_runner_files())).hexdigest(),
        "python_runner": hashlib.sha256(files_record(runner_files(PYTHON_RUNNER_DIR))).hexdigest(),
    }


def python_image_tag() -> str:
    """``metaagent-sandbox-python:<metaagent version>-<12 hex of the recipe hash>``."""
    digest = hashlib.sha256(json.dumps(_recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{PYTHON_IMAGE_REPOSITORY}:{package_version()}-{digest}"


def prune_python_images(client: docker.DockerClient) -> tuple[list[str], list[str]]:
    """Removes the Python image tags other than this version's; returns (removed, kept in use)."""
    return prune_repository(client, PYTHON_IMAGE_REPOSITORY, python_image_tag())


def build_python_image(
    client: docker.DockerClient,
    *,
    cache_dir: Path,
    progress: Callable[[str], None] = log_progress,
) -> str:
    """Builds the Python sandbox image unless its tag already exists; returns the image id."""
    _python_runner_files()  # before the lock and the debootstrap's minutes, not after them
    return build_rootfs_image(
        client,
        tag=python_image_tag(),
        bootstrap=PYTHON_BOOTSTRAP,
        assemble=_assemble_rootfs,
        contents=f"python{PYTHON_VERSION}, numpy, pandas, matplotlib, scipy, node, their libraries, fonts, the runners",
        cache_dir=cache_dir,
        progress=progress,
    )


def _check_bootstrap(bootstrap: Path, tools: dict[str, str]) -> str:
    found = run(
        [tools["chroot"], str(bootstrap), PROGRAMS[0], "-I", "-c", SMOKE_TEST],
        what="python with numpy, pandas, scipy and matplotlib inside the fresh debootstrap",
        timeout=300,
    ).split()
    if len(found) != 4:
        raise ImageBuildError(f"the fresh debootstrap's python printed {found}, not four versions")
    return f"python {PYTHON_VERSION}, numpy {found[0]}, pandas {found[1]}, scipy {found[2]}, matplotlib {found[3]}"


PYTHON_BOOTSTRAP = BootstrapRecipe(BOOTSTRAP_PACKAGES, _check_bootstrap, "5 to 15 minutes")


# --- the minimal root fs ------------------------------------------------------------------------------


def _leave_out_of_stdlib(_folder: str, names: list[str]) -> set[str]:
    return {n for n in names if n in STDLIB_LEFT_OUT or n.startswith(STDLIB_LEFT_OUT_PREFIXES)}


def _leave_out_of_dist_packages(folder: str, names: list[str]) -> set[str]:
    left_out = {n for n in names if n in DIST_PACKAGES_LEFT_OUT_NAMES or n.startswith(DIST_PACKAGES_LEFT_OUT_ANYWHERE)}
    if folder.rstrip("/").endswith(DIST_PACKAGES):
        left_out.update(n for n in names if n.startswith(DIST_PACKAGES_LEFT_OUT_PREFIXES))
    return left_out


def _ignore_for(tree: str) -> Callable[[str, list[str]], set[str]] | None:
    if tree == STDLIB:
        return _leave_out_of_stdlib
    if tree == DIST_PACKAGES:
        return _leave_out_of_dist_packages
    return None


def _extension_modules(rootfs: Path) -> list[PurePosixPath]:
    found: list[PurePosixPath] = []
    for tree in (STDLIB, DIST_PACKAGES):
        for directory, _dirnames, filenames in os.walk(inside(rootfs, PurePosixPath(tree))):
            for name in filenames:
                host = Path(directory) / name
                if ".so" in name and not host.is_symlink():
                    found.append(PurePosixPath("/") / host.relative_to(rootfs).as_posix())
    return sorted(found)


def _libraries_of(bootstrap: Path, files: list[PurePosixPath], tools: dict[str, str]) -> list[PurePosixPath]:
    """The libraries that `files` (extension modules) link to, from ldd in the bootstrap, a batch of
    files per chroot (one chroot per file would take minutes)."""
    libraries: dict[PurePosixPath, None] = {}
    for start in range(0, len(files), _LDD_BATCH):
        batch = [str(f) for f in files[start : start + _LDD_BATCH]]
        output = run(
            [tools["chroot"], str(bootstrap), "/usr/bin/ldd", *batch], what="ldd of extension modules", timeout=300
        )
        for line in output.splitlines():
            if not line.startswith(("\t", " ")):
                continue  # "<file>:", the header of each file's list
            if "not found" in line:
                raise ImageBuildError(f"an extension module needs {line.split()[0]}, which the debootstrap lacks")
            match = LDD_LINE.match(line)
            if match is not None and match.group(2).startswith("/"):
                libraries.setdefault(PurePosixPath(match.group(2)))
    return list(libraries)


def _node_builtin_files(bootstrap: Path, tools: dict[str, str]) -> list[PurePosixPath]:
    output = run(
        [tools["chroot"], str(bootstrap), NODE, "-e", NODE_BUILTIN_FILES],
        what="node's list of its built-in files",
        timeout=60,
    )
    try:
        files = [PurePosixPath(f) for f in json.loads(output)]
    except (ValueError, TypeError) as exc:
        raise ImageBuildError(
            f"node's list of its built-in files is not a JSON list of paths: {output[:200]!r}"
        ) from exc
    if not all(f.is_absolute() for f in files):
        raise ImageBuildError(f"node's built-in files are not all absolute paths: {output[:200]!r}")
    return files


def _copy_link_targets(bootstrap: Path, rootfs: Path) -> None:
    """Copies in what the tree's symbolic links point to (matplotlib's data under /usr/share, fonts...),
    until no link dangles."""
    for _round in range(8):
        missing: list[PurePosixPath] = []
        for directory, dirnames, filenames in os.walk(rootfs):
            for name in dirnames + filenames:
                host = Path(directory) / name
                if host.is_symlink():
                    inner = PurePosixPath("/") / host.relative_to(rootfs).as_posix()
                    if not inside(rootfs, resolve_in_root(rootfs, inner)).exists():
                        missing.append(inner)
        if not missing:
            return
        for link in missing:
            copy_in(bootstrap, rootfs, link)
    raise ImageBuildError("symbolic links in the Python tree keep pointing at missing files")


def _assemble_rootfs(bootstrap: Path, rootfs: Path, tools: dict[str, str]) -> None:
    rootfs.mkdir(mode=0o755)
    rootfs.chmod(0o755)
    paths: list[PurePosixPath] = []
    for program in PROGRAMS:
        paths.append(PurePosixPath(program))
        paths.extend(shared_libraries(bootstrap, program, tools))
    paths.extend(_node_builtin_files(bootstrap, tools))
    for path in dict.fromkeys(paths):
        copy_in(bootstrap, rootfs, path)
    for tree in TREES:
        copy_in(bootstrap, rootfs, PurePosixPath(tree), _ignore_for(tree))
    for library in _libraries_of(bootstrap, _extension_modules(rootfs), tools):
        copy_in(bootstrap, rootfs, library)
    _copy_link_targets(bootstrap, rootfs)

    make_dirs(rootfs, PurePosixPath("/etc"))
    for name, content in (("passwd", PASSWD), ("group", GROUP), ("matplotlibrc", MATPLOTLIBRC)):
        (rootfs / "etc" / name).write_text(content)
        (rootfs / "etc" / name).chmod(0o644)
    install_files(rootfs, trusted_runner_files(), PurePosixPath(RUNNER_PATH).parent)
    install_files(rootfs, _python_runner_files(), PYTHON_RUNNER_FOLDER)
    (rootfs / "tmp").mkdir()
    (rootfs / "tmp").chmod(0o1777)

    run(
        [
            tools["chroot"],
            str(rootfs),
            PROGRAMS[0],
            "-I",
            "-m",
            "compileall",
            "-q",
            "-j",
            "1",  # more workers need multiprocessing's semaphores, which a chroot without /dev/shm lacks
            STDLIB,
            DIST_PACKAGES,
        ],
        what="compileall of the image's Python modules",
        timeout=1800,
    )
    _normalise_modes(rootfs)
    check_rootfs(rootfs, PROGRAMS)
    run(
        [tools["chroot"], str(rootfs), PROGRAMS[0], "-I", "-c", SMOKE_TEST],
        what="python importing numpy, pandas, scipy and matplotlib in the assembled root fs",
        timeout=300,
    )
    version = run(
        [tools["chroot"], str(rootfs), NODE, "-e", NODE_SMOKE_TEST],
        what="node in the assembled root fs",
        timeout=60,
    )
    if not version.startswith(f"{NODE_MAJOR}."):
        raise ImageBuildError(f"node in the assembled root fs printed {version!r}, not a version {NODE_MAJOR}.x")
    for leftover in (rootfs / "tmp").iterdir():  # the smoke test's matplotlib cache
        shutil.rmtree(leftover)


def _normalise_modes(rootfs: Path) -> None:
    """Nothing in the tree is writable by anyone but root (the image's files all belong to root)."""
    for directory, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            host = Path(directory) / name
            if host.is_symlink() or host == rootfs / "tmp":
                continue
            mode = host.lstat().st_mode & 0o7777
            if mode & 0o022:
                host.chmod(mode & ~0o022)
