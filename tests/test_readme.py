"""The README's settings table lists every setting the service reads, and every example block is run or says why
not (`tests/readme_blocks.py`; they run in `tests/sandbox/test_readme_examples.py`)."""

from __future__ import annotations

from pathlib import Path

from metaagent.settings import Settings, environment_name
from tests.readme_blocks import KINDS, blocks

README = Path(__file__).parent.parent / "README.md"


def test_every_setting_has_a_row_in_the_readme_configuration_table() -> None:
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert {environment_name(name) for name in Settings.model_fields} <= rows


def test_every_readme_block_has_a_known_kind_and_each_that_is_not_run_says_why() -> None:
    found = blocks()
    assert [b.name for b in found if b.kind not in KINDS] == []  # a block without a kind is neither run nor marked
    skipped = {b.name: b.not_run for b in found if b.kind == "sh" or b.not_run}
    assert all(skipped.values()), f"not run without a reason: {[n for n, why in skipped.items() if not why]}"
    assert not [b.name for b in found if b.kind == "text" and b.not_run]  # quotations are not examples


def test_a_console_block_without_prompts_follows_a_python_block_as_its_output() -> None:
    assert [b.name for b in blocks() if b.is_output] == []  # each was folded into the python block before it
