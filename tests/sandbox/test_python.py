"""Python in the sandbox (issue 24): `language: "python"` through the real service, one-shot and in
sessions, with the guarantees JavaScript has (API.md, "Languages and isolation runtimes")."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import docker
import httpx2
import pytest

from metaagent.executions import Execution, new_execution_id
from metaagent.languages.container import container_spec
from metaagent.languages.python import PYTHON
from metaagent.languages.python.image import python_image_tag
from metaagent.sandbox.engine import Engine
from metaagent.sandbox.execute import Outcome, execute, payload
from metaagent.tools.code_interpreter import MAX_CODE_BYTES
from tests.sandbox.conftest import (
    HOST_SECRET,
    Result,
    Service,
    Sessions,
    code_runner,
    owned_containers,
    pool_start_retries,
    running_service,
    runtime_of,
)

pytestmark = [pytest.mark.docker]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_py(python_service: Service) -> Any:
    run = code_runner(python_service)
    return lambda code, **fields: run(code, language="python", **fields)


def new_python_session(sessions: Sessions, **fields: Any) -> str:
    return sessions.create(language="python", **fields)


# --- one-shot --------------------------------------------------------------------------------------------


def test_a_one_shot_program_prints_and_exits_zero(run_py: Any) -> None:
    result: Result = run_py("import sys\nprint('hello', sys.version_info[:2])")
    assert (result.status, result.exit_code, result.stdout) == (200, 0, "hello (3, 11)\n")


def test_the_code_runs_as_main_and_reads_its_stdin(run_py: Any) -> None:
    result: Result = run_py("import sys\nprint(__name__, sys.stdin.read().upper())", stdin="abc")
    assert (result.exit_code, result.stdout) == (0, "__main__ ABC\n")


def test_an_uncaught_exception_prints_its_traceback_as_cpython_does_and_exits_one(run_py: Any) -> None:
    result: Result = run_py("x = 1\n1 / 0\n")
    assert result.exit_code == 1
    assert result.stderr.endswith(
        'Traceback (most recent call last):\n  File "/app/main.py", line 2, in <module>\n    1 / 0\n'
        "    ~~^~~\nZeroDivisionError: division by zero\n"
    )
    assert "runner.py" not in result.stderr


def test_sys_exit_sets_the_exit_code(run_py: Any) -> None:
    assert run_py("import sys\nsys.exit(3)").exit_code == 3


def test_one_shot_python_writes_only_in_tmp(run_py: Any) -> None:
    result: Result = run_py(
        "open('/tmp/a.txt', 'w').write('kept')\nprint(open('/tmp/a.txt').read())\n"
        "try:\n    open('/workspace/b.txt', 'w')\nexcept PermissionError as e:\n    print(e)\n"
    )
    assert result.stdout.splitlines()[0] == "kept"
    assert "ERR_METAAGENT_PATH_REFUSED" in result.stdout.splitlines()[1]


@pytest.mark.security
def test_the_container_is_the_same_as_for_javascript(run_py: Any) -> None:
    """uid 1001, only the loopback interface, no secret of the host's in the environment."""
    result: Result = run_py(
        "import os, socket, json\n"
        "print(json.dumps({'uid': os.getuid(), 'interfaces': [n for _, n in socket.if_nameindex()],"
        " 'env': dict(os.environ)}))"
    )
    facts = json.loads(result.stdout)
    assert (facts["uid"], facts["interfaces"]) == (1001, ["lo"])
    assert HOST_SECRET not in result.stdout
    assert not {"OPENAI_API_KEY", "SERPER_API_KEY", "METAAGENT_TEST_SECRET"} & set(facts["env"])


def test_an_endless_loop_times_out(run_py: Any) -> None:
    result: Result = run_py("while True:\n    pass", timeout_s=1)
    assert (result.timed_out, result.body["killed"]) == (True, False)


def test_memory_past_the_limit_is_killed(run_py: Any) -> None:
    result: Result = run_py("b = bytearray(600 * 1024 * 1024)\nprint('survived')", memory_mb=256)
    assert "survived" not in result.stdout
    assert (result.exit_code, result.body["oom_killed"]) == (137, True), result.body


