"""The figures a session call showed (`images`), checked again here: the supervisor in the container
checked them, but nothing a container sends is believed without a check of its own.

At most `MAX_IMAGES` PNGs of `MAX_IMAGE_BYTES` in all (decoded); what breaks a rule is left out, and
`images_truncated` then says that something was.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

MAX_IMAGES = 8
MAX_IMAGE_BYTES = 4 * 1024 * 1024
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Figures:
    images: tuple[str, ...] = ()  # base64 of each PNG
    truncated: bool = False


NO_FIGURES = Figures()


def checked_figures(images: object, truncated: object) -> Figures:
    """The figures of a call's answer: its `images` (a list of {mime, data}) and `images_truncated`."""
    if images is None:
        return Figures(truncated=True) if truncated is True else NO_FIGURES
    if not isinstance(images, list):
        return Figures(truncated=True)
    kept: list[str] = []
    total = 0
    left_out = truncated is True
    for image in images:
        png = _png(image)
        if png is None or len(kept) >= MAX_IMAGES or total + len(png) > MAX_IMAGE_BYTES:
            left_out = True
            continue
        total += len(png)
        kept.append(image["data"])
    return Figures(tuple(kept), left_out)


def _png(image: object) -> bytes | None:
    if not isinstance(image, dict) or set(image) != {"mime", "data"} or image["mime"] != "image/png":
        return None
    data = image["data"]
    if not isinstance(data, str) or not data.isascii():
        return None
    try:
        png = base64.b64decode(data, validate=True)
    except binascii.Error:
        return None
    return png if png.startswith(PNG_SIGNATURE) else None
