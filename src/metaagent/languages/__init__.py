"""The languages the sandbox runs, and the one place that says which ones are served.

A language is a program image, a child runner and a policy (`Language`); the code interpreter tool and
sessions look the request's `language` up here and build every container from what it names
(`languages.container`). JavaScript is served; a name the schema offers without a language behind it
(python, for now) is refused with a 400 before anything starts.
"""

from __future__ import annotations

from metaagent.errors import RequestRefused
from metaagent.languages.javascript import JAVASCRIPT
from metaagent.languages.language import ImageBuildError, Language, LanguageName, code_fields

__all__ = [
    "DEFAULT_LANGUAGE",
    "JAVASCRIPT",
    "SERVED",
    "ImageBuildError",
    "Language",
    "LanguageName",
    "code_fields",
    "served_language",
]

DEFAULT_LANGUAGE = JAVASCRIPT  # a request's `language` when it gives none
SERVED: dict[str, Language] = {language.name: language for language in (JAVASCRIPT,)}


def served_language(name: str) -> Language:
    """The language a request names; a 400 for one this service does not run yet."""
    language = SERVED.get(name)
    if language is None:
        default = DEFAULT_LANGUAGE
        raise RequestRefused(f"Language {name!r} is not served here yet; use {default.name} ({default.label})")
    return language
