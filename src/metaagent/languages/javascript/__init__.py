"""JavaScript: CommonJS scripts on Debian's Node.js 18, behind the runner's module gate.

Its image recipe is `image` (and the runner files in `sandbox/runner/`, which the image carries). The
npm packages a request may name are JavaScript's too: `metaagent.packages` installs them into a volume
that only this language's containers mount.
"""

from __future__ import annotations

from metaagent.languages.javascript.image import build_image, image_tag, runner_command
from metaagent.languages.language import Language

JAVASCRIPT = Language(
    name="javascript",
    label="Node.js 18",
    image_tag=image_tag,
    build_image=build_image,
    runner_command=runner_command,
    out_of_memory_message="JavaScript heap out of memory",  # V8's fatal error, as node prints it
    packages=True,
    min_memory_mb=64,  # the schema's least: node's heap and the gate start in it
)
