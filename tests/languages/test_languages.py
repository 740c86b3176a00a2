"""The language layer: which languages are served, and that a container runs its language's runner
(issue 24, item 1). No container starts here."""

from __future__ import annotations

import dataclasses

import pytest

from metaagent.errors import RequestRefused
from metaagent.languages import DEFAULT_LANGUAGE, JAVASCRIPT, SERVED, code_fields, served_language
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import runner_command


def test_javascript_is_served_and_is_what_a_request_without_language_gets() -> None:
    assert served_language("javascript") is JAVASCRIPT
    assert DEFAULT_LANGUAGE is JAVASCRIPT
    assert set(SERVED) == {"javascript"}


def test_python_is_refused_as_not_served_yet_naming_the_language_that_is() -> None:
    with pytest.raises(RequestRefused) as refused:
        served_language("python")
    assert refused.value.message == "Language 'python' is not served here yet; use javascript (Node.js 18)"


def test_a_container_runs_its_languages_runner_under_dumb_init() -> None:
    other = dataclasses.replace(JAVASCRIPT, runner_command=lambda memory_mb: ["/usr/bin/other", f"--mb={memory_mb}"])
    spec = container_spec("ex_1", "image:tag", 128, 0.5, language=other)
    assert spec.command == ["/usr/bin/dumb-init", "--", "/usr/bin/other", "--mb=128"]


def test_a_container_without_a_language_runs_javascripts_runner() -> None:
    spec = container_spec("ex_1", "image:tag", 256, 0.5)
    assert spec.command == ["/usr/bin/dumb-init", "--", *runner_command(256)]


def test_audit_names_code_by_its_hash_and_size_never_its_text() -> None:
    assert code_fields("console.log('é')") == {
        "code_sha256": "4b1298dbd176ae9a34025882f718011cad94ece647e3a8ceb73945979ea06bb1",
        "code_bytes": 17,  # UTF-8 bytes, not characters
    }
