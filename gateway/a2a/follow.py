"""A turn's events from the events stream, after a sequence: as they come
(:func:`live_events`, an ordered consumer of its own, for a turn that runs) or as the
stream holds them now (:func:`stored_events`, for a fold at read time). Both end with
the turn's ``loop_end``; events of other turns of the session are skipped, and so are
bytes that are no event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from nats.aio.msg import Msg
from nats.js import api as js_api

from loopmesh.aio import quietly
from loopmesh.jetstream import ordered_subscribe
from schemas import DecodeError
from schemas.events import Event, LoopEnd, decode_event

from ..backend import Backend


def _of_turn(msg: Msg, turn: str) -> tuple[int, Event] | None:
    """(sequence, event) of ``msg`` if it is an event of ``turn``."""
    try:
        event = decode_event(msg.data)
    except DecodeError:
        return None
    return (msg.metadata.sequence.stream, event) if event.turn_id == turn else None


async def live_events(
    backend: Backend, tenant: str, session: str, turn: str, after: int
) -> AsyncGenerator[tuple[int, Event]]:
    """``turn``'s events after sequence ``after``, as they come, to its ``loop_end``.
    Close it (``contextlib.aclosing``) to stop early: its consumer goes at once."""
    arrived: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        arrived.put_nowait(msg)

    sub = await backend._call(
        "follow a turn's events",
        ordered_subscribe(
            backend.nc,
            backend.subjects.session_events(tenant, session),
            js=backend.js,
            stream=backend.subjects.events_stream_of(tenant, session),
            cb=on_msg,
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            config=js_api.ConsumerConfig(opt_start_seq=after + 1),
        ),
    )
    try:
        while True:
            found = _of_turn(await arrived.get(), turn)
            if found is not None:
                yield found
                if isinstance(found[1], LoopEnd):
                    return
    finally:
        await quietly(sub.unsubscribe())


async def stored_events(
    backend: Backend, tenant: str, session: str, turn: str, after: int
) -> AsyncGenerator[tuple[int, Event]]:
    """``turn``'s events after sequence ``after`` that the stream holds now, to its
    ``loop_end`` if that is among them."""
    subjects = backend.subjects
    batches = backend.stored_events(
        subjects.events_stream_of(tenant, session),
        subjects.session_events(tenant, session),
        after + 1,
        "a task's events",
    )
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for found in filter(None, (_of_turn(msg, turn) for msg in batch)):
                yield found
                if isinstance(found[1], LoopEnd):
                    return
