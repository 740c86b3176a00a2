"""What a language is to this service: a program image, a child runner and a policy.

Everything else (the engine, the pool, caps, timeouts, audit, executions, sessions, the supervisor and
its wire, files, streaming, MCP) is shared and does not know which language runs; what differs between
languages is what an instance of `Language` holds. Each language is a subpackage of `languages` that
builds its image and makes one instance (`languages.javascript.JAVASCRIPT`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import docker

from metaagent.errors import RequestRefused

# The names a request may give, served or not: the schema offers them all, and one that METAAGENT_LANGUAGES
# does not enable answers a 400 that says so (`languages.served_language`).
LanguageName = Literal["javascript", "python"]


class ImageBuildError(Exception):
    """A language's image could not be built; the message says what failed and what to do."""


class BuildImage(Protocol):
    def __call__(self, client: docker.DockerClient, *, cache_dir: Path, progress: Callable[[str], None] = ...) -> str:
        """Builds the image unless its tag already exists; returns the image id (ImageBuildError otherwise).
        Blocks: call it from a worker thread."""
        ...


@dataclass(frozen=True)
class Language:
    name: LanguageName
    label: str  # how messages name it: "Node.js 18"
    image_tag: Callable[[], str]  # its program image, tagged by a hash of the recipe and the runner's files
    build_image: BuildImage
    # The trusted runner's command in a container of `memory_mb` MiB. The same container serves a
    # one-shot run and a session: the runner's stdin header (sandbox.execute) says which.
    runner_command: Callable[[int], list[str]]
    # What the runtime writes on stderr when the program has exhausted its heap: a session whose process
    # ends after writing it ended out of memory, although no OOM kill was needed. None: it has no such line.
    out_of_memory_message: str | None = None
    # Whether its program is the runner's child, so that the runner can tell when a one-shot program has
    # ended (`sandbox.execute.payload`'s end token) and the answer need not wait for the container's end.
    tells_its_end: bool = False
    # The policy the shared code consults (`check_request`) instead of naming languages.
    packages: bool = False  # npm packages (`metaagent.packages`): JavaScript's alone
    min_memory_mb: int = 64  # the least `memory_mb` its runner and program start in (the schema's least: 64)
    # What a refused `packages` message adds: what to do instead.
    without_packages: str = "remove `packages`"

    def check_request(self, *, memory_mb: int, packages: list[str]) -> None:
        """A 400 (RequestRefused) for what this language does not support, before anything starts."""
        if packages and not self.packages:
            raise RequestRefused(f"packages are npm packages, for JavaScript only; {self.without_packages}")
        if memory_mb < self.min_memory_mb:
            raise RequestRefused(
                f"memory_mb {memory_mb} is below {self.label}'s minimum of {self.min_memory_mb} MiB; "
                f"give memory_mb of at least {self.min_memory_mb}"
            )


def code_fields(code: str) -> dict[str, Any]:
    """How audit records name code, in every language: its sha256 and size, never the code itself."""
    data = code.encode()
    return {"code_sha256": hashlib.sha256(data).hexdigest(), "code_bytes": len(data)}
