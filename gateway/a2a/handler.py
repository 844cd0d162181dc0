"""The SDK's request handler (:class:`DefaultRequestHandlerV2`), with what loopmesh
checks before a message becomes a turn, and a cancel that reaches a turn this gateway
does not follow.

Before a message runs: its parts and context must make a turn
(:mod:`~gateway.a2a.messages`), the context's session must belong to the URL's agent
(a session belongs to one agent), and a message to an existing task must answer its
question: a task whose turn still runs takes none. Each refusal is the protocol's
``InvalidParamsError`` (or ``UnsupportedOperationError``), saying what to change.

A cancel of a task whose turn runs but that this gateway does not follow (another
gateway runs it, or the one that did went away) sends the turn's ``cancel`` control and
waits, as the executor does, for the turn's ``loop_end``; the task it returns is the
fold of that end. Every other cancel is the SDK's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable

from a2a.server.context import ServerCallContext
from a2a.server.events import Event as A2AEvent
from a2a.server.request_handlers import DefaultRequestHandlerV2, validate_request_params
from a2a.types import AgentCard, CancelTaskRequest, Message, SendMessageRequest, Task
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from schemas import Cancel

from ..backend import Backend
from ..settings import GatewaySettings
from .caller import caller_of
from .events import TurnEventStream
from .executor import TurnExecutor
from .follow import live_events
from .messages import session_of, turn_input
from .projection import RUNNING, TERMINAL, Projection, loopmesh_of
from .push import PushConfigStore, PushSender
from .store import TaskStore

#: How long the SDK keeps a task that asks for input in memory (its answer may come to
#: any gateway; the store has it).
PARKED_S = 60.0


class Handler(DefaultRequestHandlerV2):
    def __init__(
        self,
        backend: Backend,
        settings: GatewaySettings,
        card: AgentCard,
        push_store: PushConfigStore,
        push_sender: PushSender,
        on_turn: Callable[[], None] = lambda: None,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.executor = TurnExecutor(backend, settings, on_turn)
        self.store = TaskStore(backend, repair_after_s=settings.a2a_repair_after_s)
        super().__init__(
            agent_executor=self.executor,
            task_store=self.store,
            agent_card=card,
            push_config_store=push_store,
            push_sender=push_sender,
            push_url_validator=push_sender.check_url,
            event_stream=TurnEventStream(backend, self.store),
            interrupted_task_timeout=PARKED_S,
        )

    # -- messages ---------------------------------------------------------------------

    @validate_request_params
    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Message | Task:
        await self._check_message(params, context)
        return await super().on_message_send(params, context)

    @validate_request_params
    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[A2AEvent]:
        await self._check_message(params, context)
        async for event in super().on_message_send_stream(params, context):
            yield event

    async def _check_message(self, params: SendMessageRequest, context: ServerCallContext) -> None:
        caller = caller_of(context)
        message = params.message
        turn_input(message, self.settings.max_input_chars)
        if message.task_id:
            stored = await self.store.get(message.task_id, context)
            if stored is None:
                raise TaskNotFoundError(message=f"no task {message.task_id[:80]!r}")
            if stored.task.status.state in RUNNING:
                raise UnsupportedOperationError(
                    message=f"task {message.task_id} is still working: a message continues "
                    "a task only when it asks for input (input-required)"
                )
            context_id = message.context_id or stored.task.context_id
        else:
            context_id = message.context_id
        if not context_id:
            return  # a new context: the SDK names it, and its session is new
        session = session_of(context_id)
        snapshot = await self.backend.session(caller.tenant, session)
        if snapshot is not None and snapshot.agent != caller.agent:
            raise InvalidParamsError(
                message=f"context {context_id[:80]!r} belongs to agent {snapshot.agent!r}, "
                f"not {caller.agent!r}: send it to /a2a/{snapshot.agent}, or start a new "
                "context"
            )

    # -- cancel -----------------------------------------------------------------------

    @validate_request_params
    async def on_cancel_task(
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task | None:
        if params.id in self.executor.running:
            return await super().on_cancel_task(params, context)
        stored = await self.store.get(params.id, context)
        if stored is None:
            raise TaskNotFoundError
        if stored.task.status.state in TERMINAL:
            raise TaskNotCancelableError
        if stored.task.status.state not in RUNNING:
            return await super().on_cancel_task(params, context)  # no turn runs
        about = loopmesh_of(stored.task)
        tenant, session = caller_of(context).tenant, str(about.get("session"))
        projection = Projection(stored.task, int(about.get("seq", 0)))
        await self.backend.send_control(
            Cancel(
                tenant=tenant, session=session, turn_id=projection.turn, at=time.time(),
                reason="cancelled by the A2A client",
            )
        )  # fmt: skip
        events = live_events(self.backend, tenant, session, projection.turn, projection.seq)
        with contextlib.suppress(TimeoutError):
            async with (
                asyncio.timeout(self.settings.a2a_cancel_wait_s),
                contextlib.aclosing(events),
            ):
                async for _ in events:
                    pass
        after = await self.store.get(params.id, context)
        if after is not None and after.task.status.state not in RUNNING:
            return after.task
        return await super().on_cancel_task(params, context)  # the SDK records it
