"""An MCP server for the trace test: ``python trace_mcp.py`` (stdio).

Its one tool, ``traceparent``, answers with the W3C ``traceparent`` its request carried
in ``_meta`` (``none`` without one), so the test sees what reached the MCP server.
"""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("tracecheck")


@server.tool()
def traceparent(ctx: Context) -> str:
    """The traceparent this request's `_meta` carried."""
    meta = ctx.request_context.meta or {}
    return str(meta.get("traceparent", "none"))


if __name__ == "__main__":
    server.run("stdio")
