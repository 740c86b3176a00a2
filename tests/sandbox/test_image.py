"""The sandbox image and the trusted runner's stdin protocol, checked in real containers."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import stat
import struct
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import docker
import docker.errors
import pytest

from metaagent.languages.javascript import image as sandbox_image
from metaagent.languages.javascript.image import (
    IMAGE_LABEL,
    build_image,
    image_present,
    image_tag,
    runner_command,
)
from metaagent.languages.rootfs import prune_repository
from metaagent.sandbox.execute import RUNNER_READY

pytestmark = pytest.mark.docker

CACHE_DIR = Path("/var/cache/metaagent")
COMMAND = ["/usr/bin/dumb-init", "--", *runner_command(128)]
RUN_TIMEOUT = 60


@dataclass(frozen=True)
class Run:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def client(docker_client: docker.DockerClient) -> docker.DockerClient:
    return docker_client  # the engine fixture of tests/sandbox/conftest.py, under this module's shorter name


@pytest.fixture(scope="session")
def sandbox(client: docker.DockerClient) -> str:
    build_image(client, cache_dir=CACHE_DIR)
    return image_tag()


@pytest.fixture(scope="session")
def image_files(
    client: docker.DockerClient, sandbox: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tarfile.TarInfo]:
    return exported_files(client, sandbox, tmp_path_factory.mktemp("export"))


def exported_files(client: docker.DockerClient, tag: str, folder: Path) -> dict[str, tarfile.TarInfo]:
    """Every entry of an image's file system, from a created (never started) container's export."""
    container = client.containers.create(tag, command=["/nonexistent"], network_mode="none")
    try:
        exported = folder / "rootfs.tar"
        with exported.open("wb") as out:
            for chunk in container.export():
                out.write(cast(bytes, chunk))  # the stubs say str; the engine sends bytes
    finally:
        container.remove(force=True)
    with tarfile.open(exported) as tar:
        return {member.name.lstrip("./").rstrip("/"): member for member in tar.getmembers()}


def _demultiplex(raw: bytes) -> tuple[bytes, bytes]:
    """Splits an attach stream without TTY: 8-byte headers (stream, 3 zero bytes, big-endian length)."""
    streams = {1: bytearray(), 2: bytearray()}
    offset = 0
    while offset + 8 <= len(raw):
        kind, length = struct.unpack(">BxxxL", raw[offset : offset + 8])
        streams.setdefault(kind, bytearray()).extend(raw[offset + 8 : offset + 8 + length])
        offset += 8 + length
    assert offset == len(raw), "attach stream ended inside a frame"
    return bytes(streams[1]), bytes(streams[2])


def payload(code: str, stdin: bytes = b"") -> bytes:
    body = code.encode()
    header = json.dumps({"code_bytes": len(body), "stdin_bytes": len(stdin)}).encode()
    return header + b"\n" + body + stdin


def run_raw(client: docker.DockerClient, tag: str, data: bytes, *, close_stdin: bool = True) -> Run:
    """Runs the runner with the hardened settings: create, attach, start, write, read, wait, remove."""
    host_config = client.api.create_host_config(
        network_mode="none",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=16m"},
        mem_limit="256m",
        pids_limit=64,
        ipc_mode="none",
    )
    # docker-py derives StdinOnce from stdin_open (it has no stdin_once argument of its own).
    created = client.api.create_container(
        tag, command=COMMAND, user="1001:1001", stdin_open=True, tty=False, host_config=host_config
    )
    container_id = created["Id"]
    attached = None
    try:
        attached = client.api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        sock: socket.socket = attached._sock
        client.api.start(container_id)
        sock.sendall(data)
        if close_stdin:
            sock.shutdown(socket.SHUT_WR)  # the container sees EOF on its stdin
        sock.settimeout(RUN_TIMEOUT)
        received = bytearray()
        while chunk := sock.recv(65536):
            received.extend(chunk)
        status = client.api.wait(container_id, timeout=RUN_TIMEOUT)
        stdout, stderr = _demultiplex(bytes(received))
        assert stderr.startswith(RUNNER_READY), stderr  # the runner's first word, before it reads a byte
        return Run(int(status["StatusCode"]), stdout.decode(), stderr.removeprefix(RUNNER_READY).decode())
    finally:
        if attached is not None:
            attached._sock.close()
            attached.close()
        client.api.remove_container(container_id, force=True)


def run_js(client: docker.DockerClient, tag: str, code: str, stdin: bytes = b"", **kwargs: bool) -> Run:
    return run_raw(client, tag, payload(code, stdin), **kwargs)


# --- the build ----------------------------------------------------------------------------------------


def test_image_tag_names_repository_version_and_recipe_hash(sandbox: str) -> None:
    repository, _, version_hash = sandbox.partition(":")
    version, _, recipe = version_hash.rpartition("-")
    assert repository == "metaagent-sandbox"
    assert version == "0.1.0"
    assert len(recipe) == 12
    assert int(recipe, 16) >= 0


def test_changing_the_runner_changes_the_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = image_tag()
    runner_copy = tmp_path / "runner"
    shutil.copytree(sandbox_image.RUNNER_DIR, runner_copy)
    monkeypatch.setattr(sandbox_image, "RUNNER_DIR", runner_copy)
    assert image_tag() == original
    (runner_copy / "runner.js").write_text((runner_copy / "runner.js").read_text() + "\n// changed\n")
    assert image_tag() != original


def test_second_build_is_served_from_the_existing_image(client: docker.DockerClient, sandbox: str) -> None:
    lines: list[str] = []
    image_id = build_image(client, cache_dir=CACHE_DIR, progress=lines.append)
    assert image_id == client.images.get(sandbox).id
    assert image_present(client)
    assert lines == [f"{sandbox} is already built"]


def test_image_is_labelled_and_runs_as_sandbox_user_by_default(client: docker.DockerClient, sandbox: str) -> None:
    config = client.images.get(sandbox).attrs["Config"]
    assert config["Labels"][IMAGE_LABEL] == "1"
    assert config["User"] == "1001:1001"
    assert config["WorkingDir"] == "/tmp"


# --- the image's file system --------------------------------------------------------------------------


def test_image_has_no_shell(image_files: dict[str, tarfile.TarInfo]) -> None:
    for shell in ("bin/sh", "usr/bin/sh", "bin/bash", "usr/bin/bash", "bin/dash", "usr/bin/dash"):
        assert shell not in image_files
    assert "bin" not in image_files


def test_image_has_only_node_and_dumb_init_as_programs(image_files: dict[str, tarfile.TarInfo]) -> None:
    programs = {name for name in image_files if name.startswith(("usr/bin/", "usr/sbin/", "sbin/"))}
    assert programs == {"usr/bin/node", "usr/bin/dumb-init"}
    assert not any("apt" in name.split("/") or name.endswith("/dpkg") for name in image_files)


def test_image_has_no_setuid_or_setgid_files(image_files: dict[str, tarfile.TarInfo]) -> None:
    flagged = [name for name, info in image_files.items() if info.mode & (stat.S_ISUID | stat.S_ISGID)]
    assert flagged == []


def test_image_files_belong_to_root_and_runner_is_read_only(image_files: dict[str, tarfile.TarInfo]) -> None:
    assert {(info.uid, info.gid) for info in image_files.values()} == {(0, 0)}
    assert image_files["opt/metaagent"].mode & 0o7777 == 0o755
    assert image_files["opt/metaagent/runner.js"].mode & 0o7777 == 0o644
    assert image_files["tmp"].mode & 0o7777 == 0o1777
    assert image_files["app"].mode & 0o7777 == 0o755


# --- the runner in a hardened container ---------------------------------------------------------------


def test_console_log_prints_to_stdout(client: docker.DockerClient, sandbox: str) -> None:
    run = run_js(client, sandbox, "console.log(1+1)")
    assert run == Run(0, "2\n", "")


@pytest.mark.parametrize(
    "reader",
    [
        "let s = ''; process.stdin.setEncoding('utf8');"
        " process.stdin.on('data', d => s += d).on('end', () => console.log(JSON.stringify(s)));",
        "(async () => { const parts = []; for await (const c of process.stdin) parts.push(c);"
        " console.log(JSON.stringify(Buffer.concat(parts).toString('utf8'))); })();",
        "const lines = []; const rl = require('readline').createInterface({ input: process.stdin });"
        " rl.on('line', l => lines.push(l)).on('close', () => console.log(JSON.stringify(lines.join('\\n') + '\\n')));",
    ],
    ids=["data-events", "for-await", "readline"],
)
def test_stdin_content_reaches_process_stdin(client: docker.DockerClient, sandbox: str, reader: str) -> None:
    text = "first line\nzweite Zeile: äöü €\nthird\n"
    run = run_js(client, sandbox, reader, text.encode())
    assert run.stderr == ""
    assert run.exit_code == 0
    assert json.loads(run.stdout) == text


def test_process_stdin_is_a_plain_readable_not_a_file_stream(client: docker.DockerClient, sandbox: str) -> None:
    code = (
        "const { Readable } = require('stream'); const d = Object.getOwnPropertyDescriptor(process, 'stdin');"
        " console.log(process.stdin.constructor === Readable, typeof process.stdin.fd, d.configurable)"
    )
    run = run_js(client, sandbox, code)
    assert run == Run(0, "true undefined false\n", "")


def test_runner_does_not_wait_for_stdin_eof(client: docker.DockerClient, sandbox: str) -> None:
    code = "process.stdin.on('data', d => console.log(String(d))); setTimeout(() => console.log('done'), 50)"
    run = run_js(client, sandbox, code, b"input", close_stdin=False)
    assert run == Run(0, "input\ndone\n", "")


def test_malformed_header_exits_70_without_running_code(client: docker.DockerClient, sandbox: str) -> None:
    run = run_raw(client, sandbox, b'{"code_bytes": "many"}\nconsole.log("ran")')
    assert run.exit_code == 70
    assert run.stdout == ""
    assert run.stderr.startswith("metaagent-runner: bad payload: ")


def test_an_end_token_is_refused_where_the_code_runs_in_the_runners_own_process(
    client: docker.DockerClient, sandbox: str
) -> None:
    """Only a runner whose program is its child can tell the program's end; JavaScript's one-shot code
    runs in the runner itself, so its runner refuses the token rather than promise what it cannot."""
    run = run_raw(
        client, sandbox, b'{"code_bytes": 17, "stdin_bytes": 0, "end_token": "' + b"a" * 32 + b'"}\nconsole.log("ran")'
    )
    assert (run.exit_code, run.stdout) == (70, "")
    assert "end_token is for a one-shot run of a program" in run.stderr


@pytest.mark.parametrize(
    ("header", "refusal"),
    [
        (b'{"session": true}', "a session's wire_socket must be a path under /run/metaagent-wire/"),
        (b'{"session": true, "wire_socket": "/tmp/x.sock"}', "a session's wire_socket must be"),
        (b'{"session": true, "wire_socket": "/run/metaagent-wire/../../tmp/abcdefghijklmnopqrstu.sock"}', "must be"),
        (b'{"code_bytes": 0, "stdin_bytes": 0, "wire_socket": "/run/metaagent-wire/abcdefghijklmnopqrstuv.sock"}',
         "wire_socket is for a session's supervisor"),
    ],
    ids=["a session without one", "outside the wire folder", "dot segments", "a one-shot run"],
)  # fmt: skip
def test_a_session_header_needs_its_wire_socket_in_the_wire_folder_and_nothing_else_takes_one(
    client: docker.DockerClient, sandbox: str, header: bytes, refusal: str
) -> None:
    run = run_raw(client, sandbox, header + b"\n")
    assert (run.exit_code, run.stdout) == (70, "")
    assert refusal in run.stderr


def test_truncated_payload_exits_70(client: docker.DockerClient, sandbox: str) -> None:
    run = run_raw(client, sandbox, b'{"code_bytes": 100, "stdin_bytes": 0}\nconsole.log("ran")')
    assert run.exit_code == 70
    assert "stdin ended after 18 of 100 body bytes" in run.stderr


def test_code_runs_as_sandbox_user_1001(client: docker.DockerClient, sandbox: str) -> None:
    code = "const u = require('os').userInfo(); console.log(u.username, u.uid, u.gid, process.getuid())"
    run = run_js(client, sandbox, code)
    assert run == Run(0, "sandbox 1001 1001 1001\n", "")


def test_crypto_intl_url_and_fetch_work(client: docker.DockerClient, sandbox: str) -> None:
    code = """
    const hash = require('crypto').createHash('sha256').update('abc').digest('hex');
    const date = new Intl.DateTimeFormat('de-DE', { dateStyle: 'long', timeZone: 'UTC' }).format(new Date(0));
    const url = new URL('https://example.com:8443/a/b?c=d#e');
    console.log(JSON.stringify({ hash, date, host: url.host, fetch: typeof fetch }));
    """
    run = run_js(client, sandbox, code)
    assert run.stderr == ""
    assert run.exit_code == 0
    assert json.loads(run.stdout) == {
        "hash": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        "date": "1. Januar 1970",
        "host": "example.com:8443",
        "fetch": "function",
    }


def test_thrown_error_exits_1_with_stack_on_stderr(client: docker.DockerClient, sandbox: str) -> None:
    run = run_js(client, sandbox, "console.log('before');\nthrow new Error('boom')")
    assert run.exit_code == 1
    assert run.stdout == "before\n"
    assert "Error: boom\n    at Object.<anonymous> (/app/main.js:2:7)" in run.stderr


def test_unhandled_rejection_exits_1_with_stack_on_stderr(client: docker.DockerClient, sandbox: str) -> None:
    run = run_js(client, sandbox, "Promise.reject(new Error('nope'))")
    assert run.exit_code == 1
    assert "Error: nope\n    at Object.<anonymous> (/app/main.js:1:16)" in run.stderr


def test_syntax_error_exits_1_and_names_the_line(client: docker.DockerClient, sandbox: str) -> None:
    run = run_js(client, sandbox, "let x = ;")
    assert run.exit_code == 1
    assert run.stderr.startswith("/app/main.js:1\n")
    assert "SyntaxError: Unexpected token ';'" in run.stderr


def test_user_code_is_the_main_module(client: docker.DockerClient, sandbox: str) -> None:
    code = (
        "console.log(JSON.stringify([require.main === module, process.mainModule === module,"
        " process.mainModule.filename, __filename, __dirname, module.id, process.argv[1]]))"
    )
    run = run_js(client, sandbox, code)
    assert run.stderr == ""
    assert json.loads(run.stdout) == [True, True, "/app/main.js", "/app/main.js", "/app", ".", "/app/main.js"]


@pytest.fixture
def owned_repository(client: docker.DockerClient) -> Iterator[str]:
    """A repository name only this test uses; every tag made under it (or its neighbour) goes at teardown.
    The real prune is never run here: on a shared engine it would remove other checkouts' images."""
    repository = f"metaagent-test-prune-{uuid.uuid4().hex[:12]}"
    yield repository
    for image in client.images.list(filters={"label": IMAGE_LABEL}):
        for tag in image.tags:
            if tag.startswith((f"{repository}:", f"{repository}-")):
                with contextlib.suppress(docker.errors.NotFound):
                    client.images.remove(tag)


def test_prune_removes_the_repositorys_other_tags_and_keeps_the_current_one_and_other_repositories(
    client: docker.DockerClient, sandbox: str, owned_repository: str
) -> None:
    current, stale = f"{owned_repository}:0.1.0-current", f"{owned_repository}:0.0.0-stale"
    neighbour = f"{owned_repository}-neighbour:0.0.0-stale"  # shares the name as a prefix, not the repository
    image = client.images.get(sandbox)
    for tag in (current, stale, neighbour):
        image.tag(tag)  # what a runner change leaves behind: another version's tag
    removed, in_use = prune_repository(client, owned_repository, current)
    assert (removed, in_use) == ([stale], [])
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(stale)
    assert {current, neighbour, sandbox} <= set(client.images.get(sandbox).tags)
