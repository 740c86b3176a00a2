"""`metaagent repl` against a real running service: piped blocks, a terminal's prompts, signals, the close."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from metaagent import __version__
from tests.sandbox.conftest import Service
from tests.sandbox.test_streaming import running_execution
from tests.test_cli import METAAGENT, clean_env

pytestmark = pytest.mark.docker

SESSION_ID = re.compile(r"session (ses_[0-9a-f]+) ")


def repl_env(tmp_path: Path, **values: str) -> dict[str, str]:
    """The CLI's environment with TMPDIR in the test's own directory: the REPL keeps the figures it saves
    for its user (under TMPDIR), so a run of the suite would otherwise leave a folder in /tmp per test."""
    return clean_env(tmp_path, TMPDIR=str(tmp_path), **values)


def repl_args(service: Service, *options: str) -> list[str]:
    return [*METAAGENT, "repl", "--url", service.base_url, *options]


def session_of(stderr: str) -> str:
    found = SESSION_ID.search(stderr)
    assert found, stderr
    return found.group(1)


def assert_closed(service: Service, session_id: str, reason: str = "closed") -> None:
    assert session_id not in [s["session_id"] for s in service.get("/sessions").json()["sessions"]]
    ended = service.get(f"/sessions/{session_id}")
    assert ended.status_code == 410
    assert ended.json()["reason"] == reason


def test_piped_blocks_share_state_print_output_and_results_and_the_session_is_closed_after(
    sandbox_service: Service, tmp_path: Path
) -> None:
    blocks = "let x = 41\n\nconsole.log('hi');\nx + 1\n\n[1, 2, 3].map((n) => n * n)\n"
    result = subprocess.run(
        repl_args(sandbox_service),
        cwd=tmp_path,
        env=repl_env(tmp_path),
        input=blocks,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "undefined\nhi\n42\n[ 1, 4, 9 ]\n"  # `let` shows undefined, as in node's REPL
    assert result.stderr.startswith(f"metaagent: connected to metaagent {__version__} at {sandbox_service.base_url}\n")
    session_id = session_of(result.stderr)
    assert result.stderr.endswith(f"metaagent: session {session_id} closed\n")
    assert_closed(sandbox_service, session_id)


def test_an_error_goes_to_stderr_with_no_result_and_the_next_block_still_runs(
    sandbox_service: Service, tmp_path: Path
) -> None:
    blocks = "const kept = 'k'\n\nthrow new Error('boom')\n\nkept\n"
    result = subprocess.run(
        repl_args(sandbox_service), cwd=tmp_path, env=repl_env(tmp_path), input=blocks, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "undefined\n'k'\n"
    assert "Uncaught Error: boom" in result.stderr


def test_a_call_that_ends_the_session_ends_the_repl_with_its_status_and_reason(
    sandbox_service: Service, tmp_path: Path
) -> None:
    result = subprocess.run(
        repl_args(sandbox_service),
        cwd=tmp_path,
        env=repl_env(tmp_path),
        input="process.exit(3)\n\n'never run'\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3
    assert result.stdout == ""
    session_id = session_of(result.stderr)
    assert f"metaagent: Session {session_id} has ended: exited\n" in result.stderr
    assert_closed(sandbox_service, session_id, "exited")


@pytest.mark.parametrize(("signal_name", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_during_a_piped_call_stops_the_call_and_closes_the_session(
    sandbox_service: Service, tmp_path: Path, signal_name: str, status: int
) -> None:
    process = subprocess.Popen(
        repl_args(sandbox_service, "--timeout", "62"),
        cwd=tmp_path,
        env=repl_env(tmp_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdin is not None
        process.stdin.write("while (true) {}\n\n")
        process.stdin.flush()
        execution_id = running_execution(sandbox_service, 62)
        process.send_signal(getattr(signal, signal_name))
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == status
    assert out == ""
    assert_closed(sandbox_service, session_of(err))
    assert sandbox_service.get(f"/executions/{execution_id}").status_code == 404


def assert_gone(service: Service, execution_id: str) -> None:
    for _ in range(300):
        if service.get(f"/executions/{execution_id}").status_code == 404:
            return
        time.sleep(0.05)
    raise AssertionError(f"{execution_id} still runs")


class Pty:
    """A process on a pseudo-terminal, read until what the test waits for appears."""

    def __init__(self, fd: int, process: subprocess.Popen[bytes]) -> None:
        self.fd = fd
        self.process = process
        self.seen = ""

    def write(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def read_until(self, text: str) -> str:
        """All output up to and including `text` (a hang guard of 60 s, not a timing assertion)."""
        while text not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], 60)
            assert ready, f"waited 60 s for {text!r}; the terminal shows {self.seen!r}"
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the process ended and closed its side
                chunk = b""
            assert chunk, f"the terminal closed before {text!r}: {self.seen!r}"
            self.seen += chunk.decode(errors="replace").replace("\r\n", "\n")
        upto = self.seen.index(text) + len(text)
        shown, self.seen = self.seen[:upto], self.seen[upto:]
        return shown


@contextmanager
def on_a_terminal(args: list[str], tmp_path: Path) -> Iterator[Pty]:
    main, child = pty.openpty()
    process = subprocess.Popen(
        args, cwd=tmp_path, env=repl_env(tmp_path, TERM="dumb"), stdin=child, stdout=child, stderr=child
    )
    os.close(child)
    try:
        yield Pty(main, process)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        os.close(main)


def test_on_a_terminal_prompts_continue_open_blocks_and_ctrl_c_interrupts_a_call_keeping_the_session(
    sandbox_service: Service, tmp_path: Path
) -> None:
    with on_a_terminal(repl_args(sandbox_service, "--timeout", "63"), tmp_path) as terminal:
        session_id = session_of(terminal.read_until("> "))
        terminal.write("function twice(a) {\n")
        terminal.read_until("... ")  # the block is open: a continuation prompt, no call yet
        terminal.write("  return a * 2\n}\n")
        assert terminal.read_until("> ").endswith("undefined\n> ")
        terminal.write("twice(21)\n")
        assert terminal.read_until("> ").endswith("42\n> ")
        terminal.write("while (true) {}\n")
        execution_id = running_execution(sandbox_service, 63)
        terminal.process.send_signal(signal.SIGINT)  # what Ctrl-C sends to the terminal's foreground process
        assert "metaagent: interrupted; the session keeps its state\n" in terminal.read_until("> ")
        assert_gone(sandbox_service, execution_id)  # interrupted at the hang-up, long before its 63 s
        terminal.write("twice(50)\n")
        assert terminal.read_until("> ").endswith("100\n> ")
        terminal.write(".exit\n")
        terminal.read_until(f"metaagent: session {session_id} closed\n")
        assert terminal.process.wait(timeout=60) == 0
    assert_closed(sandbox_service, session_id)


IMAGE_LINE = re.compile(r"^\[image 1: image/png, (\d+) bytes: (/\S+\.png)\]$", re.MULTILINE)


def test_a_python_repl_shows_reprs_nothing_for_none_and_saves_each_figure_naming_it(
    python_service: Service, tmp_path: Path
) -> None:
    blocks = (
        "x = 41\n\nprint('hi')\nx + 1\n\n'a'\n\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\n\nraise ValueError('bad')\n\nx\n"
    )
    result = subprocess.run(
        repl_args(python_service, "--language", "python"),
        cwd=tmp_path,
        env=repl_env(tmp_path),
        input=blocks,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    image = IMAGE_LINE.search(result.stdout)
    assert image, result.stdout
    assert result.stdout == f"hi\n42\n'a'\n{image.group(0)}\n41\n"  # `x = 41` and plt.show() show nothing
    saved = Path(image.group(2))
    assert saved.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert saved.stat().st_size == int(image.group(1))
    assert "ValueError: bad" in result.stderr
    session_id = session_of(result.stderr)
    assert f"metaagent: session {session_id} (python, memory 256 MiB" in result.stderr
    assert_closed(python_service, session_id)


def test_on_a_terminal_python_prompts_continue_a_compound_statement_until_a_blank_line(
    python_service: Service, tmp_path: Path
) -> None:
    with on_a_terminal(repl_args(python_service, "--language", "python"), tmp_path) as terminal:
        session_id = session_of(terminal.read_until(">>> "))
        terminal.write("def twice(a):\n")
        terminal.read_until("... ")  # a line ending in ':' continues
        terminal.write("    return a * 2\n")
        terminal.read_until("... ")  # until a blank line
        terminal.write("\n")
        terminal.read_until(">>> ")
        terminal.write("twice(\n")
        terminal.read_until("... ")  # an open bracket continues
        terminal.write("21)\n")
        assert terminal.read_until(">>> ").endswith("42\n>>> ")
        terminal.write(".exit\n")
        terminal.read_until(f"metaagent: session {session_id} closed\n")
        assert terminal.process.wait(timeout=60) == 0
    assert_closed(python_service, session_id)
