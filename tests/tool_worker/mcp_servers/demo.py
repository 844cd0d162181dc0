"""A project-written MCP server for the tests: ``python demo.py stdio`` or
``python demo.py http PORT``.

Tools: ``add``, ``echo``, ``fail`` (an is_error result), ``slow``, ``pid``,
``idempotency_key`` (the key the request's ``_meta`` carried),
``dotted.name`` (a name that is not a subject token), ``grow`` (adds a tool and sends
``notifications/tools/list_changed``), and ``page_*`` tools so that listing is paged.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ListToolsResult, PaginatedRequestParams

PAGE = 3


class PagedServer(MCPServer):
    """Lists tools ``PAGE`` at a time, so that clients must follow ``next_cursor``."""

    async def _handle_list_tools(self, ctx: Any, params: PaginatedRequestParams | None) -> Any:
        tools = await self.list_tools()
        start = int(params.cursor) if params and params.cursor else 0
        end = start + PAGE
        return ListToolsResult(
            tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None
        )


server = PagedServer("demo")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def echo(text: str) -> str:
    """Echo the text."""
    return text


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ToolError(f"failed because {reason}")


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep a while."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool()
def idempotency_key(ctx: Context) -> str:
    """The idempotency key in this request's ``_meta`` (``none`` when there is none)."""
    meta = ctx.request_context.meta or {}
    return str(meta.get("io.loopmesh/idempotency-key", "none"))


@server.tool(name="dotted.name")
def dotted() -> str:
    """A tool whose name is not a subject token."""
    return "dotted ok"


@server.tool()
async def grow(name: str, ctx: Context) -> str:
    """Add a tool called NAME and tell the client the tool list changed."""

    def added() -> str:
        return f"{name} ok"

    server.add_tool(added, name=name, description=f"added at runtime as {name}")
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


for i in range(4):
    server.add_tool(lambda i=i: f"page {i}", name=f"page_{i}", description=f"filler tool {i}")


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
