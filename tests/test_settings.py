"""The settings' errors: each named by the environment variable that sets it, never with a secret."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from metaagent.settings import Settings, describe_settings_error, environment_name


def test_a_setting_is_named_by_its_environment_variable_or_its_first_alias() -> None:
    assert environment_name("http_max_redirects") == "METAAGENT_HTTP_MAX_REDIRECTS"
    assert environment_name("allow_http_hosts") == "ALLOW_HTTP_HOSTS"
    assert environment_name("allowed_hosts") == "METAAGENT_ALLOWED_HOSTS"


def test_each_bad_setting_is_described_by_its_variable_with_the_value_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAAGENT_HTTP_MAX_REDIRECTS", "many")
    monkeypatch.setenv("METAAGENT_KILL_GRACE_S", "-1")
    with pytest.raises(ValidationError) as raised:
        Settings()
    message = describe_settings_error(raised.value)
    assert "METAAGENT_HTTP_MAX_REDIRECTS: Input should be a valid integer" in message
    assert "(got 'many')" in message
    assert "METAAGENT_KILL_GRACE_S: Input should be greater than or equal to 0 (got '-1')" in message


@pytest.mark.security
def test_a_settings_error_never_repeats_a_secrets_value() -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(openai_api_key=12345678)  # type: ignore[arg-type]  # the wrong type is the point
    message = describe_settings_error(raised.value)
    assert message.startswith("OPENAI_API_KEY: ")
    assert "12345678" not in message


@pytest.mark.parametrize(
    ("session_max", "per_key", "key_count", "share"),
    [(4, None, 0, 4), (4, None, 1, 4), (4, None, 3, 1), (9, None, 2, 4), (4, None, 10, 1), (4, 3, 3, 3), (4, 9, 0, 9)],
)
def test_a_keys_default_session_share_is_an_equal_part_of_the_total_and_at_least_one(
    session_max: int, per_key: int | None, key_count: int, share: int
) -> None:
    """The finding: the default was the whole METAAGENT_SESSION_MAX, so one key could hold every session."""
    settings = Settings(_env_file=None, session_max=session_max, sessions_per_key=per_key)  # type: ignore[call-arg]  # pydantic-settings' init-only option
    assert settings.effective_sessions_per_key(cpu_count=2, key_count=key_count) == share


@pytest.mark.parametrize(
    ("value", "languages"),
    [
        (None, ("javascript", "python")),
        ("javascript", ("javascript",)),
        (" javascript , python ", ("javascript", "python")),
        ('["javascript", "python", "javascript"]', ("javascript", "python")),
    ],
)
def test_languages_are_comma_separated_or_a_json_array_and_default_to_both(
    monkeypatch: pytest.MonkeyPatch, value: str | None, languages: tuple[str, ...]
) -> None:
    if value is not None:
        monkeypatch.setenv("METAAGENT_LANGUAGES", value)
    assert Settings().languages == languages


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("ruby,javascript", "unknown language 'ruby'"),
        ("python", "javascript must be enabled"),
        ("", "javascript must be enabled"),
        ("[javascript", "not a JSON array"),
    ],
)
def test_bad_languages_are_refused_with_what_to_give(monkeypatch: pytest.MonkeyPatch, value: str, problem: str) -> None:
    monkeypatch.setenv("METAAGENT_LANGUAGES", value)
    with pytest.raises(ValidationError) as raised:
        Settings()
    message = describe_settings_error(raised.value)
    assert message.startswith("METAAGENT_LANGUAGES: ")
    assert problem in message
