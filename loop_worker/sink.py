"""Events to the events stream, without waiting on the loop's hot path.

:meth:`JetStreamEvents.emit` publishes the event and returns. Most events go out as
plain publishes (no reply subject, so no ack to receive and decode); every
``barrier_every``-th event of a turn, and one that would take the turn's unacked bytes
past ``UNACKED_BYTES``, go out with an ack. The server handles the messages of one
connection in order, and the events stream stores them in that order, so the ack of a
barrier means every event published before it on the same connection was stored too,
provided the client did not reconnect in between (its reconnect count is compared).
Events a barrier cannot vouch for (a reconnect, a failed publish) stay pending. That
holds on one server only: on a cluster the stream's leader can change while the client
stays connected to its node, and the plain publishes that went to the old leader are
lost without a word while a later barrier is acked by the new one. So on a replicated
events stream (:meth:`JetStreamEvents.start` looks) every event asks for its ack, and
each is vouched for by its own (docs/ARCHITECTURE.md, "On a cluster").
:meth:`JetStreamEvents.flush` waits for the acks and publishes again, with acks,
whatever is still pending; the service flushes before it acks the turn, so a turn is
never done while one of its events is not stored.

A turn's ``loop_end`` waits for :meth:`JetStreamEvents.flush`, which the service calls
after the turn's last checkpoint is stored. So a ``loop_end`` in the stream means the
session's snapshot has the turn ended: a worker that dies between the two leaves a
``loop_end``-less turn that the next delivery resumes from its checkpoint, never a
resumed run of a turn its readers saw end. Flush stores it after every other event of
the turn (in order on one server, it is their barrier; else it goes out once they are
stored), so a reader that stops at a turn's ``loop_end`` has seen every event its
worker emitted before it.

Streamed text is coalesced (``stream_flush_ms``): a token is not a stored message. A
``content_delta`` or ``thinking_delta`` goes out at once when it is the first since the
turn's last other event, or since its last delta went out more than ``stream_flush_ms``
ago; otherwise it is held, joined to the deltas after it (same type, same iteration),
and goes out as one delta when that time is up (:meth:`JetStreamEvents.run`, one loop
for every turn) or at once before the turn's next other event (a tool call, a retract,
``llm_response``, ``loop_end``): the stream keeps every event type and the order, and
the text a reader joins is the model's, byte for byte.

An event larger than one NATS message (``nc.max_payload``) is cut to fit, after a
``payload_truncated`` event that says so (:mod:`loopmesh.payload`); one with no long
text to cut is replaced by an ``error`` event (code ``payload_too_large``).

Every event carries a deterministic ``Nats-Msg-Id``, so the events of an iteration that
is replayed after a crash are deduplicated by the stream. ``<turn>`` is the turn's
``<tenant>.<session>.<id>`` (:attr:`schemas.Turn.msg_id`), so two tenants' (or
sessions') turns of the same id never share one; it is also the key by which this sink
tracks a turn (:meth:`JetStreamEvents.begin` and the rest take it):

- ``tool_result`` / ``tool_error`` / ``tool_timeout``: ``tool_event_msg_id(call_id,
  type)``, the id the tool worker uses for the same event (call ids are scoped too);
- ``loop_end``: ``<turn>:loop_end`` (one per turn, whoever emits it);
- a resumed ``loop_start``: ``<turn>:loop_start:r<delivery>``, so each resume shows;
- everything else: ``<turn>:<iteration>:<type>:<n>``, the n-th event of that type in
  that iteration.

**Fenced.** An event goes to the client only while the connection is up and, given a
``writable`` check (the loop worker's: its turn's lease has not lapsed by the worker's own
clock), while its turn may still write. Otherwise it stays pending, unpublished: nats-py
keeps what is published while it reconnects and sends it once back, which could be long
after the lease lapsed and another worker ended the turn. A flush of a turn that may no
longer write raises :class:`~loop_worker.errors.LeaseLostError` instead of publishing
its pending events again.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client

from loopmesh.aio import raise_if_cancelled
from loopmesh.jetstream import Publisher, acked, replicated, retry
from loopmesh.payload import DoesNotFit, fit, limit_of
from schemas import Subjects, encode, turn_msg_id
from schemas.events import Error, Event, PayloadTruncated, tool_event_msg_id
from schemas.ids import check_turn_msg_id

from .errors import LeaseLostError

log = logging.getLogger("loopmesh.loop_worker.sink")

_TOOL_OUTCOMES = frozenset({"tool_result", "tool_error", "tool_timeout"})
_DELTAS = frozenset({"content_delta", "thinking_delta"})
HELD_TEXT = 16_384  # characters of streamed text held at most before it goes out
_ACK_WAIT_S = 5.0  # how long flush waits for outstanding acks before publishing again
BARRIER_EVERY = 64  # events published without an ack before one is published with one
UNACKED_BYTES = 64 * 1024  # nor more bytes than this (a larger event has its own ack)


@dataclass(slots=True)
class _Pending:
    subject: str
    payload: bytes
    msg_id: str
    future: asyncio.Future[Any] | None = None


@dataclass(slots=True, eq=False)
class _Barrier:
    """An event published with an ack, vouching for the events published before it."""

    item: _Pending
    covers: list[_Pending]
    reconnects: int  # the client's reconnect count when the first of ``covers`` went out


@dataclass(slots=True, eq=False)
class _Held:
    """Deltas of one type and iteration held back, to go out as one."""

    key: str
    first: Any  # the first held delta (a ContentDelta or ThinkingDelta): its fields
    parts: list[str]
    chars: int

    def joins(self, event: Any) -> bool:
        """Whether the delta ``event`` may join this text."""
        return (
            event.type == self.first.type
            and event.iteration == self.first.iteration
            and self.chars + len(event.text) <= HELD_TEXT
        )

    def joined(self) -> Event:
        text = "".join(self.parts)
        return msgspec.structs.replace(self.first, text=text)


@dataclass(slots=True)
class _Turn:
    delivery: int = 1
    counters: dict[tuple[int, str], int] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)
    unacked: list[_Pending] = field(default_factory=list)  # since the last barrier
    unacked_bytes: int = 0
    reconnects: int = 0  # when the first of ``unacked`` was published
    barriers: list[_Barrier] = field(default_factory=list)  # not settled yet
    subjects: dict[str, str] = field(default_factory=dict)  # by event type
    deferred: bool = False  # a publish failed: flush publishes it again
    first_reconnects: int = -1  # the client's reconnect count at the turn's first event
    held_end: _Pending | None = None  # a loop_end published by flush, after the rest
    where: tuple[str, str] = ("", "")  # the tenant and session ``subjects`` are for
    held: _Held | None = None  # streamed text waiting to go out (coalesced)
    delta_at: float = 0.0  # when the turn's last delta went out (0: none since another)


class JetStreamEvents:
    """The :class:`~loop_worker.engine.protocols.EventSink` of the durable service."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        timeout: float = 30.0,
        publisher: Publisher | None = None,
        barrier_every: int = BARRIER_EVERY,
        flush_ms: int = 0,
        writable: Callable[[str], bool] | None = None,
    ) -> None:
        self._nc = nc
        self._writable = writable  # whether a turn (its key) may still write
        self._flush_s = flush_ms / 1000
        self._due: list[tuple[float, int, _Held]] = []  # held text by when it goes out
        self._dues = 0  # a tie-breaker for the heap
        self._wake = asyncio.Event()
        self._publisher = publisher or Publisher(nc)
        self._subjects = subjects
        self._timeout = timeout
        self._barrier_every = max(1, barrier_every)
        self._turns: dict[str, _Turn] = {}
        self._muted: set[str] = set()

    async def start(self) -> None:
        """Look at the events streams (one per partition): if one is replicated, every
        event is acked (provisioning gives them all the same replicas)."""
        js = self._nc.jetstream()
        for stream in self._subjects.events_streams:
            info = await retry(lambda at=stream: js.stream_info(at), f"{stream} info")  # type: ignore[misc]
            if replicated(info):
                self._barrier_every = 1
                return

    @property
    def acks_each(self) -> bool:
        """Whether every event is published with an ack (a replicated stream)."""
        return self._barrier_every == 1

    def begin(self, key: str, *, delivery: int = 1) -> None:
        """Start tracking the turn ``key`` (its ``Turn.msg_id``); ``delivery`` is its
        JetStream delivery count."""
        self._turns[check_turn_msg_id(key)] = _Turn(delivery=delivery)

    def end(self, key: str) -> None:
        """Forget a turn (after :meth:`flush`)."""
        self._turns.pop(key, None)
        self._muted.discard(key)

    def mute(self, key: str) -> None:
        """Drop the turn's events from now on (another worker runs it now)."""
        self._muted.add(key)
        turn = self._turns.get(key)
        if turn is not None:
            turn.held = None
            turn.pending.clear()
            turn.unacked.clear()
            turn.unacked_bytes = 0
            turn.barriers.clear()
            turn.held_end = None

    def muted(self, key: str) -> bool:
        return key in self._muted

    def pending(self, key: str) -> int:
        turn = self._turns.get(key)
        return len(turn.pending) if turn else 0

    async def emit(self, event: Event) -> None:
        key = turn_msg_id(event.tenant, event.session, event.turn_id)
        if key in self._muted:
            return
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = _Turn()
        if not event.ts:
            event = _stamped(event)
        if self._flush_s:
            delta = event.type in _DELTAS
            if turn.held is not None and not (delta and turn.held.joins(event)):
                await self._release(turn)  # what was held goes first
            if not delta:
                turn.delta_at = 0.0  # the next delta is a new reply's (or part's) first
            elif self._hold(turn, key, event):
                return
        await self._publish(turn, key, event)

    def _hold(self, turn: _Turn, key: str, event: Any) -> bool:
        """Hold the delta ``event`` back if one went out less than ``stream_flush_ms``
        ago; whether it was held. Held deltas of the same type and iteration join."""
        held = turn.held
        if held is not None:  # it joins (``emit`` released it otherwise)
            held.parts.append(event.text)
            held.chars += len(event.text)
            return True
        now = time.monotonic()
        if now - turn.delta_at >= self._flush_s:
            turn.delta_at = now  # a first delta, or the last went out long enough ago
            return False
        turn.held = held = _Held(key, event, [event.text], len(event.text))
        self._dues += 1
        heapq.heappush(self._due, (turn.delta_at + self._flush_s, self._dues, held))
        self._wake.set()
        return True

    async def _release(self, turn: _Turn) -> None:
        """Publish the turn's held text now."""
        held, turn.held = turn.held, None
        if held is not None:
            turn.delta_at = time.monotonic()
            await self._publish(turn, held.key, held.joined())

    async def run(self) -> None:
        """Publish held text once its time is up, for every turn (until cancelled)."""
        while True:
            if not self._due:
                self._wake.clear()
                await self._wake.wait()
                continue
            due, _, held = self._due[0]
            wait = due - time.monotonic()
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()  # something due earlier may come
                continue
            heapq.heappop(self._due)
            turn = self._turns.get(held.key)
            if turn is not None and turn.held is held and held.key not in self._muted:
                try:
                    await self._release(turn)
                except Exception as exc:  # the turn's flush publishes it again
                    log.debug("held text not published key=%s error=%r", held.key, exc)
            raise_if_cancelled()

    async def _publish(self, turn: _Turn, key: str, event: Event) -> None:
        payload = encode(event)
        if len(payload) > (limit := limit_of(self._nc)):
            event, payload = await self._cut(event, limit)
        kind = event.type
        msg_id = self._msg_id(turn, key, event, kind)
        subject = turn.subjects.get(kind)
        if subject is None or turn.where != (event.tenant, event.session):
            turn.where = (event.tenant, event.session)
            subject = turn.subjects[kind] = self._subjects.event(event.tenant, event.session, kind)
        if turn.first_reconnects < 0:
            turn.first_reconnects = self._reconnects()
        item = _Pending(subject, payload, msg_id)
        if kind == "loop_end":  # stored by flush, which comes after the last checkpoint
            turn.pending[msg_id] = turn.held_end = item
            return
        turn.pending[msg_id] = item
        if (
            len(turn.unacked) + 1 >= self._barrier_every
            or turn.unacked_bytes + len(item.payload) > UNACKED_BYTES
        ):
            await self._barrier(turn, key, item)
            return
        if not self._sendable(key):
            turn.deferred = True  # flush publishes it, if the turn may still write
            return
        reconnects = self._nc.stats["reconnects"]
        try:
            await self._nc.publish(subject, item.payload, headers={"Nats-Msg-Id": msg_id})
        except Exception as exc:  # flush publishes it again
            log.debug("event publish deferred msg_id=%s error=%r", msg_id, exc)
            turn.deferred = True
            return
        if not turn.unacked:
            turn.reconnects = reconnects
        turn.unacked.append(item)
        turn.unacked_bytes += len(item.payload)

    async def _cut(self, event: Event, limit: int) -> tuple[Event, bytes]:
        """``event`` cut to fit in one message, after a ``payload_truncated`` event
        saying so (before it: a reader stops at ``loop_end``)."""
        max_payload = self._nc.max_payload
        try:
            fitted = fit(event, limit)
        except DoesNotFit as exc:  # no long text in it: say what was lost instead
            log.error("%s event dropped: %s turn=%s", event.type, exc, event.turn_id)
            error = Error(
                tenant=event.tenant, session=event.session, turn_id=event.turn_id,
                iteration=event.iteration, ts=event.ts, code="payload_too_large",
                message=f"a {event.type} event of {exc.size} bytes exceeds the NATS "
                f"max_payload ({max_payload}) and has no long text to cut",
            )  # fmt: skip
            return error, encode(error)
        log.warning(
            "%s event cut from %d to %d bytes (max_payload %d) turn=%s",
            event.type, fitted.size, len(fitted.data), max_payload, event.turn_id,
        )  # fmt: skip
        notice = PayloadTruncated(
            tenant=event.tenant, session=event.session, turn_id=event.turn_id,
            iteration=event.iteration, ts=event.ts, what=event.type,
            call_id=getattr(event, "call_id", ""), fields=fitted.cut, size=fitted.size,
            kept=len(fitted.data), max_payload=max_payload,
        )  # fmt: skip
        await self.emit(notice)
        return fitted.value, fitted.data

    async def _barrier(self, turn: _Turn, key: str, item: _Pending) -> None:
        """Publish ``item`` with an ack that vouches for the turn's unacked events."""
        barrier = _Barrier(item, turn.unacked, turn.reconnects)
        turn.unacked, turn.unacked_bytes = [], 0
        if not self._sendable(key):
            turn.deferred = True  # flush publishes them, if the turn may still write
            return
        try:
            future = await self._publisher.publish(
                item.subject, item.payload, {"Nats-Msg-Id": item.msg_id}
            )
        except Exception as exc:  # flush publishes them again
            log.debug("event publish deferred msg_id=%s error=%r", item.msg_id, exc)
            turn.deferred = True
            return
        item.future = future
        turn.barriers.append(barrier)
        future.add_done_callback(lambda f: self._settle(turn, barrier))

    def _settle(self, turn: _Turn, barrier: _Barrier) -> None:
        if barrier not in turn.barriers:
            return
        turn.barriers.remove(barrier)
        if not _ok(barrier.item.future):
            return  # its events stay pending: flush publishes them again
        turn.pending.pop(barrier.item.msg_id, None)
        if barrier.covers and self._reconnects() == barrier.reconnects:
            for item in barrier.covers:
                turn.pending.pop(item.msg_id, None)

    def _out_of_order(self, turn: _Turn) -> bool:
        """Whether an event of ``turn`` not stored yet could be stored after a
        ``loop_end`` published now: on a replicated stream any (a new leader stores
        what reaches it, what went to the old one is published again by a flush); on
        one server, one whose publish failed or went out before a reconnect."""
        if self.acks_each:
            return True
        return turn.deferred or self._reconnects() != turn.first_reconnects

    def _reconnects(self) -> int:
        return int(self._nc.stats["reconnects"])

    def _sendable(self, key: str) -> bool:
        """Whether an event of the turn ``key`` may go to the client now: connected
        (not into nats-py's reconnect buffer) and, by ``writable``, its turn's to write."""
        return self._nc.is_connected and (self._writable is None or self._writable(key))

    def _fence(self, key: str) -> None:
        """Raise :class:`LeaseLostError` if the turn ``key`` may no longer write."""
        if self._writable is not None and not self._writable(key):
            raise LeaseLostError(key, f"turn {key} may no longer write: its lease lapsed")

    async def _send(self, key: str, item: _Pending) -> object:
        """Publish ``item`` and wait for its ack, if the turn may still write and the
        client is connected (else a transient error: ``retry`` tries again)."""
        self._fence(key)
        if not self._nc.is_connected:
            raise nats.errors.ConnectionReconnectingError
        headers = {"Nats-Msg-Id": item.msg_id}
        return await acked(self._publisher, item.subject, item.payload, headers)

    async def flush(self, key: str | None = None, *, end: bool = True) -> None:
        """Wait until every event of the turn ``key`` (or of every turn) is stored; with
        ``end=False``, every one but its ``loop_end`` (before the turn's last checkpoint)."""
        keys = [check_turn_msg_id(key)] if key is not None else list(self._turns)
        for k in keys:
            turn = self._turns.get(k)
            if turn is not None and turn.held is not None:
                await self._release(turn)
            if turn is not None and turn.pending:
                await self._flush_turn(k, turn, end)

    async def _flush_turn(self, key: str, turn: _Turn, with_end: bool) -> None:
        self._fence(key)
        end = turn.held_end
        if end is None:
            await self._store_pending(key, turn)
            return
        if with_end and not self._out_of_order(turn):  # its ack vouches for the rest too
            turn.held_end = None
            await self._barrier(turn, key, end)
            await self._store_pending(key, turn)
            return
        del turn.pending[end.msg_id]
        try:
            await self._store_pending(key, turn)
        finally:
            turn.pending[end.msg_id] = end  # pending until stored
        if not with_end:
            return
        await retry(
            lambda: self._send(key, end), f"publish event {end.msg_id}", timeout=self._timeout
        )
        turn.pending.pop(end.msg_id, None)
        turn.held_end = None

    async def _store_pending(self, key: str, turn: _Turn) -> None:
        if turn.unacked:  # the last events have no barrier yet: publish the last again
            await self._barrier(turn, key, turn.unacked[-1])
        waiting = [p.future for p in turn.pending.values() if p.future is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=_ACK_WAIT_S)
        for barrier in [b for b in turn.barriers if b.item.future and b.item.future.done()]:
            self._settle(turn, barrier)
        for item in list(turn.pending.values()):  # not stored: publish again, in order
            if item.msg_id not in turn.pending:
                continue  # vouched for by a barrier that settled meanwhile
            if _ok(item.future):
                turn.pending.pop(item.msg_id, None)
                continue
            if item.future is not None and not item.future.done():
                item.future.cancel()
            await retry(
                lambda item=item: self._send(key, item),  # type: ignore[misc]
                f"publish event {item.msg_id}",
                timeout=self._timeout,
            )
            turn.pending.pop(item.msg_id, None)
        turn.deferred = False

    def _msg_id(self, turn: _Turn, key: str, event: Event, kind: str) -> str:
        if kind in _TOOL_OUTCOMES:
            return tool_event_msg_id(event.call_id, kind)  # type: ignore[attr-defined]
        if kind == "loop_end":
            return f"{key}:loop_end"
        if kind == "loop_start" and event.resumed:  # type: ignore[attr-defined]
            return f"{key}:loop_start:r{turn.delivery}"
        counter = (event.iteration, kind)
        n = turn.counters.get(counter, 0)
        turn.counters[counter] = n + 1
        return f"{key}:{event.iteration}:{kind}:{n}"


def _ok(future: asyncio.Future[Any] | None) -> bool:
    return (
        future is not None
        and future.done()
        and not future.cancelled()
        and future.exception() is None
    )


def _stamped(event: Event) -> Event:
    return msgspec.structs.replace(event, ts=time.time())
