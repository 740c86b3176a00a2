"""Python: CPython 3.11 with numpy, pandas, matplotlib and scipy (`image`), its program run as the child of
node's trusted runner (`image.python_runner_command`), whose supervisor and wire every language shares.

Served when `METAAGENT_LANGUAGES` includes python (the default) and once its image is there: until then a
Python request answers 503 with the reason, as JavaScript's do without theirs. Its policy: no npm
packages, and more memory than JavaScript at least (`MIN_MEMORY_MB`).
"""

from __future__ import annotations

from metaagent.languages.language import Language
from metaagent.languages.python.image import build_python_image, python_image_tag, python_runner_command

# The least memory_mb of a Python execution: the interpreter with numpy, pandas and matplotlib imported,
# and node's supervisor beside it. A first estimate; the runner's measurements may change it.
MIN_MEMORY_MB = 256

PYTHON = Language(
    name="python",
    label="Python 3.11",
    image_tag=python_image_tag,
    build_image=build_python_image,
    runner_command=python_runner_command,
    tells_its_end=True,
    packages=False,
    min_memory_mb=MIN_MEMORY_MB,
    without_packages=(
        "remove `packages` (numpy, pandas, matplotlib and scipy are in Python's image), "
        "or run JavaScript (language: javascript)"
    ),
)
