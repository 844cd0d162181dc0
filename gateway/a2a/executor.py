"""The SDK's agent executor: a message runs a turn of the URL's agent, in the session
of its context, and the turn's events become the task's updates.

A new task's turn id is the task id; a message that answers a task's question
(``input-required``) runs the next turn of the same session, with an id of its own, and
the task follows that turn. The turn goes through the turns stream like any other
(``Nats-Msg-Id``, so a retried publish runs it once), and the executor follows its
events from the sequence the stream had reached before it published, so it misses none;
the caller's W3C ``traceparent`` goes with the turn, as for ``POST .../turns``.
It returns at the turn's ``loop_end``, which leaves the task ended or asking for input.

A cancel (:meth:`TurnExecutor.cancel`) sends the turn's ``cancel`` control, as
``/v1/sessions/{session}/cancel`` does, and waits (``[gateway] a2a_cancel_wait_s``) for
the turn's ``loop_end``: the task ends ``canceled`` because the turn did.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.types import Task, TaskState, TaskStatus

from loopmesh import tracing
from schemas import Cancel, Turn, new_id

from ..backend import Backend
from ..settings import GatewaySettings
from .caller import caller_of
from .follow import live_events
from .messages import session_of, turn_input
from .projection import Projection, metadata, status_update


@dataclass(slots=True)
class Running:
    """A task whose turn this gateway follows."""

    tenant: str
    session: str
    turn: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class TurnExecutor(AgentExecutor):
    """``on_turn`` is called for each turn it publishes (the gateway counts them)."""

    def __init__(
        self,
        backend: Backend,
        settings: GatewaySettings,
        on_turn: Callable[[], None] = lambda: None,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.on_turn = on_turn
        self.running: dict[str, Running] = {}  # by task id

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        caller = caller_of(context.call_context)
        task_id, context_id = str(context.task_id), str(context.context_id)
        assert context.message is not None  # a send always carries one
        text, parts = turn_input(context.message, self.settings.max_input_chars)
        session = session_of(context_id)
        current = context.current_task
        turn_id = task_id if current is None else new_id()
        _, first = await self.backend.events_bounds(caller.tenant, session)
        about = {"session": session, "agent": caller.agent, "turn": turn_id, "seq": first}
        if current is None:
            task = Task(
                id=task_id,
                context_id=context_id,
                status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
                history=[context.message],
                metadata=metadata(about),
            )
            task.status.timestamp.GetCurrentTime()
            projection = Projection(task, first)
            await event_queue.enqueue_event(task)
        else:  # the answer to the task's question: its next turn
            projection = Projection(current, first)
            start = status_update(current, TaskState.TASK_STATE_WORKING, first, time.time())
            start.metadata.CopyFrom(metadata(about))
            await projection.apply(start)
            await event_queue.enqueue_event(start)
        await self.backend.create_session(caller.tenant, session, caller.agent)
        turn = Turn(
            id=turn_id, tenant=caller.tenant, session=session, input=text, parts=parts,
            created_at=time.time(), agent=caller.agent,
        )  # fmt: skip
        running = self.running[task_id] = Running(caller.tenant, session, turn_id)
        try:
            headers = context.call_context.state.get("headers", {})
            if not await self.backend.publish_turn(turn, tracing.forward(headers)):
                self.on_turn()
            events = live_events(self.backend, caller.tenant, session, turn_id, first)
            async with contextlib.aclosing(events):
                async for seq, event in events:
                    update = await projection.step(seq, event)
                    if update is not None:
                        await event_queue.enqueue_event(update)
        finally:
            running.ended.set()
            if self.running.get(task_id) is running:
                del self.running[task_id]

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        running = self.running.get(str(context.task_id))
        if running is None:
            return  # its turn has ended: the SDK records the task canceled
        await self.backend.send_control(
            Cancel(
                tenant=running.tenant, session=running.session, turn_id=running.turn,
                at=time.time(), reason="cancelled by the A2A client",
            )
        )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.a2a_cancel_wait_s):
                await running.ended.wait()
