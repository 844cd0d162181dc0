"""Dead letters: turns given up on leave the turns stream for the dead-letter stream.

A turn is given up on in two ways:

- it is refused on delivery (:mod:`schemas.admit`; :mod:`.refusals` tells its session
  why): the worker records it here (:meth:`DeadLetters.refuse`) and terminates it (on a
  work queue, ``term`` removes it);
- it ran out of deliveries: the consumer's ``max_deliver`` stops redelivering it and
  nats-server publishes ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``.
  The advisories stream (:attr:`schemas.Subjects.advisories_stream`, a work queue)
  keeps each advisory until a loop worker has handled it, so an advisory published
  while no loop worker runs is handled when one comes back. :meth:`DeadLetters.run`
  takes them through the stream's durable consumer (each advisory to one worker),
  fetches the turn by its stream sequence, records it, deletes it from the work queue
  and acks the advisory. A ``MSG_TERMINATED`` advisory is handled the same way when the
  message is still there (a term by another client on a stream that keeps it). loopmesh's
  own refusals are recorded and announced where they are refused, then acked, never
  termed, so no advisory brings them back.

The record is :func:`loopmesh.deadletter.record`'s: the message's body unchanged,
published to ``<prefix>.deadletter.<stream>`` with headers ``Loopmesh-Stream``,
``Loopmesh-Seq``, ``Loopmesh-Subject``, ``Loopmesh-Deliveries`` and ``Loopmesh-Reason``
(its ``Nats-Msg-Id`` is ``<stream>:<seq>``, so two workers record it once). A turn given up
on after its deliveries also gets an ``error`` event (code ``dead_letter``) and its
single ``loop_end`` (reason ``error``, the ``<tenant>.<session>.<turn>:loop_end`` id every
``loop_end`` of the turn has), so a client following it is not left waiting.
Without the advisories stream (a deployment not provisioned since it was added) the
worker falls back to a core subscription and says so: an advisory published while no
loop worker listens is then lost, and its turn stays in the turns stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from loopmesh.aio import raise_if_cancelled
from loopmesh.deadletter import record
from loopmesh.jetstream import Publisher, acked, answered, quietly, retry
from schemas import InvalidIdError, Subjects, encode, is_token, turn_msg_id
from schemas.events import Error, LoopEnd

log = logging.getLogger("loopmesh.loop_worker.deadletter")

BURIED = Counter("loopmesh_loop_turns_dead_lettered", "Turns given up on", ["reason"])

QUEUE = "loopmesh-deadletter"
_FETCH_S = 5.0  # a pull for advisories waits this long before asking again
_RETRY_S = 5.0  # an advisory whose handling failed is handed back for this long
_REFETCH_S = 1.0  # after a fetch the cluster refused (503 while electing, 409 at a restart)


class _Advisory(msgspec.Struct, frozen=True):
    stream_seq: int
    stream: str = ""
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
        self.advisories = subjects.turn_advisories

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Handle the advisories, from the advisories stream when there is one."""
        stream, durable = self.subjects.advisories_stream, self.subjects.advisories_consumer
        try:
            await retry(lambda: self._js.consumer_info(stream, durable), "advisories consumer")
        except NotFoundError:
            log.warning(
                "no consumer %s on stream %s (provision again): dead-letter advisories are "
                "seen only while a loop worker listens", durable, stream,
            )  # fmt: skip
            await self._listen(ready)
            return
        sub = await self._js.pull_subscribe_bind(durable, stream)
        if ready is not None:
            ready.set()
        try:
            while True:
                try:
                    msgs = await sub.fetch(16, timeout=_FETCH_S)
                except TimeoutError:
                    msgs = []
                except nats.errors.Error as exc:  # a leader change, a node restarting
                    log.warning("fetching dead-letter advisories failed error=%r", exc)
                    await asyncio.sleep(_REFETCH_S)
                    msgs = []
                raise_if_cancelled()
                for msg in msgs:
                    await self._take(msg)
        finally:
            await quietly(sub.unsubscribe())

    async def _take(self, msg: Msg) -> None:
        """Handle one stored advisory: ack it once handled, hand it back if that failed."""
        try:
            await self._on_advisory(msg)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("unreadable advisory on %s: %r", msg.subject, msg.data[:200])
            await quietly(msg.term())
        except Exception:
            log.exception("dead-letter advisory not handled subject=%s", msg.subject)
            await quietly(msg.nak(delay=_RETRY_S))
        else:
            await quietly(msg.ack())

    async def _listen(self, ready: asyncio.Event | None) -> None:
        """The fallback: a core subscription (advisories sent meanwhile are lost)."""
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
        stream = advisory.stream
        if stream not in self.subjects.turns_streams:
            log.warning("dead-letter advisory of no turns stream stream=%r", stream)
            return
        try:
            stored = await self._js.get_msg(stream, advisory.stream_seq)
        except NotFoundError:
            return  # acked, terminated off a work queue, or recorded by another worker
        if terminated:
            reason = f"terminated: {advisory.reason or 'no reason given'}"
        else:
            reason = f"delivered {advisory.deliveries} times without finishing"
        await self.bury(
            stored.subject or "", stored.data or b"", stream, advisory.stream_seq,
            deliveries=advisory.deliveries, reason=reason,
        )  # fmt: skip
        await retry(
            lambda: self._js.delete_msg(stream, advisory.stream_seq),
            f"delete dead-lettered turn {advisory.stream_seq}",
        )

    async def refuse(self, msg: Msg, reason: str, *, announce: bool = True) -> None:
        """Record a delivered turn that will never run, then ack it; ``announce``: tell
        its session too (a refusal's events are :mod:`.refusals`' to publish). Not a
        term: its ``MSG_TERMINATED`` advisory could reach a worker while a replicated
        stream still held the turn, and that worker would bury and announce it again."""
        meta = msg.metadata
        await self.bury(
            msg.subject, msg.data, meta.stream, meta.sequence.stream,
            deliveries=meta.num_delivered, reason=reason, announce=announce,
        )  # fmt: skip
        await retry(
            functools.partial(answered, self.publisher, msg.reply, b"+ACK"),
            f"ack dead-lettered turn {meta.sequence.stream}",
        )

    async def bury(
        self,
        subject: str,
        data: bytes,
        stream: str,
        seq: int,
        *,
        deliveries: int,
        reason: str,
        announce: bool = True,
    ) -> None:
        """The dead-letter record of turn ``seq`` of ``stream``, and (``announce``) its session's
        ``error`` and ``loop_end`` events when its subject names one."""
        await record(
            self.publisher, self.subjects, stream=stream, seq=seq,
            subject=subject, data=data, deliveries=deliveries, reason=reason,
        )  # fmt: skip
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
