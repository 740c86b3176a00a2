"""Every example of README.md runs, read from the README itself (the convention: `tests/readme_blocks.py`).

Each example runs against a service of its own (`metaagent serve` on a free port, so the tests run in
parallel): the README's `127.0.0.1:3102` and `localhost:3102` are rewritten to that port, and nothing
else of an example is. The service has the settings the README's text gives for that section (below);
search and embeddings talk to the fake Serper and OpenAI of `tests/fake_upstreams.py`, the network
example's "plain HTTP server on 127.0.0.1:8080" is a server on a free port (its port rewritten too).
`metaagent` is the venv's (the set-up section's `source .venv/bin/activate`); `metaagent repl` finds the
service through `METAAGENT_URL` (the port again) and `metaagent audit verify` its audit log through
`METAAGENT_AUDIT_LOG` (the default path, moved into the test's folder).
"""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx2
import pytest

from tests.fake_upstreams import OPENAI_KEY, SERPER_KEY, fake_openai, fake_serper
from tests.readme_blocks import Block, blocks, commands, match_output
from tests.sandbox.conftest import Service, running_service

pytestmark = pytest.mark.docker

SRC = Path(__file__).parents[2] / "src"
VENV_BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 120
# The settings each section's examples say their service was started with.
SECTION_ENV = {
    "`POST /tools/http`": {"ALLOW_HTTP_HOSTS": '["example.com"]'},
    "Network for sandboxed code": {
        "ALLOW_HTTP_HOSTS": '["127.0.0.1", "*.example.com"]',
        "METAAGENT_LANGUAGES": "javascript,python",  # its last example is Python's
    },
    "Access": {"METAAGENT_API_KEYS": "alice:7q3vN8c2LxWfRk1pZs9TbYd4"},
    "Python": {"METAAGENT_LANGUAGES": "javascript,python"},
    "`metaagent repl`": {"METAAGENT_LANGUAGES": "javascript,python"},  # its last example is a Python session
}
RUN = [b for b in blocks() if b.kind in ("console", "python", "json") and not b.is_output]


@contextmanager
def hello_server(directory: Path) -> Iterator[int]:
    """A plain HTTP server of `hello.json`, as the network example has one."""
    (directory / "hello.json").write_text('{"greeting": "hello from an allowed host"}')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def service_for(block: Block, workdir: Path) -> Iterator[tuple[Service, dict[str, str]]]:
    """The service the block's section describes, and the text rewrites that point the block at it."""
    env = dict(SECTION_ENV.get(block.heading, {}))
    with ExitStack() as stack:
        rewrites: dict[str, str] = {}
        if block.heading == "`POST /tools/search`":
            serper = stack.enter_context(fake_serper())
            env |= {"ALLOW_HTTP_HOSTS": '["127.0.0.1"]', "METAAGENT_SERPER_BASE_URL": serper.url}
            env |= {"SERPER_API_KEY": SERPER_KEY}
        if block.heading == "`POST /tools/embeddings`":
            openai = stack.enter_context(fake_openai())
            env |= {"ALLOW_HTTP_HOSTS": '["127.0.0.1"]', "OPENAI_BASE_URL": openai.url, "OPENAI_API_KEY": OPENAI_KEY}
        if block.heading == "Network for sandboxed code":
            files = workdir / "www"
            files.mkdir()
            rewrites["127.0.0.1:8080"] = f"127.0.0.1:{stack.enter_context(hello_server(files))}"
        service = stack.enter_context(running_service(workdir, METAAGENT_POOL_ENABLED="false", **env))
        port = service.base_url.rsplit(":", 1)[1]
        rewrites |= {"127.0.0.1:3102": f"127.0.0.1:{port}", "localhost:3102": f"127.0.0.1:{port}"}
        yield service, rewrites


def rewrite(text: str, rewrites: dict[str, str]) -> str:
    for old, new in rewrites.items():
        text = text.replace(old, new)
    return text


def shell_env(service: Service) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("METAAGENT_", "ALLOW_HTTP_HOSTS"))}
    return env | {
        "PATH": f"{VENV_BIN}:{env['PATH']}",
        "PYTHONPATH": str(SRC),
        "METAAGENT_AUDIT_LOG": str(service.audit_log),
        "METAAGENT_URL": service.base_url,
        "METAAGENT_SANDBOX_BUILD_ON_START": "false",
    }


