"""`metaagent repl`'s input rules (pure logic), and its answer when there is no service."""

from __future__ import annotations

from pathlib import Path

import pytest

from metaagent.repl import needs_more, piped_blocks, python_needs_more
from tests.test_cli import free_port, run


@pytest.mark.parametrize(
    "source",
    [
        "function f(a) {\n",
        "[1,\n 2,\n",
        "foo(\n",
        "`a template\n",
        "`a ${ {x: 1}.x \n",
        "/* a comment\n",
        "'a string continued \\\n",
        "if (x) { s = '}'\n",
        "const r = /[)]/; g(\n",
    ],
)
def test_an_open_bracket_template_comment_or_continued_string_needs_more(source: str) -> None:
    assert needs_more(source)


@pytest.mark.parametrize(
    "source",
    [
        "1 + 1\n",
        "function f(a) {\n  return a * 2\n}\n",
        "`${ {x: 1}.x } and ${'}'}`\n",
        "'(' + \"[\" + `{`\n",
        "// an open ( in a comment\n",
        "/* ( */ 1\n",
        "const r = /[(]\\//g; r.test('(')\n",
        "const half = (a) / 2 / (b)\n",
        "'unterminated\n",  # node's SyntaxError, not a continuation
        "}\n",  # a stray closer: the service says what is wrong
    ],
)
def test_closed_input_is_a_complete_block(source: str) -> None:
    assert not needs_more(source)


@pytest.mark.parametrize(
    "source",
    [
        "for x in range(3):\n",
        "for x in range(3):\n    print(x)\n",  # a compound statement ends with a blank line, as in Python's REPL
        "def f(a):\n    return a\n",
        "total = sum([1,\n",
        "f(1,\n  2,\n",
        '"""a docstring\n',
        "x = 1 + \\\n",
        "async for x in numbers():\n",
    ],
)
def test_a_python_compound_statement_open_bracket_or_string_needs_more(source: str) -> None:
    assert python_needs_more(source)


@pytest.mark.parametrize(
    "source",
    [
        "1 + 1\n",
        "x = [1,\n  2]\n",
        "for x in range(3):\n    print(x)\n\n",
        "def f(:\n",  # a SyntaxError: the service says what is wrong
        "'\\d'\n",  # a SyntaxWarning of the code's own is no error of the REPL's
        "await asyncio.sleep(0)\n",
    ],
)
def test_a_finished_or_invalid_python_statement_is_a_complete_block(source: str) -> None:
    assert not python_needs_more(source)


def test_piped_input_is_cut_at_blank_lines_and_ends_at_exit() -> None:
    lines = ["let x = 1\n", "let y = 2\n", "\n", "   \n", "x + y\n", "\n", ".exit\n", "never sent\n"]
    assert list(piped_blocks(lines)) == ["let x = 1\nlet y = 2\n", "x + y\n"]


def test_the_last_piped_block_needs_no_blank_line_and_exit_inside_a_block_is_code() -> None:
    assert list(piped_blocks(["a\n", ".exit\n", "\n", "b"])) == ["a\n.exit\n", "b"]


def test_repl_without_a_service_names_the_url_nothing_answers_at_and_exits_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run(tmp_path, "repl", "--url", url)
    assert result.returncode == 1
    assert result.stderr.startswith(f"metaagent: no service answers at {url} (")
    assert "metaagent serve" in result.stderr
    assert result.stdout == ""


def test_repl_reads_the_service_url_from_metaagent_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run(tmp_path, "repl", METAAGENT_URL=url)
    assert result.returncode == 1
    assert result.stderr.startswith(f"metaagent: no service answers at {url} (")


def test_repl_at_a_url_that_is_not_this_service_says_so_and_exits_1(tmp_path: Path, upstream: str) -> None:
    result = run(tmp_path, "repl", "--url", f"{upstream}/not-the-service")
    assert result.returncode == 1
    assert result.stderr.startswith(f"metaagent: {upstream}/not-the-service is not a metaagent service: GET /health")


def test_repl_with_an_unknown_language_exits_2_naming_the_choices(tmp_path: Path) -> None:
    result = run(tmp_path, "repl", "--language", "ruby", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert result.stderr == "metaagent: unknown --language 'ruby'; give javascript or python\n"
