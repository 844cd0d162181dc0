"""Agents that call agents, over NATS: a child turn through the turns stream.

When a turn's agent calls another agent as a tool (``agents.<name>``), the engine makes
the child turn (its id and session are the call's id, its ``parent`` the calling turn
and call: :meth:`~loop_worker.engine.tooling.ToolRunner._call_agent`) and
:class:`NatsAgentCalls` runs it like any turn: published to the turns stream, run by
whichever loop worker pulls it, its ``loop_end`` awaited here. The calling turn holds
its place meanwhile, as it does for a long tool call (in-progress acks and its lease
renewed by the worker's loops), so its conversation stays in this worker's memory.

The same guarantees as a tool call:

- The child's id derives from the call id, so a caller that resumes after a crash asks
  for the same child: its stored ``loop_end`` (a read of the child session's last one)
  answers at once, and a child still running is not published again (the turns
  stream's duplicate window drops a second copy under the same ``Nats-Msg-Id``, and one
  past it finds the first still queued or finished): it is waited for.
- A child that crashes resumes like any turn; its tool calls run once.
- A caller cancelled (not a worker stopping) cancels the child (a ``cancel`` control
  naming the child's turn, recorded for a child that has not started).
- The child's approval requests are relayed to the caller's session
  (``approval_required`` with ``call_session``), so a person watching the caller sees
  them; the decision goes to the child's session.

The ``loop_end`` is heard on a core subscription to the child session's ``loop_end``
subject, made before anything is asked; a reconnect could drop it, so the stored end is
read again every :data:`RECHECK_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg

from loopmesh.jetstream import Publisher, acked, quietly, retry
from schemas import Cancel, Subjects, Turn, encode
from schemas.events import ApprovalRequired, Event, LoopEnd, decode_event

from .controls import Controls
from .engine.protocols import Relay

log = logging.getLogger("loopmesh.loop_worker.agent_calls")

RECHECK_S = 5.0


class NatsAgentCalls:
    """:class:`~loop_worker.engine.protocols.AgentCalls` of the durable service."""

    def __init__(
        self, nc: Client, subjects: Subjects, publisher: Publisher, controls: Controls
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._publisher = publisher
        self._controls = controls
        self.waiting = 0  # callers waiting on a child now

    async def call(self, child: Turn, *, timeout_s: float, relay: Relay) -> LoopEnd:
        ended: asyncio.Future[LoopEnd] = asyncio.get_running_loop().create_future()

        async def on_end(msg: Msg) -> None:
            event = _decoded(msg)
            if isinstance(event, LoopEnd) and event.turn_id == child.id and not ended.done():
                ended.set_result(event)

        async def on_approval(msg: Msg) -> None:
            event = _decoded(msg)
            if isinstance(event, ApprovalRequired) and event.turn_id == child.id:
                await relay(event)

        deadline = time.monotonic() + timeout_s
        self.waiting += 1
        try:
            async with (
                self._subscribed(child, "loop_end", on_end),
                self._subscribed(child, "approval_required", on_approval),
            ):
                stored = await self._stored_end(child)
                if stored is not None:
                    return stored
                await self._relay_pending(child, relay)
                subject = self._subjects.turn(child.tenant, child.session, child.priority)
                headers = {"Nats-Msg-Id": child.msg_id}
                await retry(
                    lambda: acked(self._publisher, subject, encode(child), headers),
                    f"publish child turn {child.msg_id}",
                )
                log.info("called agent %s turn=%s", child.agent, child.msg_id)
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    with contextlib.suppress(TimeoutError):
                        return await asyncio.wait_for(
                            asyncio.shield(ended), min(remaining, RECHECK_S)
                        )
                    stored = await self._stored_end(child)  # a reconnect may have lost it
                    if stored is not None:
                        return stored
        finally:
            self.waiting -= 1

    async def cancel(self, child: Turn, reason: str) -> None:
        control = Cancel(
            tenant=child.tenant, session=child.session, turn_id=child.id, reason=reason
        )
        try:
            await self._controls.send(control)
        except Exception as exc:  # its deadline or a person stops it, then
            log.warning("child turn not cancelled turn=%s error=%r", child.msg_id, exc)

    @contextlib.asynccontextmanager
    async def _subscribed(
        self, child: Turn, kind: str, cb: Callable[[Msg], Awaitable[None]]
    ) -> AsyncIterator[None]:
        sub = await self._nc.subscribe(
            self._subjects.event(child.tenant, child.session, kind), cb=cb
        )
        try:
            yield
        finally:
            await quietly(sub.unsubscribe())

    async def _stored_end(self, child: Turn) -> LoopEnd | None:
        """The child's ``loop_end``, if one is stored (the child session's last)."""
        stored = await self._last(child, "loop_end")
        return stored if isinstance(stored, LoopEnd) else None

    async def _relay_pending(self, child: Turn, relay: Relay) -> None:
        """A caller resumed after a crash: the child's last approval request again."""
        stored = await self._last(child, "approval_required")
        if isinstance(stored, ApprovalRequired):
            await relay(stored)

    async def _last(self, child: Turn, kind: str) -> Event | None:
        subject = self._subjects.event(child.tenant, child.session, kind)
        stream = self._subjects.events_stream_of(child.tenant, child.session)
        msg = await retry(
            lambda: self._publisher.leader_get(stream, subject),
            f"read {subject}",
        )
        if msg is None:
            return None
        event = _decoded(msg)
        return event if event is not None and event.turn_id == child.id else None


def _decoded(msg: Msg) -> Event | None:
    try:
        return decode_event(msg.data)
    except Exception:
        return None
