"""One running turn's scope: who it is (for events), and how it is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from schemas import Turn
from schemas.events import EndReason, Event

from .control import TurnControl
from .protocols import EventSink

E = TypeVar("E", bound=Event)
T = TypeVar("T")

#: Large deltas are split so no single event approaches NATS's payload limit.
MAX_EVENT_TEXT = 16_384


@dataclass
class End:
    """Why and how a turn ended (becomes its ``loop_end``)."""

    reason: EndReason
    content: str = ""
    error: str | None = None


class TurnCancelled(Exception):
    """Raised inside the engine when the turn's control is cancelled."""


class TurnScope:
    def __init__(
        self, turn: Turn, control: TurnControl, sink: EventSink, clock: Callable[[], float]
    ) -> None:
        self.turn = turn
        self.control = control
        self.sink = sink
        self.clock = clock
        self.iteration = 0

    async def emit(self, cls: type[E], **fields: Any) -> E:
        """Emit a ``cls`` event stamped with the turn, the iteration and the time."""
        event = cls(
            tenant=self.turn.tenant,
            session=self.turn.session,
            turn_id=self.turn.id,
            iteration=self.iteration,
            ts=self.clock(),
            **fields,
        )
        await self.sink.emit(event)
        return event

    async def emit_text(self, cls: type[Event], text: str) -> None:
        """Emit a delta event, split into pieces of at most :data:`MAX_EVENT_TEXT`."""
        for start in range(0, len(text), MAX_EVENT_TEXT):
            await self.emit(cls, text=text[start : start + MAX_EVENT_TEXT])

    def check(self) -> None:
        if self.control.cancelled.is_set():
            raise TurnCancelled(self.control.cancel_reason)

    async def race(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the turn is cancelled first; then cancel it and raise
        :class:`TurnCancelled`."""
        task = asyncio.ensure_future(aw)
        if self.control.cancelled.is_set():
            task.cancel()
        else:
            waiter = asyncio.ensure_future(self.control.cancelled.wait())
            try:
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                if not task.done():  # we were cancelled, or the turn was
                    task.cancel()
        if not task.done() or task.cancelled():
            await asyncio.wait((task,))  # let it unwind; its outcome no longer matters
            if not task.cancelled():
                task.exception()
            raise TurnCancelled(self.control.cancel_reason)
        return task.result()
