"""A session's backlog: its turns still in the turns stream, and which have not ended.

The turns stream is a work queue, so a turn leaves it once acked: a session's turns
still there are the ones running or waiting. One of them may have ended already, its
``loop_end`` stored while its ack is on its way (a client sends the next turn when it
sees ``loop_end``): a turn counts as unfinished only while the session's last stored
``loop_end`` is not its own or a later turn's (a session's turns run in order). What
``Turn.on_busy`` acts on, in the loop worker and the gateway::

    earlier = await unfinished(publisher, subjects, "acme", "s1", before=seq)

Both reads go to the streams' leaders (on a cluster a follower may be behind).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import get_args

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import Subjects
from schemas.types import Priority

from .publisher import Publisher
from .retry import retry


class _TurnId(msgspec.Struct):
    id: str = ""


class _EndOf(msgspec.Struct):
    turn_id: str = ""


_turn_id = msgspec.json.Decoder(_TurnId).decode
_end_of = msgspec.json.Decoder(_EndOf).decode


@dataclass(frozen=True)
class Queued:
    """A turn in the turns stream: its stream sequence and id."""

    seq: int
    turn_id: str


async def queued(
    publisher: Publisher, subjects: Subjects, tenant: str, session: str, *, before: int = 0
) -> list[Queued]:
    """The session's turns in the turns stream, of both lanes, oldest first (before
    sequence ``before``, when given)."""
    stream = subjects.turns_stream_of(tenant)
    lanes = [
        _lane(publisher, stream, subject, before)
        for subject in subjects.session_turns(tenant, session)
    ]
    interactive, batch = await asyncio.gather(*lanes)
    return sorted(interactive + batch, key=lambda q: q.seq)


async def _lane(publisher: Publisher, stream: str, subject: str, before: int) -> list[Queued]:
    out: list[Queued] = []
    seq = 1
    while True:
        found = await retry(
            lambda at=seq: publisher.next_msg(stream, subject, at),  # type: ignore[misc]
            f"turns of {subject}",
        )
        if found is None or (before and found[0] >= before):
            return out
        try:
            turn_id = _turn_id(found[1]).id
        except msgspec.DecodeError:
            turn_id = ""  # refused when it is pulled; it ends at once
        out.append(Queued(found[0], turn_id))
        seq = found[0] + 1


async def unfinished(
    publisher: Publisher, subjects: Subjects, tenant: str, session: str, *, before: int = 0
) -> list[Queued]:
    """The session's turns in the turns stream (before ``before``) that have not ended."""
    turns = await queued(publisher, subjects, tenant, session, before=before)
    if not turns:
        return []
    subject = subjects.event(tenant, session, "loop_end")
    stream = subjects.events_stream_of(tenant, session)
    last = await retry(lambda: publisher.leader_get(stream, subject), f"last end of {subject}")
    if last is None:
        return turns
    try:
        ended = _end_of(last.data).turn_id
    except msgspec.DecodeError:
        return turns
    ids = [t.turn_id for t in turns]
    return turns[ids.index(ended) + 1 :] if ended in ids else turns


async def turns_waiting(js: JetStreamContext, subjects: Subjects, tenant: str) -> int:
    """The tenant's turns no loop worker holds yet, of both lanes: each lane's
    consumer's count, or, before a worker made it, every turn of the lane in the stream
    (what ``[tenants] max_backlog`` limits)."""
    lanes = [_lane_waiting(js, subjects, tenant, p) for p in get_args(Priority)]
    return sum(await asyncio.gather(*lanes))


async def _lane_waiting(
    js: JetStreamContext, subjects: Subjects, tenant: str, priority: Priority
) -> int:
    stream = subjects.turns_stream_of(tenant)
    try:
        info = await js.consumer_info(stream, subjects.tenant_consumer(tenant, priority))
        return int(info.num_pending or 0)
    except NotFoundError:
        pass
    state = (await js.stream_info(stream, subjects.lane_turns(tenant, priority))).state
    return sum((state.subjects or {}).values())
