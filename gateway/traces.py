"""The gateway's span: ``POST /v1/sessions/{session}/turns`` (or ``POST /mcp``, a call of an
agent as an MCP tool), the root of a turn's trace.

It continues the caller's W3C ``traceparent`` header when there is one, else starts a
trace; the turn's NATS message then carries it to the loop worker
(:func:`loopmesh.tracing.forward`). While tracing is off it builds nothing, and the
caller's ``traceparent`` (when well formed) is passed on as it came.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from starlette.requests import Request

from loopmesh import tracing
from schemas import Turn, session_key

if TYPE_CHECKING:
    from opentelemetry.trace import Span

TURNS_ROUTE = "/v1/sessions/{session}/turns"


def turn_span(
    request: Request, turn: Turn, route: str = TURNS_ROUTE
) -> contextlib.AbstractContextManager[Span | None]:
    if not tracing.enabled():
        return tracing.NO_SPAN
    return tracing.span(
        f"POST {route}",
        kind="server",
        carrier=request.headers,
        attributes={
            "http.request.method": "POST",
            "http.route": route,
            "gen_ai.conversation.id": session_key(turn.tenant, turn.session),
            "loopmesh.tenant": turn.tenant,
            "loopmesh.turn.id": turn.id,
        },
    )
