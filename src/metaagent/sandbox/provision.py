"""Whether a language's sandbox image is there, and building it in the background when it is not.

The service starts at once; executions answer 503 with the reason (building, build failed, engine down)
until the image is ready. A missing image or engine is looked for again on the next execution, so a
service started before the engine recovers by itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio

from metaagent.errors import Unavailable
from metaagent.languages import DEFAULT_LANGUAGE, ImageBuildError, Language
from metaagent.sandbox.engine import Engine, EngineUnavailable

log = logging.getLogger("metaagent.sandbox")


class SandboxImage:
    def __init__(
        self, engine: Engine, *, tag: str | None, cache_dir: Path, language: Language = DEFAULT_LANGUAGE
    ) -> None:
        self.engine = engine
        self.language = language
        self.tag = tag or language.image_tag()
        self.cache_dir = cache_dir
        self.image_id: str | None = None
        self.building = False
        self.error: str | None = None
        # Whether it has been looked for since the service started: before that, /health says "starting"
        # rather than report an image it has not looked for as missing.
        self.checked = False
        self._build_failure: str | None = None  # kept: a later look-up must not hide why the build failed

    async def refresh(self, *, build: bool) -> None:
        """Looks the image up; builds it when missing and `build` is true. Never raises."""
        try:
            self.image_id = await self.engine.image_id(self.tag)
        except EngineUnavailable as exc:
            self.error = exc.message
            self.checked = True
            return
        self.checked = True
        if self.image_id is not None:
            self.error = None
            return
        if not build:
            missing = f"The sandbox image {self.tag} is missing; build it with `metaagent sandbox build`"
            self.error = self._build_failure or missing
            return
        self.building = True
        log.info("building the sandbox image %s (about a minute the first time)", self.tag)
        try:
            self.image_id = await anyio.to_thread.run_sync(self._build, abandon_on_cancel=True)
            self.error = None
            log.info("sandbox image %s is ready", self.tag)
        except (ImageBuildError, EngineUnavailable, OSError) as exc:  # OSError: a full or read-only disk
            self.error = self._build_failure = f"The sandbox image could not be built: {exc}"
            log.error("%s", self.error)
        finally:
            self.building = False

    def _build(self) -> str:
        return self.language.build_image(
            self.engine.client, cache_dir=self.cache_dir, progress=lambda line: log.info("%s", line)
        )

    async def require(self) -> str:
        """The image to run, or Unavailable (503) saying why there is none."""
        if self.image_id is None and not self.building:
            await self.refresh(build=False)
        if self.image_id is not None:
            return self.tag
        if self.building:
            raise Unavailable("The sandbox image is being built (about a minute on first start); retry shortly")
        raise Unavailable(self.error or "The sandbox image is not ready")
