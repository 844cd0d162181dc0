"""Dead letters: turns given up on leave the turns stream for the dead-letter stream.

A turn is given up on in two ways:

- it is refused on delivery (:mod:`schemas.admit`; :mod:`.refusals` tells its session
  why): the worker records it here (:meth:`DeadLetters.refuse`) and terminates it (on a
  work queue, ``term`` removes it);
- it ran out of deliveries: the consumer's ``max_deliver`` stops redelivering it and
  nats-server publishes ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``.
  :meth:`DeadLetters.run` takes those advisories (one loop worker of the queue group
  each), fetches the message by its stream sequence, records it and deletes it from
  the work queue. A ``MSG_TERMINATED`` advisory is handled the same way when the
  message is still there (a term by another client on a stream that keeps it).

The record is the message's body unchanged, published to
``<prefix>.deadletter.<stream>`` with headers ``Loopmesh-Stream``, ``Loopmesh-Seq``,
``Loopmesh-Subject``, ``Loopmesh-Deliveries`` and ``Loopmesh-Reason`` (its
``Nats-Msg-Id`` is ``<stream>:<seq>``, so two workers record it once). A turn given up
on after its deliveries also gets an ``error`` event (code ``dead_letter``) and its
single ``loop_end`` (reason ``error``, the ``<tenant>.<session>.<turn>:loop_end`` id every
``loop_end`` of the turn has), so a client following it is not left waiting.
An advisory published while no loop worker listens is not seen: the message
then stays in the stream (``loopmesh`` reports it in the consumer's pending counts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from loopmesh.jetstream import Publisher, acked, quietly, retry
from schemas import InvalidIdError, Subjects, encode, is_token, turn_msg_id
from schemas.events import Error, LoopEnd

log = logging.getLogger("loopmesh.loop_worker.deadletter")

BURIED = Counter("loopmesh_loop_turns_dead_lettered", "Turns given up on", ["reason"])

QUEUE = "loopmesh-deadletter"


class _Advisory(msgspec.Struct, frozen=True):
    stream_seq: int
    deliveries: int = 0
    reason: str = ""


class _Ids(msgspec.Struct, frozen=True):  # what can be read of a turn that did not decode
    id: object = None


class DeadLetters:
    """Records turns given up on; :meth:`run` serves the advisories until cancelled."""

    def __init__(self, nc: Client, subjects: Subjects, *, publisher: Publisher) -> None:
        self.nc = nc
        self.subjects = subjects
        self.publisher = publisher
        self._js = nc.jetstream()
        stream, consumer = subjects.turns_stream, subjects.turns_consumer
        self.advisories = (
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}",
            f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream}.{consumer}",
        )

    async def run(self, ready: asyncio.Event | None = None) -> None:
        subs = [await self.nc.subscribe(s, queue=QUEUE) for s in self.advisories]
        if ready is not None:
            ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                for sub in subs:
                    tg.create_task(self._serve(sub.messages))
        finally:
            for sub in subs:
                await quietly(sub.unsubscribe())

    async def _serve(self, messages: AsyncIterator[Msg]) -> None:
        async for msg in messages:
            try:
                await self._on_advisory(msg)
            except Exception:
                log.exception("dead-letter advisory not handled subject=%s", msg.subject)

    async def _on_advisory(self, msg: Msg) -> None:
        advisory = msgspec.json.decode(msg.data, type=_Advisory)
        terminated = ".MSG_TERMINATED." in msg.subject
        stream = self.subjects.turns_stream
        try:
            stored = await self._js.get_msg(stream, advisory.stream_seq)
        except NotFoundError:
            return  # acked, terminated off a work queue, or recorded by another worker
        if terminated:
            reason = f"terminated: {advisory.reason or 'no reason given'}"
        else:
            reason = f"delivered {advisory.deliveries} times without finishing"
        await self.bury(
            stored.subject or "", stored.data or b"", advisory.stream_seq,
            deliveries=advisory.deliveries, reason=reason,
        )  # fmt: skip
        await retry(
            lambda: self._js.delete_msg(stream, advisory.stream_seq),
            f"delete dead-lettered turn {advisory.stream_seq}",
        )

    async def refuse(self, msg: Msg, reason: str, *, announce: bool = True) -> None:
        """Record a delivered turn that will never run, then terminate it; ``announce``:
        tell its session too (a refusal's events are :mod:`.refusals`' to publish)."""
        meta = msg.metadata
        await self.bury(
            msg.subject, msg.data, meta.sequence.stream,
            deliveries=meta.num_delivered, reason=reason, announce=announce,
        )  # fmt: skip
        await quietly(msg.term())

    async def bury(
        self,
        subject: str,
        data: bytes,
        seq: int,
        *,
        deliveries: int,
        reason: str,
        announce: bool = True,
    ) -> None:
        """The dead-letter record of turn ``seq``, and (``announce``) its session's
        ``error`` and ``loop_end`` events when its subject names one."""
        stream = self.subjects.turns_stream
        headers = {
            "Nats-Msg-Id": f"{stream}:{seq}",
            "Loopmesh-Stream": stream,
            "Loopmesh-Seq": str(seq),
            "Loopmesh-Subject": subject,
            "Loopmesh-Deliveries": str(deliveries),
            "Loopmesh-Reason": _one_line(reason),
        }
        where = self.subjects.deadletter(stream)
        await retry(lambda: acked(self.publisher, where, data, headers), f"dead-letter turn {seq}")
        log.error("turn dead-lettered seq=%d subject=%s reason=%s", seq, subject, reason)
        BURIED.labels("deliveries" if announce else "refused").inc()
        session = self._session(subject)
        if announce and session is not None:
            await self._announce(*session, _turn_id(data, seq), reason)

    def _session(self, subject: str) -> tuple[str, str] | None:
        try:
            return self.subjects.turn_session(subject)
        except InvalidIdError:
            return None

    async def _announce(self, tenant: str, session: str, turn_id: str, reason: str) -> None:
        now = time.time()
        message = f"the turn was given up on: {reason}"
        error = Error(
            tenant=tenant, session=session, turn_id=turn_id, code="dead_letter",
            message=message, fatal=True, ts=now,
        )  # fmt: skip
        end = LoopEnd(
            tenant=tenant, session=session, turn_id=turn_id, reason="error", error=message, ts=now
        )
        key = turn_msg_id(tenant, session, turn_id)
        await self._publish(error, f"{key}:dead_letter")
        await self._publish(end, f"{key}:loop_end")  # the id every loop_end of it has

    async def _publish(self, event: Error | LoopEnd, msg_id: str) -> None:
        subject = self.subjects.event(event.tenant, event.session, event.type)
        payload, headers = encode(event), {"Nats-Msg-Id": msg_id}
        await retry(lambda: acked(self.publisher, subject, payload, headers), f"publish {msg_id}")


def _turn_id(data: bytes, seq: int) -> str:
    """The turn's id if its body has a valid one, else ``seq-<stream sequence>``."""
    try:
        found = msgspec.json.decode(data, type=_Ids).id
    except (msgspec.DecodeError, msgspec.ValidationError):
        found = None
    return found if isinstance(found, str) and is_token(found) else f"seq-{seq}"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:512]
