"""The README's fenced blocks, as its example tests read them.

The convention (README.md's own examples follow it):
- ```console blocks with `$ ` prompts are shell sessions: each command runs, in one bash for the whole
  block (variables and files carry over), and what follows it up to the next prompt is its output. A
  command may continue over lines (a trailing backslash, or a quote still open).
- ```python blocks run as a script; a ```console block without prompts right after one is its output.
- ```json blocks are MCP client configurations (`mcpServers`).
- ```sh blocks are commands for the operator's machine (install, the whole suite, the benchmarks).
- ```text blocks are quotations (log lines), not examples.
- `<!-- not run: why -->` on the line before a block: not run, for that reason (a python block is still
  compiled and its imports are run). `<!-- output not checked: why -->`: run, the output not compared.

Output is compared line by line, up to what differs from run to run: ids (`exe_...`, `ses_...`, bound at
their first appearance and replaced in later commands), timestamps, durations (`duration_ms`,
`queued_ms`), `date:` headers; a line `...` (any indentation) stands for any number of lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"
KINDS = ("console", "python", "json", "sh", "text")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!-- (not run|output not checked): (.+) -->$")


@dataclass(frozen=True)
class Block:
    kind: str
    text: str
    line: int  # of the opening fence, 1-based
    heading: str  # the nearest heading above it
    not_run: str | None = None  # the reason
    unchecked: str | None = None  # the reason the output is not compared
    output: str | None = None  # a python block's output, from the console block after it

    @property
    def name(self) -> str:
        return f"README.md:{self.line} ({self.heading}, {self.kind})"

    @property
    def is_output(self) -> bool:
        """A console block without prompts: the output of the block before it."""
        return self.kind == "console" and not any(line.startswith("$ ") for line in self.text.splitlines())


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of the README, with its marks; an output block is folded into its python block."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    heading = ""
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        fence = _FENCE.match(line)
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        mark = _MARK.match(lines[index - 1]) if index else None
        reasons = {mark.group(1): mark.group(2)} if mark else {}
        block = Block(
            fence.group(1),
            "\n".join(lines[index + 1 : end]) + "\n",
            index + 1,
            heading,
            not_run=reasons.get("not run"),
            unchecked=reasons.get("output not checked"),
        )
        if block.is_output and found and found[-1].kind == "python" and found[-1].output is None:
            previous = found.pop()
            block = Block(**{**previous.__dict__, "output": block.text})
        found.append(block)
        index = end + 1
    return found


def commands(block: Block) -> list[tuple[str, str]]:
    """A console block's (command, expected output) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("$ "):
            command = [line[2:]]
            while _continues("\n".join(command)) and index + 1 < len(lines):
                index += 1
                command.append(lines[index])
            pairs.append(("\n".join(command), []))
        elif pairs:
            pairs[-1][1].append(line)
        index += 1
    return [(command, "\n".join(output).strip("\n")) for command, output in pairs]


def _continues(command: str) -> bool:
    """Whether bash would read another line: a trailing backslash, or a quote still open."""
    if command.endswith("\\"):
        return True
    quote = None
    escaped = False
    for char in command:
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote is None and char in "'\"":
            quote = char
        elif char == quote:
            quote = None
    return quote is not None


_ID = re.compile(r"\b(?:exe|ses)_[0-9a-f]{24}\b")
# What differs from run to run, and the pattern that stands for it.
_VOLATILE = re.compile(r'(?P<ms>"(?:duration_ms|queued_ms)":)\d+|(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z)')


def match_output(expected: str, actual: str, ids: dict[str, str]) -> str | None:
    """None when `actual` is what `expected` shows (binding the README's ids to the real ones in `ids`),
    else why not."""
    pattern = []
    groups: list[str] = []
    for line in expected.splitlines():
        if line.strip() == "...":
            pattern.append(r"(?:.*\n)*?")
            continue
        if line.lower().startswith("date: "):
            pattern.append(r"date: .*\n")
            continue
        piece = ""
        position = 0
        for found in _ID.finditer(line):
            piece += _escape(line[position : found.start()])
            shown = found.group(0)
            if shown in ids:
                piece += re.escape(ids[shown])
            elif shown in groups:
                piece += f"(?P={_group(groups, shown)})"
            else:
                groups.append(shown)
                piece += f"(?P<{_group(groups, shown)}>{shown[:4]}[0-9a-f]{{24}})"
            position = found.end()
        pattern.append(piece + _escape(line[position:]) + r"\n")
    regex = re.compile("".join(pattern))
    text = actual.strip("\n") + "\n" if actual.strip("\n") else ""
    matched = regex.fullmatch(text)
    if matched is None:
        return f"expected:\n{expected}\n--- got:\n{actual}"
    for shown in groups:
        ids[shown] = matched.group(_group(groups, shown))
    return None


def _group(groups: list[str], shown: str) -> str:
    return f"id{groups.index(shown)}"


def _escape(text: str) -> str:
    """`text` as a pattern: itself, but any duration and any timestamp where it shows one."""
    pattern = ""
    position = 0
    for found in _VOLATILE.finditer(text):
        pattern += re.escape(text[position : found.start()])
        pattern += re.escape(found.group("ms")) + r"\d+" if found.group("ms") else r"[0-9T:.-]+Z"
        position = found.end()
    return pattern + re.escape(text[position:])
