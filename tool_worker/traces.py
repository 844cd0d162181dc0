"""The tool worker's span: ``execute_tool {tool}`` per call it runs (GenAI conventions).

It continues the ``traceparent`` of the request's headers (the loop worker's dispatch
span), and it is current while the tool runs, so an MCP call below it is its child
and carries it on to the MCP server in the request's ``_meta`` (the MCP SDK's own
``MCP send tools/call`` span does that). A call answered from its effect record runs
nothing and gets no span. While tracing is off this builds nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from loopmesh import tracing
from schemas import ToolCallRequest

if TYPE_CHECKING:
    from opentelemetry.trace import Span


def tool_span(
    request: ToolCallRequest, headers: Mapping[str, str] | None, pool: str
) -> contextlib.AbstractContextManager[Span | None]:
    if not tracing.enabled():
        return tracing.NO_SPAN
    return tracing.span(
        f"execute_tool {request.tool}",
        kind="server",
        carrier=headers or {},
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": request.tool,
            "gen_ai.tool.call.id": request.call_id,
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": f"{request.tenant}.{request.session}",
            "loopmesh.tool.server": request.server,
            "loopmesh.tool.pool": pool,
        },
    )
