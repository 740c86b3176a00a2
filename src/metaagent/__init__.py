"""MetaAgent tools: a sandboxed JavaScript interpreter, an egress-guarded HTTP tool, search and embeddings."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from metaagent.client import AsyncClient, Client

try:
    __version__ = version("metaagent")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["AsyncClient", "Client", "__version__"]


def __getattr__(name: str) -> Any:
    # The clients are imported on first use, so that `import metaagent` stays cheap.
    if name in ("Client", "AsyncClient"):
        from metaagent import client

        return getattr(client, name)
    raise AttributeError(f"module 'metaagent' has no attribute {name!r}")