def test_output_past_the_cap_is_truncated(run_py: Any) -> None:
    result: Result = run_py("print('x' * 100_000)")
    assert result.body["stdout_truncated"] is True
    assert len(result.stdout.encode()) <= 50 * 1024 + 100


def test_the_benign_scientific_programs_run(run_py: Any) -> None:
    result: Result = run_py(
        "import numpy as np, pandas as pd, scipy.stats as st, matplotlib.pyplot as plt\n"
        "a = np.linalg.solve(np.array([[2.0, 0], [0, 4]]), np.array([2.0, 8]))\n"
        "df = pd.DataFrame({'k': ['a', 'b', 'a'], 'v': [1, 2, 3]})\n"
        "plt.plot([1, 2, 3]); plt.savefig('/tmp/p.png')\n"
        "print(a.tolist(), df.groupby('k').v.sum().to_dict(), round(float(st.norm.cdf(0)), 2),"
        " open('/tmp/p.png', 'rb').read(8) == b'\\x89PNG\\r\\n\\x1a\\n')"
    )
    assert (result.exit_code, result.stdout) == (0, "[1.0, 2.0] {'a': 4, 'b': 2} 0.5 True\n"), result.body


def test_npm_packages_are_refused_for_python(python_service: Service) -> None:
    """Python's network is tests/sandbox/test_network.py's."""
    response = python_service.post(
        "/tools/code-interpreter", {"code": "1", "language": "python", "packages": ["lodash"]}
    )
    assert response.status_code == 400, response.text
    assert "packages" in response.json()["error"]


# Kills the Python program in a container (by its command line), as a crash or the OOM killer would.
KILL_THE_PROGRAM = """
import os
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            command = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
        except OSError:
            continue
        if command[0] == b'/usr/bin/python3.11':
            os.kill(int(pid), 9)
"""


