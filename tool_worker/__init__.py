"""Tool workers: local tools and MCP servers served from NATS pools, each call once.

Write tools with :func:`tool`; run a pool with ``loopmesh tool-worker --pool NAME``
(or :class:`ToolWorker` in your own process).
"""

from .context import ToolContext
from .errors import ToolError
from .local import load_module, to_tool, tool
from .registry import Registry, Tool

__all__ = ["Registry", "Tool", "ToolContext", "ToolError", "load_module", "to_tool", "tool"]
