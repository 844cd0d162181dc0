"""Fork and rewind on NATS, for the gateway and the client alike: the session's timeline
read from its events, the cut made by :mod:`loopmesh.history`, and the writes.

Both refuse (:class:`~loopmesh.errors.BranchRefused`, ``busy``) while a turn of the
session runs or waits in the turns stream: a cut is only defined between turns, and a
waiting turn was posted against the session as it is. A rewind rewrites the session's
own snapshot, so it takes the session's lease for the time it writes, as a loop worker
does for a turn: no turn can start meanwhile, and the worker that ran the session last
sees that someone held the lease since, so it reads the rewound snapshot instead of
starting from the copy it kept (:func:`loop_worker.turn.warm`). The snapshot is written
with a revision check against the one read. A fork only reads the source session and
creates a new one.

How a caller reads a session's stored events is its own (``events``): the gateway's
backend and the client's NATS transport each have a reader. Every NATS call here is
bounded by ``timeout`` (``TimeoutError`` past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
from nats.js.client import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError

from schemas import SessionSnapshot, Subjects, decode, encode, new_id, session_key
from schemas.codec import DecodeError
from schemas.events import Event, Forked, Rewound

from .backlog import unfinished
from .errors import BranchRefused
from .history import Cut, Timeline, cut, fold
from .kv import KV
from .publisher import Publisher

T = TypeVar("T")

#: A session's stored events, in stream order: ``events(tenant, session)``.
EventsReader = Callable[[str, str], Awaitable[list[Event]]]

#: How many forks back a timeline follows ``forked`` to its sources.
MAX_FORK_DEPTH = 16

#: Who holds a session's lease while a rewind writes it (the loop workers' record shape).
LEASE_OWNER = "rewind"


class Branching:
    """Fork and rewind. ``sessions`` and ``leases``: the sessions and leases buckets."""

    def __init__(
        self,
        js: JetStreamContext,
        publisher: Publisher,
        subjects: Subjects,
        *,
        sessions: KV,
        leases: KV,
        events: EventsReader,
        timeout: float = 5.0,
    ) -> None:
        self.js = js
        self.publisher = publisher
        self.subjects = subjects
        self.sessions = sessions
        self.leases = leases
        self.events = events
        self.timeout = timeout

    async def fork(
        self, tenant: str, source: str, turn_id: str, *, before: bool, into: str
    ) -> tuple[SessionSnapshot, Cut]:
        """Make session ``into`` as ``source`` was at the end of ``turn_id`` (``before``:
        at its start), and announce it with a ``forked`` event in ``into``."""
        if into == source:
            raise BranchRefused("invalid", "a fork needs a session id of its own", field="session")
        snapshot, _ = await self._idle(tenant, source)
        key = session_key(tenant, into)
        entry = await self._call(self.sessions.entry(key))
        taken = BranchRefused("conflict", f"session {into!r} exists already", field="session")
        if entry is not None and entry.value is not None:
            raise taken
        made = cut(snapshot, await self.timeline(tenant, source), turn_id, before=before)
        fork = SessionSnapshot(
            tenant=tenant, session=into, messages=made.messages, summary=made.summary,
            plan=made.plan, turn_id=made.last, turns=len(made.kept), updated_at=time.time(),
            agent=snapshot.agent,
        )  # fmt: skip
        try:
            last = entry.revision if entry is not None else 0
            await self._call(self.sessions.update(key, encode(fork), last))
        except KeyWrongLastSequenceError:
            raise taken from None
        forked = Forked(
            tenant=tenant, session=into, turn_id=new_id(), ts=time.time(), source=source,
            at_turn=made.last, turns=made.kept,
        )  # fmt: skip
        await self._announce(forked)
        return fork, made

    async def rewind(
        self, tenant: str, session: str, turn_id: str, *, before: bool
    ) -> tuple[SessionSnapshot, Cut]:
        """Take ``session`` back to the end of ``turn_id`` (``before``: to its start);
        the turns after it are undone, said by a ``rewound`` event."""
        async with self._lease(tenant, session):
            snapshot, revision = await self._idle(tenant, session)
            made = cut(snapshot, await self.timeline(tenant, session), turn_id, before=before)
            if not made.later:
                raise BranchRefused(
                    "invalid",
                    f"turn {turn_id!r} is the session's last: there is nothing after it to undo",
                    field="before_turn" if before else "at_turn",
                )
            rewound = msgspec.structs.replace(
                snapshot, messages=made.messages, summary=made.summary, plan=made.plan,
                status="idle", turn_id=made.last, iteration=0,
                turns=max(0, snapshot.turns - len(made.later)), updated_at=time.time(),
                pending=(), turn_started_at=0.0, turn_tool_calls=0, turn_tokens=0,
                turn_cost=0.0, orchestrator=None, last_end=None,
            )  # fmt: skip
            key = session_key(tenant, session)
            try:
                await self._call(self.sessions.update(key, encode(rewound), revision))
            except KeyWrongLastSequenceError:
                raise BranchRefused(
                    "busy", f"session {session!r} changed meanwhile; try again"
                ) from None
            event = Rewound(
                tenant=tenant, session=session, turn_id=new_id(), ts=time.time(),
                to_turn=made.last, turns=made.later, calls=made.calls,
            )  # fmt: skip
            await self._announce(event)
        return rewound, made

    async def timeline(self, tenant: str, session: str, depth: int = 0) -> Timeline:
        """The session's turns as its events tell them; a fork's inherited turns are
        folded from its source's events (up to :data:`MAX_FORK_DEPTH` forks back)."""
        t = fold(await self.events(tenant, session))
        if t.source is not None and depth < MAX_FORK_DEPTH:
            t.inherit(await self.timeline(tenant, t.source[0], depth + 1))
        return t

    # -- parts ----------------------------------------------------------------------------

    async def _call(self, call: Awaitable[T]) -> T:
        async with asyncio.timeout(self.timeout):
            return await call

    async def _idle(self, tenant: str, session: str) -> tuple[SessionSnapshot, int]:
        """The session's snapshot and revision, refused when there is none and while a
        turn of it runs or waits."""
        entry = await self._call(self.sessions.entry(session_key(tenant, session)))
        snapshot = None
        if entry is not None and entry.value is not None:
            with contextlib.suppress(DecodeError):
                snapshot = decode(entry.value, SessionSnapshot)
        if entry is None or snapshot is None:
            raise BranchRefused("not_found", f"no session {session!r}")
        if snapshot.status != "idle":
            raise BranchRefused(
                "busy",
                f"session {session!r} has a turn {snapshot.status} ({snapshot.turn_id}); "
                "fork or rewind it once the turn has ended, or cancel the turn",
            )
        waiting = await self._call(unfinished(self.publisher, self.subjects, tenant, session))
        if waiting:
            names = ", ".join(t.turn_id for t in waiting)
            raise BranchRefused(
                "busy",
                f"session {session!r} has turns that have not ended ({names}); fork or "
                "rewind it once they have, or cancel them",
            )
        return snapshot, entry.revision

    async def _announce(self, event: Event) -> None:
        subject = self.subjects.event(event.tenant, event.session, event.type)
        msg_id = f"{event.turn_id}:{event.type}"
        await self._call(self.js.publish(subject, encode(event), headers={"Nats-Msg-Id": msg_id}))

    @contextlib.asynccontextmanager
    async def _lease(self, tenant: str, session: str) -> AsyncIterator[None]:
        """Hold the session's lease (refused while a loop worker holds it)."""
        key = session_key(tenant, session)
        entry = await self._call(self.leases.entry(key))
        busy = BranchRefused(
            "busy", f"session {session!r} is held by a loop worker; try again once its turn ends"
        )
        if entry is not None and entry.value is not None:
            raise busy
        record = msgspec.json.encode(
            {"owner": LEASE_OWNER, "turn_id": new_id(), "at": time.time(),
             "take": secrets.token_hex(6)}
        )  # fmt: skip
        last = entry.revision if entry is not None else 0
        try:
            revision = await self._call(self.leases.update(key, record, last))
        except KeyWrongLastSequenceError:
            raise busy from None
        try:
            yield
        finally:
            with contextlib.suppress(Exception):  # else it lapses with the bucket's TTL
                await self._call(self.leases.delete(key, revision))
