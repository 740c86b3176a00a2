"""The language layer: which languages are served, and that a container runs its language's runner
(issue 24, item 1). No container starts here."""

from __future__ import annotations

import dataclasses

import pytest

from metaagent import settings
from metaagent.errors import RequestRefused
from metaagent.languages import DEFAULT_LANGUAGE, JAVASCRIPT, LANGUAGES, PYTHON, code_fields, served, served_language
from metaagent.languages.container import container_spec
from metaagent.languages.javascript.image import runner_command
from metaagent.languages.python.image import python_image_tag, python_runner_command
from metaagent.settings import Settings


def test_javascript_is_what_a_request_without_language_gets() -> None:
    assert served_language("javascript", ["javascript"]) is JAVASCRIPT
    assert DEFAULT_LANGUAGE is JAVASCRIPT


def test_the_served_languages_are_the_settings_own_in_their_order_python_among_them_by_default() -> None:
    assert Settings.model_fields["languages"].default == settings.LANGUAGES
    assert served(settings.LANGUAGES) == {"javascript": JAVASCRIPT, "python": PYTHON}
    assert served(("javascript",)) == {"javascript": JAVASCRIPT}
    assert served_language("python", ("javascript", "python")) is PYTHON


def test_the_languages_the_settings_accept_are_the_languages_there_are() -> None:
    assert tuple(LANGUAGES) == settings.LANGUAGES


def test_python_is_the_python_image_and_its_runner() -> None:
    assert (PYTHON.image_tag(), PYTHON.label) == (python_image_tag(), "Python 3.11")
    assert PYTHON.runner_command(256) == python_runner_command(256)


def test_a_language_the_settings_leave_out_is_refused_naming_the_setting_and_the_language_that_is_served() -> None:
    with pytest.raises(RequestRefused) as refused:
        served_language("python", ("javascript",))
    assert refused.value.status_code == 400
    assert refused.value.message == (
        "Language 'python' is not served here (METAAGENT_LANGUAGES=javascript); use javascript (Node.js 18), "
        "or ask the operator to enable python"
    )


def test_python_refuses_packages_as_npm_packages_for_javascript_only() -> None:
    with pytest.raises(RequestRefused) as refused:
        PYTHON.check_request(memory_mb=256, packages=["lodash"])
    assert refused.value.message.startswith("packages are npm packages, for JavaScript only; remove `packages`")


def test_python_refuses_memory_below_its_minimum_naming_it() -> None:
    with pytest.raises(RequestRefused) as refused:
        PYTHON.check_request(memory_mb=PYTHON.min_memory_mb - 1, packages=[])
    assert refused.value.message == (
        f"memory_mb {PYTHON.min_memory_mb - 1} is below Python 3.11's minimum of {PYTHON.min_memory_mb} MiB; "
        f"give memory_mb of at least {PYTHON.min_memory_mb}"
    )


def test_javascript_takes_packages_and_the_schemas_least_memory() -> None:
    JAVASCRIPT.check_request(memory_mb=64, packages=["lodash"])
    assert PYTHON.min_memory_mb > JAVASCRIPT.min_memory_mb == 64


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
