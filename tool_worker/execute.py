"""Running one tool call: the tool looked up (a local tool, or an MCP server's), its
arguments validated against its JSON Schema, the call made under its timeout with the
call's :class:`~tool_worker.context.ToolContext`, and its outcome described as a
:class:`~schemas.ToolResult`, whatever the tool did (a failure is a result, never an
exception). Counted in the pool's metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from schemas import ToolCallRequest, ToolResult, WireError

from . import metrics
from .context import ToolContext, calling
from .errors import ToolError, Unavailable, UnknownTool
from .mcp import McpServer
from .registry import Registry, Tool


class CallRunner:
    """Runs the calls of one pool's worker (``name``) on its registry's tools."""

    def __init__(
        self, registry: Registry, mcp: Mapping[str, McpServer], *, pool: str, name: str
    ) -> None:
        self.registry = registry
        self.mcp = mcp
        self.pool = pool
        self.name = name

    async def __call__(self, request: ToolCallRequest, *, attempt: int = 1) -> ToolResult:
        """Run one call and describe its outcome; never raises for a tool's failure.
        The tool sees the call's :class:`~tool_worker.context.ToolContext` (its
        idempotency key); ``attempt`` is the request's delivery count."""
        in_flight = metrics.IN_FLIGHT.labels(self.pool)
        in_flight.inc()
        context = ToolContext(
            call_id=request.call_id, tenant=request.tenant, session=request.session,
            turn_id=request.turn_id, iteration=request.iteration, attempt=attempt,
        )  # fmt: skip
        try:
            with calling(context):
                result = await self._execute(request)
        finally:
            in_flight.dec()
        labels = (request.tool, request.server, self.pool)
        metrics.CALLS.labels(*labels, result.status).inc()
        metrics.DURATION.labels(*labels).observe(result.duration_ms / 1000)
        return result

    async def _execute(self, request: ToolCallRequest) -> ToolResult:
        started = time.perf_counter()
        timeout: float | None = None
        status: Any = "ok"
        content = ""
        error = None
        try:
            tool = self._lookup(request.server, request.tool)
            tool.validate(request.arguments)
            timeout = request.timeout_s if request.timeout_s else tool.timeout_s
            async with asyncio.timeout(timeout):
                content = await tool.invoke(request.arguments)
        except TimeoutError:
            status = "timeout"
            error = WireError(
                code="timeout",
                message=f"{request.server}.{request.tool} did not finish within {timeout:g}s",
            )
        except ToolError as exc:
            status, error = "error", WireError(code=exc.code, message=exc.message)
        except Exception as exc:
            status = "error"
            error = WireError(code="tool_exception", message=f"{type(exc).__name__}: {exc}")
        return ToolResult(
            call_id=request.call_id,
            status=status,
            content=content,
            error=error,
            server=request.server,
            tool=request.tool,
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
            worker=self.name,
            finished_at=time.time(),
        )

    def _lookup(self, server: str, name: str) -> Tool:
        try:
            return self.registry.get(server, name)
        except UnknownTool:
            mcp = self.mcp.get(server)
            if mcp is not None and not mcp.listed:
                raise Unavailable(server, "it has not listed its tools yet") from None
            raise

    def _timeout_of(self, request: ToolCallRequest) -> float:
        try:
            return self.registry.get(request.server, request.tool).timeout_s
        except ToolError:
            return 0.0

    def timeout_of(self, request: ToolCallRequest) -> float:
        """The timeout a call of this request's tool gets by default (0: unknown tool)."""
        try:
            return self.registry.get(request.server, request.tool).timeout_s
        except ToolError:
            return 0.0
