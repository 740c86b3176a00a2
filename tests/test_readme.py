"""The README's settings table lists every setting the service reads."""

from __future__ import annotations

from pathlib import Path

from metaagent.settings import Settings, environment_name

README = Path(__file__).parent.parent / "README.md"


def test_every_setting_has_a_row_in_the_readme_configuration_table() -> None:
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert {environment_name(name) for name in Settings.model_fields} <= rows
