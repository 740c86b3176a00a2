"""Where a service keeps its state: never the directory it was started from (issue 23, item 12)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metaagent.settings import Settings


def test_the_default_audit_log_lives_under_the_state_directory_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("METAAGENT_AUDIT_LOG", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    assert Settings().audit_log == tmp_path / "state" / "metaagent" / "audit.jsonl"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Settings().audit_log == tmp_path / "home" / ".local" / "state" / "metaagent" / "audit.jsonl"
