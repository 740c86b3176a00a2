"""The `metaagent` command as operators use it: real processes, real exit statuses, real stderr; `sandbox
prune` in process against a stand-in engine, since the real one is shared with other checkouts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import httpx2
import pytest

from metaagent.cli import sandbox_prune
from metaagent.languages.javascript.image import IMAGE_REPOSITORY
from metaagent.languages.python.image import PYTHON_IMAGE_REPOSITORY
from tests.languages.test_rootfs import engine_with, every_languages_tags

METAAGENT = [sys.executable, "-m", "metaagent"]


def clean_env(tmp_path: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("METAAGENT_", "ALLOW_HTTP_HOSTS"))}
    env.update({"METAAGENT_AUDIT_LOG": str(tmp_path / "audit.jsonl"), "METAAGENT_SANDBOX_BUILD_ON_START": "false"})
    env.update(values)
    return env


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*METAAGENT, *args], cwd=tmp_path, env=clean_env(tmp_path, **env), capture_output=True, text=True, timeout=60
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(tmp_path: Path, start_timeout_s: float = 30, **env: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    process = subprocess.Popen(
        [*METAAGENT, "serve", "--port", str(port)],
        cwd=tmp_path,
        env=clean_env(tmp_path, **env),
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"{base}/health", timeout=1).json().get("status") != "starting":
                    break
            except httpx2.TransportError:
                pass
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            time.sleep(0.1)
        yield base, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        if process.stderr is not None:
            process.stderr.close()


@pytest.mark.security
def test_serve_refuses_a_malformed_allow_list_with_exit_2_naming_each_entry(tmp_path: Path) -> None:
    result = run(tmp_path, "serve", ALLOW_HTTP_HOSTS='["https://api.openai.com", "ok.example.com", "api.*.x.com"]')
    assert result.returncode == 2
    assert "'https://api.openai.com': a scheme is not part of a host; write the host alone: api.openai.com" in (
        result.stderr
    )
    assert "'api.*.x.com': a wildcard may only be the whole leftmost label" in result.stderr
    assert "ok.example.com" not in result.stderr


def test_serve_refuses_a_malformed_setting_with_exit_2_naming_its_variable_and_no_traceback(tmp_path: Path) -> None:
    result = run(tmp_path, "serve", METAAGENT_HTTP_MAX_REDIRECTS="many")
    assert result.returncode == 2
    assert result.stderr.startswith("metaagent: bad configuration: METAAGENT_HTTP_MAX_REDIRECTS: ")
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_pool_floor_above_its_ceiling_with_exit_2_and_the_fix(tmp_path: Path) -> None:
    result = run(tmp_path, "serve", METAAGENT_POOL_SIZE="2", METAAGENT_POOL_MIN="3")
    assert result.returncode == 2
    assert "refusing to start: METAAGENT_POOL_MIN (3) is above the warm pool's ceiling (2" in result.stderr
    assert "lower METAAGENT_POOL_MIN or raise METAAGENT_POOL_SIZE" in result.stderr


@pytest.mark.parametrize(
    ("budget", "problem"),
    [
        ("0", "METAAGENT_POOL_MEMORY_MB: Input should be greater than or equal to 1 (got '0')"),
        (  # split between the two languages served by default
            "100",
            "METAAGENT_POOL_MEMORY_MB (100), split among the 2 languages' pools (METAAGENT_LANGUAGES), each holds 0 "
            "warm container(s) of 256 MB",
        ),
    ],
)
def test_serve_refuses_a_bad_pool_memory_budget_with_exit_2_naming_it(
    tmp_path: Path, budget: str, problem: str
) -> None:
    result = run(tmp_path, "serve", METAAGENT_POOL_MEMORY_MB=budget)
    assert result.returncode == 2
    assert problem in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.security
def test_serve_with_an_empty_allow_list_warns_once_and_blocks_everything(tmp_path: Path) -> None:
    with serving(tmp_path, ALLOW_HTTP_HOSTS="[]") as (base, process):
        response = httpx2.post(f"{base}/tools/http", json={"url": "https://example.com", "method": "GET"})
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == "Blocked host: example.com"
    assert stderr.count("every outbound request is blocked") == 1
    assert "[SECURITY] Blocked HTTP request to disallowed host: example.com (GET https://example.com)\n" in stderr
    assert process.returncode == 0


def test_env_local_overrides_env_and_real_environment_overrides_both(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("ALLOW_HTTP_HOSTS=a.example.com\nMETAAGENT_HTTP_MAX_REDIRECTS=3\n")
    (tmp_path / ".env.local").write_text("ALLOW_HTTP_HOSTS=b.example.com\n")
    assert "b.example.com" in run(tmp_path, "allowlist", "check").stdout
    assert "c.example.com" in run(tmp_path, "allowlist", "check", ALLOW_HTTP_HOSTS="c.example.com").stdout


def test_allowlist_check_prints_the_parsed_patterns(tmp_path: Path) -> None:
    result = run(tmp_path, "allowlist", "check", ALLOW_HTTP_HOSTS="API.openai.com, *.example.com")
    assert result.returncode == 0
    assert "api.openai.com  [exact]" in result.stdout
    assert "*.example.com  [wildcard (subdomains only)]" in result.stdout


def test_allowlist_check_warns_once_about_ignored_empty_items(tmp_path: Path) -> None:
    result = run(tmp_path, "allowlist", "check", ALLOW_HTTP_HOSTS="api.openai.com,,*.example.com,")
    assert result.returncode == 0
    assert result.stderr.count("empty items") == 1
    assert "ALLOW_HTTP_HOSTS has 2 empty items (stray or trailing commas); ignored" in result.stderr
    assert "2 pattern(s):" in result.stdout


def test_allowlist_check_exits_2_on_malformed_config(tmp_path: Path) -> None:
    result = run(tmp_path, "allowlist", "check", ALLOW_HTTP_HOSTS='["a.com",]')
    assert result.returncode == 2
    assert "not valid JSON" in result.stderr


def test_allowlist_test_says_which_pattern_allowed_a_url(tmp_path: Path) -> None:
    result = run(tmp_path, "allowlist", "test", "https://api.example.com/x", ALLOW_HTTP_HOSTS="*.example.com")
    assert result.returncode == 0
    assert "allowed: host api.example.com matches wildcard *.example.com" in result.stdout


def test_allowlist_test_says_why_a_url_is_blocked(tmp_path: Path) -> None:
    result = run(tmp_path, "allowlist", "test", "https://example.com/", ALLOW_HTTP_HOSTS="*.example.com")
    assert result.returncode == 1
    assert "blocked: host example.com: example.com matches no entry" in result.stderr


def test_audit_verify_names_the_first_altered_record(tmp_path: Path) -> None:
    from metaagent.audit import AuditLog

    log = AuditLog(tmp_path / "audit.jsonl")
    for n in range(3):
        log.append("egress.blocked", host=f"h{n}.example.com")
    assert run(tmp_path, "audit", "verify").returncode == 0
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace("h1.example.com", "h1.example.org")
    (tmp_path / "audit.jsonl").write_text("\n".join(lines) + "\n")
    result = run(tmp_path, "audit", "verify")
    assert result.returncode == 1
    assert "line 2 (seq 2): content does not match its hash" in result.stderr
    assert json.loads(lines[0])["seq"] == 1


def test_run_refuses_a_file_that_is_not_utf8_with_exit_2_and_a_fix(tmp_path: Path) -> None:
    program = tmp_path / "latin1.js"
    program.write_bytes("console.log('café')".encode("latin-1"))
    result = run(tmp_path, "run", str(program))
    assert result.returncode == 2
    assert "is not UTF-8 text" in result.stderr
    assert "save it as UTF-8" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_refuses_a_program_past_the_code_limit_with_exit_2(tmp_path: Path) -> None:
    program = tmp_path / "huge.js"
    program.write_text("//" + "x" * (1024 * 1024 + 1))
    result = run(tmp_path, "run", str(program))
    assert result.returncode == 2
    assert "cannot run: Invalid request: code must be at most 1048576 characters long" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_without_a_container_engine_says_so_in_one_line_and_exits_1(tmp_path: Path) -> None:
    program = tmp_path / "program.js"
    program.write_text("console.log(1)")
    result = run(tmp_path, "run", str(program), DOCKER_HOST=f"unix://{tmp_path}/no-engine.sock")
    assert result.returncode == 1
    assert result.stderr.startswith("metaagent: The container engine is unavailable")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_sandbox_prune_prunes_both_languages_images_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client, fake = engine_with(*every_languages_tags())
    monkeypatch.setattr(docker, "from_env", lambda: client)  # the in-process engine stand-in, not the real one
    sandbox_prune()
    old = [f"{IMAGE_REPOSITORY}:0.0.0-old", f"{PYTHON_IMAGE_REPOSITORY}:0.0.0-old"]
    assert fake.removed == old
    assert capsys.readouterr().out == "".join(f"removed {tag}\n" for tag in old) + "2 removed, 0 kept in use\n"


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("notes.txt", (), "metaagent: cannot tell the language of notes.txt from its extension (.py, .js, .cjs, .mjs"),
        ("Makefile", (), "give --language javascript or --language python"),
        ("program.py", ("--language", "ruby"), "metaagent: unknown --language 'ruby'; give javascript or python"),
    ],
)
def test_run_of_a_file_whose_language_it_cannot_tell_exits_2_naming_language(
    tmp_path: Path, name: str, options: tuple[str, ...], message: str
) -> None:
    (tmp_path / name).write_text("print(1)\n")
    result = run(tmp_path, "run", name, *options)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""
