"""One running turn's scope: who it is (for events), and how it is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from schemas import Turn
from schemas.events import EndReason, Event

from .budget import Meter
from .control import Interruption, TurnControl
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


class TurnDeadline(Exception):
    """Raised inside the engine when the turn's wall-clock deadline passes."""


class TurnInterrupted(Exception):
    """Raised inside the engine at a safe point once a later turn of the session
    interrupted this one (see :class:`~loop_worker.engine.control.Interruption`)."""

    def __init__(self, interruption: Interruption) -> None:
        super().__init__(f"interrupted by turn {interruption.by}")
        self.interruption = interruption


class TurnScope:
    def __init__(
        self, turn: Turn, control: TurnControl, sink: EventSink, clock: Callable[[], float]
    ) -> None:
        self.turn = turn
        self.control = control
        self.sink = sink
        self.clock = clock
        self.iteration = 0
        self.deadline: float | None = None  # on ``clock``'s scale; None: none
        self.meter: Meter | None = None  # the turn's spend (set by its run)

    def _remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()

    def make(self, cls: type[E], **fields: Any) -> E:
        """A ``cls`` event stamped with the turn, the iteration and the time."""
        return cls(
            tenant=self.turn.tenant,
            session=self.turn.session,
            turn_id=self.turn.id,
            iteration=self.iteration,
            ts=self.clock(),
            parent=self.turn.parent,
            **fields,
        )

    async def emit(self, cls: type[E], **fields: Any) -> E:
        """Emit a :meth:`make` event."""
        event = self.make(cls, **fields)
        await self.sink.emit(event)
        return event

    async def emit_text(self, cls: type[Event], text: str) -> None:
        """Emit a delta event, split into pieces of at most :data:`MAX_EVENT_TEXT`."""
        for start in range(0, len(text), MAX_EVENT_TEXT):
            await self.emit(cls, text=text[start : start + MAX_EVENT_TEXT])

    def check(self, *, interruptible: bool = True) -> None:
        if self.control.cancelled.is_set():
            raise TurnCancelled(self.control.cancel_reason)
        if interruptible and self.control.interruption is not None:
            raise TurnInterrupted(self.control.interruption)
        remaining = self._remaining()
        if remaining is not None and remaining <= 0:
            raise TurnDeadline()

    async def race(self, aw: Awaitable[T], *, interruptible: bool = True) -> T:
        """Await ``aw`` unless the turn is cancelled first; then cancel it and raise
        :class:`TurnCancelled` (or :class:`TurnDeadline` when the deadline passes first,
        or :class:`TurnInterrupted` when a later turn interrupts this one, unless
        ``interruptible`` is false: tool calls run to their record).

        ``aw`` runs in the calling task, as under ``asyncio.timeout``: a cancel of the
        turn cancels the task where it waits, and the cancellation is taken back here
        (``uncancel``) and becomes :class:`TurnCancelled`. A cancel of the task from
        elsewhere still propagates. No task is made per call."""
        control = self.control
        try:
            if control.cancelled.is_set():
                raise TurnCancelled(control.cancel_reason)
            if interruptible and control.interruption is not None:
                raise TurnInterrupted(control.interruption)
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                raise TurnDeadline()
        except (TurnCancelled, TurnDeadline, TurnInterrupted):
            _discard(aw)
            raise
        task = asyncio.current_task()
        assert task is not None, "race() runs inside a task"
        fired: Exception | None = None

        def interrupt(why: Exception) -> None:
            nonlocal fired
            if fired is None:
                fired = why
                task.cancel()

        def on_cancel() -> None:
            interrupt(TurnCancelled(control.cancel_reason))

        def on_interrupt() -> None:
            if control.interruption is not None:
                interrupt(TurnInterrupted(control.interruption))

        remaining = self._remaining()
        timer = (
            None
            if remaining is None
            else asyncio.get_running_loop().call_later(remaining, interrupt, TurnDeadline())
        )
        control.watch(on_cancel)
        if interruptible:
            control.watch_interrupt(on_interrupt)
        try:
            result = await aw
        except asyncio.CancelledError:
            if fired is not None and task.uncancel() == 0:
                raise fired from None
            raise
        finally:
            control.unwatch(on_cancel)
            control.unwatch_interrupt(on_interrupt)
            if timer is not None:
                timer.cancel()
        if fired is not None:  # the cancel reached ``aw``, which swallowed it
            task.uncancel()
            raise fired
        return result


def _discard(aw: Awaitable[Any]) -> None:
    """Drop an awaitable that will not be awaited (without a never-awaited warning)."""
    if asyncio.iscoroutine(aw):
        aw.close()
    elif isinstance(aw, asyncio.Future):
        aw.cancel()
