"""A session call's answer loses nothing silently (issue 23, items 5 and 6): `result` is the whole value
up to the cap, and `result_truncated` says exactly when it is not; `error` says, as data, why a call did
not complete normally, whatever a hostile program throws or forges."""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from metaagent.tools.code_interpreter import MAX_CODE_BYTES
from tests.sandbox.conftest import Sessions

pytestmark = [pytest.mark.docker]


# --- result -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        ("({a:{b:{c:{d:1}}}})", "{\n  a: { b: { c: { d: 1 } } }\n}"),
        ("({ nested: { deep: [1, { x: 'y' }] } })", "{\n  nested: { deep: [ 1, { x: 'y' } ] }\n}"),
        ("'x'.repeat(20000)", "'" + "x" * 20000 + "'"),
        ("const c = { n: 1 }; c.self = c; c", "<ref *1> { n: 1, self: [Circular *1] }"),
        ("new Proxy({}, { get() { throw new Error('trap'); } })", "Proxy [ {}, { get: [Function: get] } ]"),
        ("({ get g() { throw new Error('getter'); } })", "{ g: [Getter] }"),
    ],
    ids=["deep", "nested", "long-string", "circular", "proxy", "throwing-getter"],
)
def test_a_value_comes_back_whole_as_the_repl_shows_it(sessions: Sessions, code: str, shown: str) -> None:
    answer = sessions.run(sessions.create(), code)
    assert (answer["result"], answer["result_truncated"], answer["error"]) == (shown, False, None)


def test_code_larger_than_the_pipe_to_the_program_arrives_whole_and_the_next_call_follows(sessions: Sessions) -> None:
    """The supervisor writes a call's frame into the program's pipe at once and queues what the pipe does
    not take: a frame of about 1 MiB (the most code a call takes) is written in both ways."""
    session = sessions.create()
    size = MAX_CODE_BYTES - 100
    code = f"globalThis.s = '{'ab' * (size // 2)}';\n[s.length, s.split('ba').length - 1]"
    assert sessions.run(session, code, timeout_s=30)["result"] == f"[ {size}, {size // 2 - 1} ]"
    assert sessions.run(session, "s.length + 1")["result"] == str(size + 1)


def test_a_long_array_comes_back_with_every_item(sessions: Sessions) -> None:
    answer = sessions.run(sessions.create(), "Array.from({ length: 150 }, (_, i) => i)")
    assert "more items" not in answer["result"]
    assert [int(n) for n in re.findall(r"\d+", answer["result"])] == list(range(150))
    assert answer["result_truncated"] is False


def test_a_value_over_the_cap_is_marked_truncated(sessions: Sessions) -> None:
    answer = sessions.run(sessions.create(), "'y'.repeat(60 * 1024)")
    assert answer["result_truncated"] is True
    assert "[result truncated: " in answer["result"]


@pytest.mark.parametrize(
    "code",
    [
        # nested deeper than inspect's recursion reaches: it stops with a marker
        "let deep = {}; for (let i = 0, o = deep; i < 100000; i++) o = o.x = {}; deep",
        # a graph that shares each level twice: 2**40 paths, shown until the cap is passed
        "let o = { k: 1 }; for (let i = 0; i < 40; i++) o = { l: o, r: o }; o",
    ],
    ids=["too-deep", "shared-graph"],
)
def test_a_value_that_cannot_be_shown_whole_answers_truncated_and_the_session_lives_on(
    sessions: Sessions, code: str
) -> None:
    sid = sessions.create()
    answer = sessions.run(sid, code, timeout_s=30)
    assert (answer["exit_code"], answer["result_truncated"], answer["error"]) == (0, True, None)
    assert sessions.run(sid, "1 + 1")["result"] == "2"


def test_a_value_whose_inspect_throws_says_so_and_the_session_lives_on(sessions: Sessions) -> None:
    sid = sessions.create()
    answer = sessions.run(sid, "({ [Symbol.for('nodejs.util.inspect.custom')]() { throw new Error('no show'); } })")
    assert answer["result"] == "[the value cannot be shown: no show]"
    assert (answer["exit_code"], answer["result_truncated"]) == (0, True)
    assert sessions.run(sid, "1 + 1")["result"] == "2"


def test_a_value_whose_inspect_never_ends_is_interrupted_at_the_timeout_and_the_session_lives_on(
    sessions: Sessions,
) -> None:
    sid = sessions.create()
    answer = sessions.run(sid, "({ [Symbol.for('nodejs.util.inspect.custom')]() { for (;;); } })", timeout_s=1)
    assert (answer["timed_out"], answer["session_ended"]) == (True, False)
    assert answer["error"]["name"] == "Timeout"
    assert sessions.run(sid, "1 + 1")["result"] == "2"


# --- error ------------------------------------------------------------------------------------------------


def test_a_call_that_completes_has_no_error_and_no_images(sessions: Sessions) -> None:
    answer = sessions.run(sessions.create(), "1 + 1")
    assert (answer["error"], answer["images"], answer["images_truncated"]) == (None, [], False)


