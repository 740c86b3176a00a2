"""The languages the sandbox runs, and the one place that says which ones are served.

A language is a program image, a child runner and a policy (`Language`); the code interpreter tool and
sessions look the request's `language` up here and build every container from what it names
(`languages.container`). `LANGUAGES` is every language this service knows; the ones it serves are those
`METAAGENT_LANGUAGES` enables (`Settings.languages`, which always has JavaScript): `served(names)`
gives them, and the code interpreter holds one lane (image and warm pool) for each. A language the
schema offers but the settings leave out is refused with a 400 before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable

from metaagent.errors import RequestRefused
from metaagent.languages.javascript import JAVASCRIPT
from metaagent.languages.language import ImageBuildError, Language, LanguageName, code_fields
from metaagent.languages.python import PYTHON

__all__ = [
    "DEFAULT_LANGUAGE",
    "JAVASCRIPT",
    "LANGUAGES",
    "PYTHON",
    "ImageBuildError",
    "Language",
    "LanguageName",
    "code_fields",
    "served",
    "served_language",
]

DEFAULT_LANGUAGE = JAVASCRIPT  # a request's `language` when it gives none
LANGUAGES: dict[str, Language] = {language.name: language for language in (JAVASCRIPT, PYTHON)}


def served(names: Iterable[str]) -> dict[str, Language]:
    """The languages of `names` (METAAGENT_LANGUAGES, as `Settings.languages` validated it), in its order."""
    return {name: LANGUAGES[name] for name in names}


def served_language(name: str, enabled: Iterable[str]) -> Language:
    """The language a request names, if `enabled` (the served languages' names) has it; a 400 otherwise."""
    names = tuple(enabled)
    if name in names:
        return LANGUAGES[name]
    default = DEFAULT_LANGUAGE
    if name in LANGUAGES:
        raise RequestRefused(
            f"Language {name!r} is not served here (METAAGENT_LANGUAGES={','.join(names)}); "
            f"use {default.name} ({default.label}), or ask the operator to enable {name}"
        )
    raise RequestRefused(f"Language {name!r} is unknown; use {default.name} ({default.label})")
