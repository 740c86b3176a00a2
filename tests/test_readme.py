"""The README's settings table lists every setting the service reads."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices

from metaagent.settings import Settings

README = Path(__file__).parent.parent / "README.md"


def environment_name(field_name: str) -> str:
    alias = Settings.model_fields[field_name].validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"METAAGENT_{field_name.upper()}"


def test_every_setting_has_a_row_in_the_readme_configuration_table() -> None:
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert {environment_name(name) for name in Settings.model_fields} <= rows
