"""Cancel, pause, resume and approval decisions for one running turn.

The durable service feeds a :class:`TurnControl` from the control subject (and from the
control KV when a turn is redelivered); in one process, callers use its methods
directly. The engine only waits on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from schemas import ApprovalDecision


@dataclass(frozen=True)
class Interruption:
    """A later turn of the session interrupts this one (its ``on_busy``): it stops at
    its next safe point; with ``rollback`` the session returns to its snapshot from
    before this turn began."""

    by: str
    rollback: bool = False


class TurnControl:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.cancel_reason = ""
        self.interruption: Interruption | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._decisions: dict[str, ApprovalDecision] = {}
        self._waiting: set[asyncio.Event] = set()  # one per wait for a decision
        self._watchers: set[Callable[[], None]] = set()
        self._interrupt_watchers: set[Callable[[], None]] = set()

    # -- what controllers call ----------------------------------------------------

    def cancel(self, reason: str = "") -> None:
        """Cancel the turn; the first reason given is the one reported."""
        self._running.set()  # a paused loop must wake up to see the cancel
        if self.cancelled.is_set():
            return
        self.cancel_reason = reason or "cancelled"
        self.cancelled.set()
        for watcher in list(self._watchers):
            watcher()

    def interrupt(self, by: str, *, rollback: bool = False) -> None:
        """Stop the turn at its next safe point: before an LLM call, or during one, but
        never while its tool calls run (they finish and are recorded first); the first
        interruption is the one that holds. A pause is lifted: the turn must see it."""
        self._running.set()
        if self.interruption is not None or self.cancelled.is_set():
            return
        self.interruption = Interruption(by, rollback)
        self._wake()
        for watcher in list(self._interrupt_watchers):
            watcher()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def decide(self, decision: ApprovalDecision) -> None:
        self._decisions[decision.call_id] = decision
        self._wake()

    def _wake(self) -> None:
        for news in self._waiting:
            news.set()

    # -- what the engine calls ----------------------------------------------------

    def watch(self, on_cancel: Callable[[], None]) -> None:
        """Call ``on_cancel`` when the turn is cancelled (once), until :meth:`unwatch`."""
        self._watchers.add(on_cancel)

    def unwatch(self, on_cancel: Callable[[], None]) -> None:
        self._watchers.discard(on_cancel)

    def watch_interrupt(self, on_interrupt: Callable[[], None]) -> None:
        """Call ``on_interrupt`` when the turn is interrupted (once), until
        :meth:`unwatch_interrupt`."""
        self._interrupt_watchers.add(on_interrupt)

    def unwatch_interrupt(self, on_interrupt: Callable[[], None]) -> None:
        self._interrupt_watchers.discard(on_interrupt)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def wait_running(self) -> None:
        """Return when not paused (at once if running); a cancel also wakes it."""
        await self._running.wait()

    async def wait_decision(self, call_id: str, timeout: float) -> ApprovalDecision | None:
        """The decision for ``call_id``, or ``None`` when ``timeout`` passes first or the
        turn is interrupted meanwhile (waiting for a person is a safe point: the call
        has not run)."""
        news = asyncio.Event()
        self._waiting.add(news)
        try:
            async with asyncio.timeout(timeout):
                while call_id not in self._decisions and self.interruption is None:
                    await news.wait()
                    news.clear()
        except TimeoutError:
            return None
        finally:
            self._waiting.discard(news)
        return self._decisions.get(call_id)
