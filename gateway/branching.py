"""Fork and rewind on NATS: the session's timeline read from its events, the cut made by
:mod:`gateway.history`, and the writes.

Both refuse (409, ``session_busy``) while a turn of the session runs or waits in the
turns stream: a cut is only defined between turns, and a waiting turn was posted
against the session as it is. A rewind rewrites the session's own snapshot, so it takes
the session's lease for the time it writes, as a loop worker does for a turn: no turn
can start meanwhile, and the worker that ran the session last sees that someone held the
lease since, so it reads the rewound snapshot instead of starting from the copy it kept
(:func:`loop_worker.turn.warm`). The snapshot is written with a revision check against
the one read. A fork only reads the source session and creates a new one.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from schemas import SessionSnapshot, decode, encode, new_id, session_key
from schemas.codec import DecodeError
from schemas.events import Event, Forked, Rewound, decode_event

from .backend import Backend
from .errors import Busy, Conflict, NotFound, Unprocessable
from .history import Cut, Timeline, Unreachable, cut, fold

#: How many forks back a timeline follows ``forked`` to its sources.
MAX_FORK_DEPTH = 16

#: Who holds a session's lease while a rewind writes it (the loop workers' record shape).
_LEASE_OWNER = "gateway-rewind"


class Branching:
    """Fork and rewind over the gateway's :class:`~gateway.backend.Backend`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def fork(
        self, tenant: str, source: str, turn_id: str, *, before: bool, into: str
    ) -> tuple[SessionSnapshot, Cut]:
        """Make session ``into`` as ``source`` was at the end of ``turn_id`` (``before``:
        at its start), and announce it with a ``forked`` event in ``into``."""
        snapshot, _ = await self._idle(tenant, source)
        sessions = await self.backend.kv(self.backend.subjects.sessions_bucket)
        key = session_key(tenant, into)
        entry = await self.backend.call("read session", sessions.entry(key))
        if entry is not None and entry.value is not None:
            raise Conflict(f"session {into!r} exists already", field="session")
        made = self._cut(snapshot, await self.timeline(tenant, source), turn_id, before)
        fork = SessionSnapshot(
            tenant=tenant, session=into, messages=made.messages, summary=made.summary,
            plan=made.plan, turn_id=made.last, turns=len(made.kept), updated_at=time.time(),
            agent=snapshot.agent,
        )  # fmt: skip
        try:
            last = entry.revision if entry is not None else 0
            await self.backend.call("create session", sessions.update(key, encode(fork), last))
        except KeyWrongLastSequenceError:
            raise Conflict(f"session {into!r} exists already", field="session") from None
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
            made = self._cut(snapshot, await self.timeline(tenant, session), turn_id, before)
            if not made.later:
                raise Unprocessable(
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
            sessions = await self.backend.kv(self.backend.subjects.sessions_bucket)
            key = session_key(tenant, session)
            try:
                await self.backend.call(
                    "write session", sessions.update(key, encode(rewound), revision)
                )
            except KeyWrongLastSequenceError:
                raise Busy(f"session {session!r} changed meanwhile; try again") from None
            event = Rewound(
                tenant=tenant, session=session, turn_id=new_id(), ts=time.time(),
                to_turn=made.last, turns=made.later, calls=made.calls,
            )  # fmt: skip
            await self._announce(event)
        return rewound, made

    async def timeline(self, tenant: str, session: str, depth: int = 0) -> Timeline:
        """The session's turns as its events tell them; a fork's inherited turns are
        folded from its source's events (up to :data:`MAX_FORK_DEPTH` forks back)."""
        t = fold(await self._events(tenant, session))
        if t.source is not None and depth < MAX_FORK_DEPTH:
            t.inherit(await self.timeline(tenant, t.source[0], depth + 1))
        return t

    # -- parts ----------------------------------------------------------------------------

    async def _idle(self, tenant: str, session: str) -> tuple[SessionSnapshot, int]:
        """The session's snapshot and revision; 404 when none, 409 while a turn of it
        runs or waits."""
        sessions = await self.backend.kv(self.backend.subjects.sessions_bucket)
        entry = await self.backend.call(
            "read session", sessions.entry(session_key(tenant, session))
        )
        if entry is None or entry.value is None:
            raise NotFound(f"no session {session!r}")
        try:
            snapshot = decode(entry.value, SessionSnapshot)
        except DecodeError:
            raise NotFound(f"no session {session!r} (its snapshot is unreadable)") from None
        if snapshot.status != "idle":
            raise Busy(
                f"session {session!r} has a turn {snapshot.status} ({snapshot.turn_id}); "
                "fork or rewind it once the turn has ended, or cancel the turn"
            )
        waiting = await self.backend.unfinished(tenant, session)
        if waiting:
            names = ", ".join(t.turn_id for t in waiting)
            raise Busy(
                f"session {session!r} has turns that have not ended ({names}); fork or "
                "rewind it once they have, or cancel them"
            )
        return snapshot, entry.revision

    @staticmethod
    def _cut(snapshot: SessionSnapshot, t: Timeline, turn_id: str, before: bool) -> Cut:
        try:
            return cut(snapshot, t, turn_id, before=before)
        except Unreachable as exc:
            raise Unprocessable(exc.message, field=exc.field) from None

    async def _events(self, tenant: str, session: str) -> list[Event]:
        b = self.backend
        first, last = await b.events_bounds(tenant, session)
        if last == 0:
            return []
        stream = b.subjects.events_stream_of(tenant, session)
        subject = b.subjects.session_events(tenant, session)
        out: list[Event] = []
        async with contextlib.aclosing(
            b.stored_events(stream, subject, max(first, 1), "the session's events")
        ) as batches:
            async for batch in batches:
                for msg in batch:
                    try:
                        out.append(decode_event(msg.data))
                    except DecodeError:
                        continue
        return out

    async def _announce(self, event: Event) -> None:
        b = self.backend
        subject = b.subjects.event(event.tenant, event.session, event.type)
        await b.call(
            f"publish {event.type}",
            b.js.publish(
                subject, encode(event), headers={"Nats-Msg-Id": f"{event.turn_id}:{event.type}"}
            ),
        )

    @contextlib.asynccontextmanager
    async def _lease(self, tenant: str, session: str) -> AsyncIterator[None]:
        """Hold the session's lease (409 while a loop worker holds it)."""
        leases = await self.backend.kv(self.backend.subjects.leases_bucket)
        key = session_key(tenant, session)
        entry = await self.backend.call("read lease", leases.entry(key))
        busy = Busy(f"session {session!r} is held by a loop worker; try again once its turn ends")
        if entry is not None and entry.value is not None:
            raise busy
        record = msgspec.json.encode(
            {"owner": _LEASE_OWNER, "turn_id": new_id(), "at": time.time(),
             "take": secrets.token_hex(6)}
        )  # fmt: skip
        last = entry.revision if entry is not None else 0
        try:
            revision = await self.backend.call("take lease", leases.update(key, record, last))
        except KeyWrongLastSequenceError:
            raise busy from None
        try:
            yield
        finally:
            with contextlib.suppress(Exception):  # else it lapses with the bucket's TTL
                await self.backend.call("release lease", leases.delete(key, revision))
