"""`metaagent run FILE.js`: the same engine and sandbox as the code interpreter, from the command line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.sandbox.conftest import Service
from tests.test_cli import METAAGENT, clean_env

pytestmark = pytest.mark.docker


def metaagent_run(tmp_path: Path, code: str, *options: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    program = tmp_path / "program.js"
    program.write_text(code)
    return subprocess.run(
        [*METAAGENT, "run", str(program), *options],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
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