class Shell:
    """One bash for a whole console block: commands one at a time, each one's output and status kept."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.process = subprocess.Popen(["bash"], cwd=cwd, env=env, stdin=subprocess.PIPE, text=True)
        self.count = 0

    def run(self, command: str) -> str:
        self.count += 1
        out, status = self.cwd / f".out{self.count}", self.cwd / f".status{self.count}"
        assert self.process.stdin is not None
        # `(exit $s)` gives the next command this one's `$?`, as at a prompt.
        self.process.stdin.write(f"{{ {command}\n}} >{out} 2>&1 </dev/null; s=$?; echo $s >{status}; (exit $s)\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not status.exists() or not status.read_text().endswith("\n"):
            assert time.monotonic() < deadline, f"{command!r} did not finish within {COMMAND_TIMEOUT_S} s"
            time.sleep(0.05)
        return out.read_text(errors="replace")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def run_console(block: Block, workdir: Path, service: Service, rewrites: dict[str, str]) -> None:
    shell = Shell(workdir, shell_env(service))
    ids: dict[str, str] = {}
    try:
        for shown, expected in commands(block):
            command = rewrite(shown, rewrites | ids)
            cat = re.fullmatch(r"cat (\S+)", command)
            if cat and not (workdir / cat.group(1)).exists():  # `$ cat f` shows a file the example made
                (workdir / cat.group(1)).write_text(expected + "\n")
            actual = shell.run(command)
            if block.unchecked:
                continue
            mismatch = match_output(rewrite(expected, rewrites), actual, ids)
            assert mismatch is None, f"{block.name}: $ {command}\n{mismatch}"
    finally:
        shell.close()


def run_python(block: Block, workdir: Path, service: Service, rewrites: dict[str, str]) -> None:
    script = workdir / "example.py"
    script.write_text(rewrite(block.text, rewrites))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        env=shell_env(service),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{block.name}:\n{result.stderr}"
    if block.output is not None and not block.unchecked:
        mismatch = match_output(block.output, result.stdout + result.stderr, {})
        assert mismatch is None, f"{block.name}\n{mismatch}"


def run_mcp_config(block: Block, workdir: Path, service: Service, rewrites: dict[str, str]) -> None:
    """Each server of an `mcpServers` configuration answers MCP's `initialize`."""
    servers = json.loads(rewrite(block.text, rewrites))["mcpServers"]
    hello = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    for name, server in servers.items():
        if "url" in server:
            headers = {"Accept": "application/json, text/event-stream"}
            answer = httpx2.post(server["url"], json=hello, headers=headers, timeout=60)
            assert answer.status_code == 200, f"{name}: {answer.text}"
            assert "serverInfo" in answer.text
            continue
        command = Path(server["command"])
        assert command.is_absolute(), f"{name}: an MCP client starts `command` from its own directory"
        assert command.parts[-3:] == (".venv", "bin", "metaagent"), f"{name}: {command} is not the venv's"
        env = shell_env(service) | server.get("env", {})
        process = subprocess.run(
            [str(VENV_BIN / "metaagent"), *server["args"]],
            cwd=workdir,
            env=env,
            input=json.dumps(hello) + "\n",
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        first = process.stdout.splitlines()[0] if process.stdout else ""
        assert "serverInfo" in first, f"{name}: {process.stdout}\n{process.stderr}"


@pytest.mark.parametrize("block", [b for b in RUN if not b.not_run], ids=lambda b: b.name)
def test_the_readme_example_runs_and_shows_what_the_readme_shows(block: Block, tmp_path: Path) -> None:
    with service_for(block, tmp_path) as (service, rewrites):
        {"console": run_console, "python": run_python, "json": run_mcp_config}[block.kind](
            block, tmp_path, service, rewrites
        )


@pytest.mark.parametrize("block", [b for b in RUN if b.not_run and b.kind == "python"], ids=lambda b: b.name)
def test_a_python_example_that_is_not_run_compiles_and_its_imports_work(block: Block) -> None:
    tree = ast.parse(block.text, filename=block.name)
    imports = ast.Module([node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)], [])
    exec(compile(imports, block.name, "exec"), {})  # noqa: S102  # the README's own import lines