def test_a_warm_container_whose_program_died_is_replaced_not_handed_out(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    """node's runner goes as soon as its program dies while the container waits, so the pool sees a dead
    runner and replaces it; before, the container was handed out and the run failed."""
    settings = {"METAAGENT_LANGUAGES": "javascript,python", "METAAGENT_POOL_SIZE": "1", "METAAGENT_POOL_MIN": "1"}
    with running_service(tmp_path, **settings) as service:
        deadline = time.monotonic() + 300
        while service.get("/health").json()["checks"]["warm_pool"]["languages"]["python"]["ready"] < 1:
            assert time.monotonic() < deadline, "the Python pool did not fill"
            time.sleep(0.1)
        image = docker_client.images.get(python_image_tag())
        (warm,) = [
            c
            for c in map(docker_client.containers.get, owned_containers(docker_client, service.process.pid))
            if c.image.id == image.id
        ]
        # Detached: nothing here needs the exec's output, and under runsc an attached exec's stream can stay
        # open after its container has ended (2 of 4 tries by hand; CI waited 300 s on one).
        warm.exec_run(["/usr/bin/python3.11", "-c", KILL_THE_PROGRAM], user="1001", detach=True)
        warm.wait(timeout=60)  # node's runner went with its program
        retries = pool_start_retries(service, "python")
        result = code_runner(service)("print(6 * 7)", language="python", timeout_s=60)
        assert (result.status, result.exit_code, result.stdout) == (200, 0, "42\n"), result.body
        assert pool_start_retries(service, "python") > retries


def _run_told(
    code: str, runtime: Any, docker_client: docker.DockerClient, *, told: bool = True
) -> tuple[Outcome, list[str], bool]:
    """`code` one-shot through `execute` on the real engine, as the tool runs it (without an end token
    unless `told`): its outcome, the containers `retire` was given, and whether the container was still
    there when `execute` returned."""

    async def run() -> tuple[Outcome, list[str], bool]:
        engine = Engine()
        retired: list[str] = []
        execution = Execution(new_execution_id(), 30, 256)
        spec = container_spec(execution.execution_id, python_image_tag(), 256, 1.0, runtime=runtime, language=PYTHON)
        token = secrets.token_hex(16) if told else None
        try:
            outcome = await execute(
                engine, spec, payload(code, None, None, token), execution, timeout_s=30, grace_s=5,
                end_token=token, retire=lambda container_id: retired.append(container_id) is None,
            )  # fmt: skip
            there = bool(docker_client.containers.list(all=True, filters={"id": outcome.container_id}))
            for container_id in retired:
                await engine.remove(container_id)
        finally:
            engine.close()
        return outcome, retired, there

    return anyio.run(run)


def test_a_one_shot_is_answered_on_the_runners_told_end_with_all_its_output(
    python_service: Service, docker_client: docker.DockerClient
) -> None:
    """node's runner tells when its program has ended, as the last bytes of both streams: the answer has all
    of the output, interleaved on both streams up to the moment of the exit, and the container is handed
    to `retire` (the pool's background removal) instead of being waited for."""
    code = (
        "import sys\nfor i in range(2000):\n    print(i)\n    print(-i, file=sys.stderr)\n"
        "sys.stdout.write('last'); sys.stderr.write('\\0metaagent-end'); sys.exit(5)"
    )
    outcome, retired, there = _run_told(code, runtime_of(python_service), docker_client)
    assert (outcome.told_end, outcome.exit_code, retired, there) == (True, 5, [outcome.container_id], True)
    assert outcome.stdout.text().endswith("1998\n1999\nlast")
    assert outcome.stderr.produced == sum(len(f"-{i}\n") for i in range(1, 2000)) + len("0\n\0metaagent-end")


def test_what_a_program_wrote_on_fd_3_before_does_not_keep_its_end_untold(
    python_service: Service, docker_client: docker.DockerClient
) -> None:
    """node reads only the end of what fd 3 said: a program that wrote there itself, with no newline, is
    still answered on the runner's told end, with its own status, once its output is all there."""
    code = "import os, sys\nos.write(3, b'not a line ' * 1000)\nprint('done')\nsys.exit(3)"
    outcome, retired, _ = _run_told(code, runtime_of(python_service), docker_client)
    assert (outcome.told_end, outcome.exit_code, outcome.timed_out, retired) == (True, 3, False, [outcome.container_id])
    assert outcome.stdout.text() == "done\n"


def test_a_program_whose_fd_3_is_another_file_now_exits_instead_of_stopping(
    python_service: Service, docker_client: docker.DockerClient
) -> None:
    """The runner stops its process after telling its end, for node to kill; where fd 3 is not the pipe to
    node any more (closed, and a file opened since took its number), nobody would: it exits, and node
    tells that exit, instead of the execution's timeout ending a stopped process."""
    code = "import os\nos.close(3)\nheld = open('/tmp/taken', 'w')\nassert held.fileno() == 3\nprint('fd 3 is a file')"
    outcome, _, _ = _run_told(code, runtime_of(python_service), docker_client)
    assert (outcome.exit_code, outcome.timed_out) == (0, False)
    assert outcome.stdout.text() == "fd 3 is a file\n"


def test_a_one_shot_without_an_end_token_is_answered_on_its_programs_end(
    python_service: Service, docker_client: docker.DockerClient
) -> None:
    """The runner stops its process once it has said its end, whether or not node tells the service: node
    reads fd 3 either way, and ends the run, instead of the execution's timeout ending a stopped process."""
    outcome, _, _ = _run_told("print(1)", runtime_of(python_service), docker_client, told=False)
    assert (outcome.told_end, outcome.exit_code, outcome.timed_out) == (False, 0, False)
    assert outcome.stdout.text() == "1\n"


def test_a_program_killed_by_a_signal_is_answered_from_the_engines_account(
    python_service: Service, docker_client: docker.DockerClient
) -> None:
    """An exit of 128 + n may be the OOM killer's, which only the engine can tell: that answer waits for the
    container's end as before, and the container is gone when it comes."""
    outcome, retired, there = _run_told(
        "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
        runtime_of(python_service),
        docker_client,
    )
    assert (outcome.told_end, outcome.exit_code, outcome.oom_killed, retired, there) == (False, 137, False, [], False)
    assert outcome.stdout.text() == "bye\n"


def test_an_answered_one_shots_container_is_removed_after_its_answer(
    run_py: Any, containers_of: Callable[[str], list[str]]
) -> None:
    result: Result = run_py("print(1)")
    assert (result.exit_code, result.stdout) == (0, "1\n")
    deadline = time.monotonic() + 60
    while containers_of(result.body["execution_id"]):
        assert time.monotonic() < deadline, "the container of an answered execution was not removed"
        time.sleep(0.05)


# --- sessions --------------------------------------------------------------------------------------------


def test_a_session_keeps_one_namespace_and_shows_the_last_value_as_its_repr(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    assert python_sessions.run(session, "x = 41")["result"] is None
    assert python_sessions.run(session, "x + 1")["result"] == "42"
    assert python_sessions.run(session, "{'a': [1, 2]}")["result"] == "{'a': [1, 2]}"
    assert python_sessions.run(session, "None")["result"] is None
    answer = python_sessions.run(session, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert answer["result"] == "   a\n0  1\n1  2"
    assert (answer["exit_code"], answer["error"]) == (0, None)


def test_code_larger_than_the_pipe_to_the_program_arrives_whole_and_the_next_call_follows(
    python_sessions: Sessions,
) -> None:
    """The supervisor writes a call's frame into the program's pipe at once and queues what the pipe does
    not take: a frame of about 1 MiB (the most code a call takes) is written in both ways."""
    session = new_python_session(python_sessions)
    size = MAX_CODE_BYTES - 100
    code = f"s = '{'ab' * (size // 2)}'\n(len(s), s.count('ba'))"
    assert python_sessions.run(session, code, timeout_s=30)["result"] == f"({size}, {size // 2 - 1})"
    assert python_sessions.run(session, "len(s) + 1")["result"] == str(size + 1)


def test_a_call_that_raises_answers_the_error_and_the_session_lives_on(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    answer = python_sessions.run(session, "def f():\n    raise ValueError('bad value')\nf()")
    assert answer["exit_code"] == 1
    assert answer["session_ended"] is False
    error = answer["error"]
    assert (error["name"], error["message"]) == ("ValueError", "bad value")
    assert error["stack"].startswith('Traceback (most recent call last):\n  File "<cell 1>", line 3, in <module>')
    assert error["stack"] in answer["stderr"]
    assert python_sessions.run(session, "f.__name__")["result"] == "'f'"


def test_top_level_await_runs(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    answer = python_sessions.run(session, "import asyncio\nawait asyncio.sleep(0.01)\n'awaited'")
    assert answer["result"] == "'awaited'"


def test_a_call_interrupted_at_its_timeout_keeps_the_session_state(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    python_sessions.run(session, "kept = 'yes'")
    answer = python_sessions.run(session, "while True:\n    pass", timeout_s=1)
    assert (answer["timed_out"], answer["exit_code"], answer["session_ended"]) == (True, None, False)
    assert answer["error"]["name"] == "Timeout"
    assert python_sessions.run(session, "kept")["result"] == "'yes'"


def test_a_call_that_handles_its_interrupt_finishes_its_handler_while_the_interrupt_is_resent(
    python_sessions: Sessions,
) -> None:
    # The supervisor sends SIGINT again every 200 ms until the call answers; only the first may raise.
    session = new_python_session(python_sessions)
    code = (
        "import time\ntry:\n    while True:\n        pass\nexcept KeyboardInterrupt:\n"
        "    end = time.monotonic() + 1\n    while time.monotonic() < end:\n        pass\n'cleaned up'"
    )
    answer = python_sessions.run(session, code, timeout_s=1)
    assert (answer["result"], answer["error"], answer["session_ended"]) == ("'cleaned up'", None, False)
    assert answer["timed_out"] is True  # the service's word: the call ran past its deadline


def test_a_call_that_ignores_the_interrupt_ends_the_session(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    answer = python_sessions.run(
        session, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", 1
    )
    assert (answer["timed_out"], answer["session_ended"]) == (True, True)


def test_sys_exit_ends_the_session_with_its_code(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    answer = python_sessions.run(session, "import sys\nsys.exit(4)")
    assert (answer["session_ended"], answer["exit_code"]) == (True, 4)
    later = python_sessions.request("POST", f"/sessions/{session}/execute", json={"code": "1"})
    assert later.status_code == 410


def test_a_plot_comes_back_as_a_png_in_images(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    answer = python_sessions.run(session, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    assert [image["mime"] for image in answer["images"]] == ["image/png"]
    assert base64.b64decode(answer["images"][0]["data"]).startswith(PNG_SIGNATURE)
    assert answer["images_truncated"] is False
    # A figure left open is shown at the end of the call, and only once.
    assert len(python_sessions.run(session, "plt.figure(); plt.plot([1]); None")["images"]) == 1
    assert python_sessions.run(session, "1")["images"] == []


def test_past_eight_figures_the_images_are_truncated(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    answer = python_sessions.run(
        session, "import matplotlib.pyplot as plt\nfor i in range(10):\n    plt.figure(); plt.plot([i])"
    )
    assert (len(answer["images"]), answer["images_truncated"]) == (8, True), answer


def test_files_move_between_the_workspace_and_pandas(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    upload = python_sessions.request("PUT", f"/sessions/{session}/files/data.csv", content=b"city,t\nOslo,3\nRome,18\n")
    assert upload.status_code in (200, 201), upload.text
    answer = python_sessions.run(
        session,
        "import pandas as pd, matplotlib.pyplot as plt\ndf = pd.read_csv('data.csv')\n"
        "df.plot.bar(x='city', y='t'); plt.savefig('/workspace/chart.png'); plt.close('all')\nint(df.t.max())",
    )
    assert answer["result"] == "18", answer
    download = python_sessions.request("GET", f"/sessions/{session}/files/chart.png")
    assert download.status_code == 200
    assert download.content.startswith(PNG_SIGNATURE)


@pytest.mark.security
def test_file_access_outside_the_workspace_is_refused_with_the_path_code(python_sessions: Sessions) -> None:
    session = new_python_session(python_sessions)
    for code in ("open('/etc/passwd').read()", "open('/app/x', 'w')", "open('/workspace/../etc/x', 'w')"):
        error = python_sessions.run(session, code)["error"]
        assert error["name"] == "PermissionError", (code, error)
        assert "ERR_METAAGENT_PATH_REFUSED" in error["message"], (code, error)


def test_a_session_rejects_npm_packages_for_python(python_sessions: Sessions) -> None:
    response = python_sessions.request("POST", "/sessions", json={"language": "python", "packages": ["lodash"]})
    assert response.status_code == 400, response.text


# --- over SSE and MCP -------------------------------------------------------------------------------------


def test_python_output_streams_and_a_plot_arrives_in_the_result_event(python_service: Service) -> None:
    from tests.sandbox.test_streaming import SSE, result_of, stream, text_of

    events = stream(python_service, {"code": "print('one')\nprint('two')", "language": "python"})
    assert text_of(events, "stdout") == "one\ntwo\n"
    assert result_of(events)["exit_code"] == 0
    session = Sessions(python_service)
    session_id = new_python_session(session)
    plot = {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nprint('drawn')"}
    url = f"{python_service.base_url}/sessions/{session_id}/execute"
    with httpx2.stream("POST", url, json=plot, headers=SSE, timeout=120) as response:
        body = response.read().decode()
    session.close(session_id)
    result = json.loads(body.split("event: result\ndata: ", 1)[1].split("\n", 1)[0])
    assert "drawn" in body.split("event: result", 1)[0]
    assert base64.b64decode(result["images"][0]["data"]).startswith(PNG_SIGNATURE)


async def test_over_mcp_a_figure_is_an_image_content_item(python_service: Service) -> None:
    import anyio
    import mcp.types as types
    from mcp import Client

    with anyio.fail_after(120):
        async with Client(f"{python_service.base_url}/mcp") as client:
            created = await client.call_tool("session_create", {"language": "python"})
            assert created.structured_content is not None, created
            session_id = created.structured_content["session_id"]
            code = "import matplotlib.pyplot as plt\nplt.plot([2, 1])\nplt.show()"
            result = await client.call_tool("code_interpreter", {"code": code, "session_id": session_id})
            await client.call_tool("session_close", {"session_id": session_id})
    text, image = result.content
    assert isinstance(text, types.TextContent)
    assert isinstance(image, types.ImageContent)
    assert image.mime_type == "image/png"
    assert base64.b64decode(image.data).startswith(PNG_SIGNATURE)
    assert result.structured_content is not None
    assert result.structured_content["images"][0]["data"] == image.data
    assert json.loads(text.text)["images"] == [{"mime": "image/png", "data": "<image 1>"}]
