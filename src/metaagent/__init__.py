"""MetaAgent tools: a sandboxed JavaScript interpreter, an egress-guarded HTTP tool, search and embeddings."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("metaagent")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
