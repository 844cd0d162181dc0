"""Where a turn stands in its session's order: the turns stream is a work queue, so a
turn still in it has not finished, and a session's turns run oldest first. A turn
leaves the stream when it is acked (or dead-lettered); the oldest still there of each
lane is one read of the stream by subject."""

from __future__ import annotations

import asyncio
import functools

from loopmesh.jetstream import Publisher, retry
from schemas import Subjects, Turn


def gone(first: int | None, seq: int) -> bool:
    """Whether the turn at stream sequence ``seq`` has left the turns stream, given
    ``first``, its session's oldest turn still there (a work queue: a turn leaves it
    once acked, or dead-lettered)."""
    return first is None or (first > seq > 0)


async def first_turn(publisher: Publisher, subjects: Subjects, turn: Turn) -> int | None:
    """The stream sequence of the oldest turn of ``turn``'s session still in the turns
    stream, of either lane, or ``None`` when none of ``turn``'s own lane is left (then
    ``turn`` is gone: an earlier turn of the other lane would have ended first)."""
    own, other = await first_turns(publisher, subjects, turn)
    return own if own is None or other is None else min(own, other)


async def first_turns(
    publisher: Publisher, subjects: Subjects, turn: Turn
) -> tuple[int | None, int | None]:
    """The stream sequences of the oldest turns of ``turn``'s session still in the turns
    stream: in ``turn``'s own lane, and in the other."""
    lanes = subjects.session_turns(turn.tenant, turn.session)  # its own lane first
    stream = subjects.turns_stream_of(turn.tenant)
    own, other = await asyncio.gather(
        *(
            retry(functools.partial(publisher.first_seq, stream, s), f"first turn of {s}")
            for s in (lanes[::-1] if turn.priority == "batch" else lanes)
        )
    )
    return own, other