def test_a_thrown_error_comes_back_with_its_name_message_and_stack(sessions: Sessions) -> None:
    sid = sessions.create()
    answer = sessions.run(sid, "const f = () => null.x;\nf()")
    error = answer["error"]
    assert (error["name"], error["message"]) == ("TypeError", "Cannot read properties of null (reading 'x')")
    assert error["stack"].startswith("TypeError: Cannot read properties of null (reading 'x')\n    at f (REPL")
    assert "/opt/metaagent" not in error["stack"]
    assert f"Uncaught {error['stack']}" in answer["stderr"]  # printed as before
    assert (answer["exit_code"], answer["session_ended"]) == (1, False)
    rejected = sessions.run(sid, "await Promise.reject(new RangeError('later'))")["error"]
    assert (rejected["name"], rejected["message"]) == ("RangeError", "later")
    syntax = sessions.run(sid, "let = ;")["error"]
    assert syntax["name"] == "SyntaxError"


@pytest.mark.parametrize(
    ("code", "message"), [("throw 5", "5"), ("throw { x: 1 }", "{ x: 1 }"), ("throw 'words'", "'words'")]
)
def test_a_thrown_value_that_is_not_an_error_comes_back_as_a_thrown_value(
    sessions: Sessions, code: str, message: str
) -> None:
    answer = sessions.run(sessions.create(), code)
    assert answer["error"] == {"name": "ThrownValue", "message": message, "stack": None}
    assert answer["exit_code"] == 1


def test_a_timeout_that_is_interrupted_says_so_and_the_session_keeps_its_state(sessions: Sessions) -> None:
    sid = sessions.create()
    sessions.run(sid, "let kept = 'yes'")
    answer = sessions.run(sid, "while (true) {}", timeout_s=1)
    assert answer["error"]["name"] == "Timeout"
    assert "timeout_s=1" in answer["error"]["message"]
    assert "keeps its state" in answer["error"]["message"]
    assert sessions.run(sid, "kept")["result"] == "'yes'"


def test_a_call_killed_through_executions_says_killed(sessions: Sessions) -> None:
    sid = sessions.create()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(sessions.run, sid, "while (true) {}", 60)
        sessions.request("DELETE", f"/executions/{sessions.running_call(sid)}")
        answer = call.result(timeout=60)
    assert (answer["killed"], answer["session_ended"], answer["error"]["name"]) == (True, False, "Killed")


def test_closing_the_session_during_a_call_says_killed(sessions: Sessions) -> None:
    sid = sessions.create()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(sessions.run, sid, "await new Promise(() => {})", 30)
        sessions.running_call(sid)
        sessions.close(sid)
        answer = call.result(timeout=60)
    assert answer["error"]["name"] == "Killed"
    assert "closed" in answer["error"]["message"]


def test_process_exit_says_exited_with_its_code(sessions: Sessions) -> None:
    answer = sessions.run(sessions.create(), "process.exit(3)")
    assert (answer["exit_code"], answer["session_ended"], answer["error"]["name"]) == (3, True, "Exited")
    assert "code 3" in answer["error"]["message"]


def test_running_out_of_memory_says_out_of_memory(sessions: Sessions) -> None:
    sid = sessions.create(memory_mb=64)
    answer = sessions.run(sid, "const hog = []; for (;;) hog.push(new Array(1e6).fill(1));", timeout_s=30)
    assert answer["session_ended"] is True
    assert answer["error"]["name"] == "OutOfMemory"
    assert "memory_mb=64" in answer["error"]["message"]


def test_the_error_comes_back_the_same_through_the_code_interpreter_tool(sessions: Sessions) -> None:
    sid = sessions.create()
    response = sessions.request("POST", "/tools/code_interpreter", json={"code": "throw 5", "session_id": sid})
    assert response.status_code == 200, response.text
    assert response.json()["error"] == {"name": "ThrownValue", "message": "5", "stack": None}


# --- a hostile program ------------------------------------------------------------------------------------


def test_an_error_of_megabytes_comes_back_capped_at_4_kib_a_field(sessions: Sessions) -> None:
    sid = sessions.create()
    answer = sessions.run(
        sid,
        "class Huge extends Error { get name() { return 'N'.repeat(1e6); } }\nthrow new Huge('\u00e9'.repeat(1e6))",
    )
    error = answer["error"]
    assert error["name"] == "N" * 4096
    assert error["message"] == "\u00e9" * 2048
    assert len(error["stack"].encode()) <= 4096
    assert sessions.run(sid, "1 + 1")["result"] == "2"


@pytest.mark.security
@pytest.mark.parametrize(
    "forged",
    [
        "{ name: { nested: true }, message: 5, stack: ['x'] }",
        "{ name: 'Forged', message: 'm', stack: null, extra: 'x'.repeat(1e5) }",
        "'x'.repeat(5e5)",
        "[1, 2, 3]",
    ],
    ids=["wrong-types", "extra-key", "a-string", "an-array"],
)
def test_an_error_the_program_forges_in_the_answer_is_refused_for_a_generic_one(
    sessions: Sessions, forged: str
) -> None:
    """The runner's answer is JSON.stringify'd in the program's realm: a toJSON on Object.prototype rewrites
    the error object it sends. What arrives is never believed as it is."""
    sid = sessions.create()
    sessions.run(
        sid,
        "Object.defineProperty(Object.prototype, 'toJSON', { configurable: true, value: function () {"
        f" return 'stack' in this && !(this instanceof Error) ? ({forged}) : this; }} }}); null",
    )
    answer = sessions.run(sid, "throw new Error('real')", timeout_s=2)
    assert answer["error"]["name"] == "Error"
    assert set(answer["error"]) == {"name", "message", "stack"}
    assert len(answer["error"]["message"].encode()) <= 4096
    assert answer["exit_code"] == 1
    assert sessions.run(sid, "delete Object.prototype.toJSON; 1 + 1", timeout_s=2)["result"] == "2"
