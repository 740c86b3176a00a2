"""`metaagent run FILE.js` (or FILE.py): the same engine and sandbox as the code interpreter, from the command line."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import docker
import pytest

from tests.sandbox.conftest import Service, owned_containers
from tests.test_cli import METAAGENT, clean_env

pytestmark = pytest.mark.docker


def metaagent_run(
    tmp_path: Path, code: str, *options: str, stdin: str = "", name: str = "program.js", **env: str
) -> subprocess.CompletedProcess[str]:
    program = tmp_path / name
    program.write_text(code)
    return subprocess.run(
        [*METAAGENT, "run", str(program), *options],
        cwd=tmp_path,
        env=clean_env(tmp_path, **env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def start_run(tmp_path: Path, code: str) -> subprocess.Popen[str]:
    """`metaagent run` of `code` (60 s timeout), its output read by the test as it comes."""
    program = tmp_path / "program.js"
    program.write_text(code)
    return subprocess.Popen(
        [*METAAGENT, "run", str(program), "--timeout", "60"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_run_prints_what_the_program_prints_and_exits_with_its_status(sandbox_service: Service, tmp_path: Path) -> None:
    # sandbox_service: only so that the image is there.
    code = "const os = require('os'); console.log(os.userInfo().username, process.getuid()); process.exitCode = 3"
    result = metaagent_run(tmp_path, code)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "sandbox 1001\n"


def test_run_feeds_its_stdin_to_the_program(sandbox_service: Service, tmp_path: Path) -> None:
    code = "let s = ''; process.stdin.on('data', (d) => s += d).on('end', () => console.log(s.toUpperCase()))"
    result = metaagent_run(tmp_path, code, stdin="piped in")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "PIPED IN\n"


@pytest.mark.security
def test_run_stops_the_program_at_its_timeout_and_says_so(sandbox_service: Service, tmp_path: Path) -> None:
    result = metaagent_run(tmp_path, "for (;;) {}", "--timeout", "1", "--memory", "128")
    assert result.returncode == 143  # SIGTERM at the deadline
    assert "metaagent: timed out after 1 s" in result.stderr


@pytest.mark.security
def test_run_keeps_blocked_modules_blocked(sandbox_service: Service, tmp_path: Path) -> None:
    result = metaagent_run(tmp_path, "require('child_process').execSync('id')")
    assert result.returncode == 1
    assert 'Module "child_process" is blocked in the sandbox' in result.stderr


@pytest.mark.parametrize(("signal_name", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_run_prints_output_as_it_comes_and_a_signal_stops_the_execution(
    sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path, signal_name: str, status: int
) -> None:
    process = start_run(tmp_path, "console.log('first'); setInterval(() => console.log('again'), 200)")
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "first\n"  # while the program runs: it would run for 60 s
        assert owned_containers(docker_client, process.pid)
        process.send_signal(getattr(signal, signal_name))
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == status  # 128 + the signal, as a shell reports it
    assert set(out.splitlines()) <= {"again"}
    assert err.endswith(f"metaagent: {signal_name}: the execution was stopped and its container removed\n")
    assert owned_containers(docker_client, process.pid) == []


def test_run_keeps_the_programs_output_its_own_and_says_truncation_on_stderr(
    sandbox_service: Service, tmp_path: Path
) -> None:
    result = metaagent_run(tmp_path, "process.stdout.write('x'.repeat(60000)); process.stderr.write('no newline')")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "x" * 51200  # the program's bytes alone: no marker in its stream
    assert result.stderr == (
        "no newline\nmetaagent: stdout truncated: 60000 bytes produced, the first 51200 shown\n"
    )  # on a line of its own


def test_run_stops_quietly_with_141_when_its_reader_goes_away(
    sandbox_service: Service, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    # As `metaagent run program.js | head -1`: the program prints for ever, its reader leaves after a line.
    process = start_run(tmp_path, "setInterval(() => console.log('line'), 20)")
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "line\n"
        process.stdout.close()  # the reader goes away; the next line written finds a broken pipe
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 141  # 128 + SIGPIPE, as a shell reports a program ended by it
    assert err == ""  # no traceback, no message: a pipeline's reader leaving is no error
    assert owned_containers(docker_client, process.pid) == []


def test_run_of_a_py_file_runs_python_with_its_stdin_and_exits_with_its_status(
    python_service: Service, tmp_path: Path
) -> None:
    # python_service: only so that Python's image is there.
    code = "import os, sys\nprint(sys.stdin.read().upper(), os.getuid(), sys.version_info[:2])\nsys.exit(3)\n"
    result = metaagent_run(tmp_path, code, stdin="piped in", name="program.py")
    assert result.returncode == 3, result.stderr
    assert result.stdout == "PIPED IN 1001 (3, 11)\n"


def test_run_with_language_overrides_the_extension_and_python_errors_come_as_cpythons_traceback(
    python_service: Service, tmp_path: Path
) -> None:
    result = metaagent_run(tmp_path, "print(1 / 0)\n", "--language", "python", name="script.txt")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert result.stderr.endswith("ZeroDivisionError: division by zero\n")


def test_run_of_a_py_file_where_python_is_not_served_names_the_setting(python_service: Service, tmp_path: Path) -> None:
    result = metaagent_run(tmp_path, "print(1)\n", name="program.py", METAAGENT_LANGUAGES="javascript")
    assert result.returncode == 1
    assert result.stderr.startswith("metaagent: Language 'python' is not served here (METAAGENT_LANGUAGES=javascript)")
