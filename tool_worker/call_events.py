"""The events a tool worker publishes for a call it ran: its outcome (``tool_result``,
``tool_error`` or ``tool_timeout``) and, when the result was cut to fit in one NATS
message, ``payload_truncated``.

Each goes to the session's event subject under the msg id
:func:`~schemas.events.tool_event_msg_id` gives it. The loop worker that awaited the
call publishes the same outcome under the same id, and JetStream keeps one: the tool
worker's copy only makes it visible sooner. So it is published without asking for
JetStream's acknowledgement unless ``confirm`` asks (then a failure is logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from nats.aio.client import Client

from loopmesh.jetstream import Publisher
from loopmesh.payload import Fitted, fit, limit_of
from schemas import Subjects, ToolCallRequest, ToolResult, WireError
from schemas.events import (
    Event,
    PayloadTruncated,
    ToolErrorEvent,
    ToolResultEvent,
    ToolTimeout,
    tool_event_msg_id,
)

log = logging.getLogger("tool_worker")


class CallEvents:
    """Publishes the events of the calls one tool worker runs. ``max_chars`` bounds a
    ``tool_result`` event's content (the effect record and the reply keep it whole)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        publisher: Publisher,
        *,
        max_chars: int,
        confirm: bool,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.publisher = publisher
        self.max_chars = max_chars
        self.confirm = confirm

    async def outcome(self, request: ToolCallRequest, result: ToolResult, timeout_s: float) -> None:
        """The call's outcome; ``timeout_s`` is what a ``tool_timeout`` reports."""
        common: dict[str, Any] = {
            "tenant": request.tenant,
            "session": request.session,
            "turn_id": request.turn_id,
            "iteration": request.iteration,
            "ts": result.finished_at or time.time(),
            "call_id": request.call_id,
            "server": request.server,
            "tool": request.tool,
        }
        event: Event
        if result.status == "ok":
            content = result.content
            truncated = len(content) > self.max_chars
            event = ToolResultEvent(
                **common,
                content=content[: self.max_chars] if truncated else content,
                truncated=truncated,
                duration_ms=result.duration_ms,
                worker=result.worker,
            )
        elif result.status == "timeout":
            event = ToolTimeout(**common, timeout_s=timeout_s)
        else:
            error = result.error or WireError(code="tool_exception", message="")
            event = ToolErrorEvent(
                **common, code=error.code, message=error.message, worker=result.worker
            )
        await self._publish(request, event)

    async def cut(self, request: ToolCallRequest, fitted: Fitted[ToolResult]) -> None:
        """Say that the call's result was cut to fit in one NATS message."""
        log.warning(
            "result of %s.%s cut from %d to %d bytes (max_payload %d) call_id=%s",
            request.server, request.tool, fitted.size, len(fitted.data),
            self.nc.max_payload, request.call_id,
        )  # fmt: skip
        event = PayloadTruncated(
            tenant=request.tenant, session=request.session, turn_id=request.turn_id,
            iteration=request.iteration, ts=time.time(), what="tool_result",
            call_id=request.call_id, fields=fitted.cut, size=fitted.size,
            kept=len(fitted.data), max_payload=self.nc.max_payload,
        )  # fmt: skip
        await self._publish(request, event)

    async def _publish(self, request: ToolCallRequest, event: Event) -> None:
        subject = self.subjects.event(request.tenant, request.session, event.type)
        headers = {"Nats-Msg-Id": tool_event_msg_id(request.call_id, event.type)}
        payload = fit(event, limit_of(self.nc)).data
        if self.confirm:
            future = await self.publisher.publish(subject, payload, headers)
            future.add_done_callback(_log_failed)
        else:
            await self.nc.publish(subject, payload, headers=headers)


def _log_failed(future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        return
    if (exc := future.exception()) is not None:
        log.warning("event not stored: %r", exc)
