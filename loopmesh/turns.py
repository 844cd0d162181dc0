"""Sending a turn and following its session's events: what every client of the turns
stream does (``loopmesh run``, the NATS Agent Protocol's host, tests).

:func:`publish_turn` publishes a :class:`~schemas.Turn` with its ``Nats-Msg-Id``;
:class:`Follower` is an ordered consumer on one session's events. Open the follower
first, then publish: it starts at the stream's end, so nothing of the turn is missed::

    async with Follower(nc, subjects, turn.tenant, turn.session) as events:
        await publish_turn(nc.jetstream(), subjects, turn)
        async for event in events:
            ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api

from schemas import DecodeError, Subjects, Turn, encode
from schemas.events import Event, decode_event

from .aio import quietly
from .jetstream import ordered_subscribe


async def publish_turn(js: JetStreamContext, subjects: Subjects, turn: Turn) -> js_api.PubAck:
    """Publish ``turn`` to its session's subject (its lane's: :attr:`Turn.priority`); the
    stream's ack. Its ``Nats-Msg-Id`` is
    ``<tenant>.<session>.<id>`` (:attr:`Turn.msg_id`): publishing it twice is
    deduplicated (``ack.duplicate``), another tenant's or session's turn of the same id
    is not, and a worker refuses a turn published under another id."""
    return await js.publish(
        subjects.turn(turn.tenant, turn.session, turn.priority),
        encode(turn),
        headers={"Nats-Msg-Id": turn.msg_id},
    )


class Follower:
    """An ordered consumer on one session's events: ``async with Follower(...) as f``,
    then publish, then ``async for event in f``."""

    def __init__(
        self, nc: Client, subjects: Subjects, tenant: str, session: str, *, start_seq: int = 0
    ) -> None:
        self._nc = nc
        self._subject = subjects.session_events(tenant, session)
        self._stream = subjects.events_stream_of(tenant, session)  # its partition's
        self._start_seq = start_seq
        self._sub: JetStreamContext.PushSubscription | None = None

    async def __aenter__(self) -> Follower:
        kwargs: dict[str, Any] = {"deliver_policy": js_api.DeliverPolicy.NEW}
        if self._start_seq:
            kwargs = {
                "deliver_policy": js_api.DeliverPolicy.BY_START_SEQUENCE,
                "config": js_api.ConsumerConfig(opt_start_seq=self._start_seq),
            }
        self._sub = await ordered_subscribe(self._nc, self._subject, stream=self._stream, **kwargs)
        return self

    async def __aexit__(self, *exc: object) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await quietly(sub.unsubscribe())

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        assert self._sub is not None
        while True:
            msg = await self._sub.next_msg(timeout=None)
            try:
                yield decode_event(msg.data)
            except DecodeError:
                continue  # not an event at all (newer ones decode to a generic form)
