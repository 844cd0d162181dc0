"""Cancel, pause, resume and approval decisions for one running turn.

The durable service feeds a :class:`TurnControl` from the control subject (and from the
control KV when a turn is redelivered); in one process, callers use its methods
directly. The engine only waits on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from schemas import ApprovalDecision


class TurnControl:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.cancel_reason = ""
        self._running = asyncio.Event()
        self._running.set()
        self._decisions: dict[str, ApprovalDecision] = {}
        self._decided_: asyncio.Condition | None = None  # made when approvals are used
        self._watchers: set[Callable[[], None]] = set()

    @property
    def _decided(self) -> asyncio.Condition:
        if self._decided_ is None:
            self._decided_ = asyncio.Condition()
        return self._decided_

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

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def decide(self, decision: ApprovalDecision) -> None:
        async with self._decided:
            self._decisions[decision.call_id] = decision
            self._decided.notify_all()

    # -- what the engine calls ----------------------------------------------------

    def watch(self, on_cancel: Callable[[], None]) -> None:
        """Call ``on_cancel`` when the turn is cancelled (once), until :meth:`unwatch`."""
        self._watchers.add(on_cancel)

    def unwatch(self, on_cancel: Callable[[], None]) -> None:
        self._watchers.discard(on_cancel)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def wait_running(self) -> None:
        """Return when not paused (at once if running); a cancel also wakes it."""
        await self._running.wait()

    async def wait_decision(self, call_id: str, timeout: float) -> ApprovalDecision | None:
        """The decision for ``call_id``, or ``None`` when ``timeout`` passes first."""
        async with self._decided:
            try:
                async with asyncio.timeout(timeout):
                    await self._decided.wait_for(lambda: call_id in self._decisions)
            except TimeoutError:
                return None
            return self._decisions[call_id]
