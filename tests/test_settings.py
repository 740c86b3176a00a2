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
