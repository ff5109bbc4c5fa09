"""llmgw-poller: one shared, fresh view of LLM engine load, through Redis."""

from ._version import __version__

__all__ = ["__version__"]
