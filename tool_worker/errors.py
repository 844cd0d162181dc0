"""Errors of the tool worker.

    ToolWorkerError
    ├── ToolError              a call failed; becomes a ``WireError`` (``.code``, ``.message``)
    │   ├── InvalidArguments   arguments do not match the tool's schema (``.path``)
    │   ├── UnknownTool        no such server/tool in this pool (``.server``, ``.tool``)
    │   ├── Rejected           a tool refused the request (path outside the root, host not allowed)
    │   ├── McpToolError       an MCP server answered with ``is_error`` or a protocol error
    │   ├── Unavailable        an MCP server is not connected (``.server``)
    │   └── CircuitOpen        too many consecutive failures; retry after ``.retry_after_s``
    ├── RegistryError          a tool cannot be registered (bad signature, duplicate name)
    ├── ToolModuleError        a tool module could not be imported (``.module``)
    │   └── EntryPointError    a ``loopmesh.tools`` entry point is missing or broken (``.name``)
    └── PoolProvisionError     a pool cannot be provisioned ahead of its workers (``.pool``)

A tool function may raise :class:`ToolError` (or a subclass) to choose the code the
caller sees; any other exception becomes code ``tool_exception`` with its message.
"""

from __future__ import annotations


class ToolWorkerError(Exception):
    """Base class of tool worker errors."""


class ToolError(ToolWorkerError):
    code = "tool_exception"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArguments(ToolError):
    code = "invalid_arguments"

    def __init__(self, message: str, *, path: str = "$") -> None:
        super().__init__(f"{message} - at `{path}`")
        self.path = path


class UnknownTool(ToolError):
    code = "unknown_tool"

    def __init__(self, server: str, tool: str, known: list[str] | None = None) -> None:
        hint = f" (this pool serves: {', '.join(known)})" if known else ""
        super().__init__(f"no tool {tool!r} on server {server!r}{hint}")
        self.server = server
        self.tool = tool


class Rejected(ToolError):
    code = "rejected"


class McpToolError(ToolError):
    code = "mcp_error"


class Unavailable(ToolError):
    code = "unavailable"

    def __init__(self, server: str, reason: str) -> None:
        super().__init__(f"MCP server {server!r} is unavailable: {reason}")
        self.server = server


class CircuitOpen(ToolError):
    code = "circuit_open"

    def __init__(self, tool: str, failures: int, retry_after_s: float) -> None:
        super().__init__(
            f"{tool} failed {failures} times in a row; not calling it for another "
            f"{retry_after_s:.1f}s"
        )
        self.retry_after_s = retry_after_s


class RegistryError(ToolWorkerError):
    pass


class ToolModuleError(ToolWorkerError):
    def __init__(self, module: str, reason: str) -> None:
        super().__init__(f"cannot load tool module {module!r}: {reason}")
        self.module = module


class EntryPointError(ToolModuleError):
    def __init__(self, name: str, reason: str) -> None:
        ToolWorkerError.__init__(self, f"cannot load tool entry point {name!r}: {reason}")
        self.module = name
        self.name = name


class PoolProvisionError(ToolWorkerError):
    """An MCP server of the pool did not list its tools, or the pool has none."""

    def __init__(self, pool: str, reason: str) -> None:
        super().__init__(f"cannot provision pool {pool!r}: {reason}")
        self.pool = pool
        self.reason = reason
