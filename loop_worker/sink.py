"""Events to the events stream, without waiting on the loop's hot path.

:meth:`JetStreamEvents.emit` hands the event to the
:class:`~loop_worker.publisher.Publisher` and returns; the stream's acks arrive in the
background. :meth:`JetStreamEvents.flush` waits for every
ack of a turn and publishes again whatever was not acked (through a reconnect, say);
the service flushes before it acks the turn, so a turn is never done while one of its
events is not stored.

Every event carries a deterministic ``Nats-Msg-Id``, so the events of an iteration that
is replayed after a crash are deduplicated by the stream:

- ``tool_result`` / ``tool_error`` / ``tool_timeout``: ``tool_event_msg_id(call_id,
  type)``, the id the tool worker uses for the same event;
- ``loop_end``: ``<turn>:loop_end`` (one per turn, whoever emits it);
- a resumed ``loop_start``: ``<turn>:loop_start:r<delivery>``, so each resume shows;
- everything else: ``<turn>:<iteration>:<type>:<n>``, the n-th event of that type in
  that iteration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client

from schemas import Subjects, encode
from schemas.events import Event, LoopEnd, LoopStart, tool_event_msg_id

from .publisher import Publisher, acked
from .retry import retry

log = logging.getLogger("loopmesh.loop_worker.sink")

_TOOL_OUTCOMES = frozenset({"tool_result", "tool_error", "tool_timeout"})
_ACK_WAIT_S = 5.0  # how long flush waits for outstanding acks before publishing again


@dataclass(slots=True)
class _Pending:
    subject: str
    payload: bytes
    msg_id: str
    future: asyncio.Future[Any] | None = None


@dataclass(slots=True)
class _Turn:
    delivery: int = 1
    counters: dict[tuple[int, str], int] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)


class JetStreamEvents:
    """The :class:`~loop_worker.protocols.EventSink` of the durable service."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        timeout: float = 30.0,
        publisher: Publisher | None = None,
    ) -> None:
        self._publisher = publisher or Publisher(nc)
        self._subjects = subjects
        self._timeout = timeout
        self._turns: dict[str, _Turn] = {}
        self._muted: set[str] = set()

    def begin(self, turn_id: str, *, delivery: int = 1) -> None:
        """Start tracking a turn; ``delivery`` is its JetStream delivery count."""
        self._turns[turn_id] = _Turn(delivery=delivery)

    def end(self, turn_id: str) -> None:
        """Forget a turn (after :meth:`flush`)."""
        self._turns.pop(turn_id, None)
        self._muted.discard(turn_id)

    def mute(self, turn_id: str) -> None:
        """Drop the turn's events from now on (another worker runs it now)."""
        self._muted.add(turn_id)
        turn = self._turns.get(turn_id)
        if turn is not None:
            turn.pending.clear()

    def muted(self, turn_id: str) -> bool:
        return turn_id in self._muted

    def pending(self, turn_id: str) -> int:
        turn = self._turns.get(turn_id)
        return len(turn.pending) if turn else 0

    async def emit(self, event: Event) -> None:
        if event.turn_id in self._muted:
            return
        turn = self._turns.get(event.turn_id)
        if turn is None:
            turn = self._turns[event.turn_id] = _Turn()
        if not event.ts:
            event = _stamped(event)
        msg_id = self._msg_id(turn, event)
        item = _Pending(
            subject=self._subjects.event(event.tenant, event.session, event.type),
            payload=encode(event),
            msg_id=msg_id,
        )
        turn.pending[msg_id] = item
        try:
            future = await self._publisher.publish(
                item.subject, item.payload, {"Nats-Msg-Id": msg_id}
            )
        except Exception as exc:  # flush publishes it again
            log.debug("event publish deferred msg_id=%s error=%r", item.msg_id, exc)
            return
        item.future = future
        future.add_done_callback(lambda f: _acked(turn, item, f))

    async def flush(self, turn_id: str | None = None) -> None:
        """Wait until every event of ``turn_id`` (or of every turn) is stored."""
        ids = [turn_id] if turn_id is not None else list(self._turns)
        for tid in ids:
            turn = self._turns.get(tid)
            if turn is not None and turn.pending:
                await self._flush_turn(turn)

    async def _flush_turn(self, turn: _Turn) -> None:
        waiting = [p.future for p in turn.pending.values() if p.future is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=_ACK_WAIT_S)
        for item in list(turn.pending.values()):  # not acked: publish again, in order
            if _ok(item.future):
                continue
            if item.future is not None and not item.future.done():
                item.future.cancel()
            await retry(
                lambda item=item: acked(  # type: ignore[misc]
                    self._publisher, item.subject, item.payload, {"Nats-Msg-Id": item.msg_id}
                ),
                f"publish event {item.msg_id}",
                timeout=self._timeout,
            )
            turn.pending.pop(item.msg_id, None)

    def _msg_id(self, turn: _Turn, event: Event) -> str:
        kind = event.type
        if kind in _TOOL_OUTCOMES:
            return tool_event_msg_id(event.call_id, kind)  # type: ignore[attr-defined]
        if isinstance(event, LoopEnd):
            return f"{event.turn_id}:loop_end"
        if isinstance(event, LoopStart) and event.resumed:
            return f"{event.turn_id}:loop_start:r{turn.delivery}"
        key = (event.iteration, kind)
        n = turn.counters.get(key, 0)
        turn.counters[key] = n + 1
        return f"{event.turn_id}:{event.iteration}:{kind}:{n}"


def _ok(future: asyncio.Future[Any] | None) -> bool:
    return (
        future is not None
        and future.done()
        and not future.cancelled()
        and future.exception() is None
    )


def _acked(turn: _Turn, item: _Pending, future: asyncio.Future[Any]) -> None:
    if _ok(future):
        turn.pending.pop(item.msg_id, None)


def _stamped(event: Event) -> Event:
    return msgspec.structs.replace(event, ts=time.time())
