"""What the client's two ways in (:mod:`.nats`, :mod:`.gateway`) each provide, and the
values they hand back."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

import msgspec

from loopmesh.sessions import Query, SessionSummary
from schemas import AgentSpec, Control, DecodeError, Turn
from schemas.events import Event, RanCall, decode_event
from schemas.memory import MemorySource


class SessionEvent(msgspec.Struct, frozen=True):
    """One stored event of a session: ``seq`` is its sequence in the events stream (pass
    the last one you handled as ``since`` to resume after it), ``event`` the decoded
    event, ``data`` its JSON as stored."""

    seq: int
    event: Event
    data: bytes

    @classmethod
    def of(cls, seq: int, data: bytes) -> SessionEvent | None:
        """The event stored at ``seq``, or None for bytes that are no event at all (an
        event of a type this reader does not know is an ``UnknownEvent``: see
        :func:`~schemas.events.decode_event`)."""
        try:
            return cls(seq, decode_event(data), data)
        except DecodeError:
            return None


class Submitted(msgspec.Struct, frozen=True):
    """A turn handed to loopmesh: its id, its session, and ``since``, a sequence of the
    events stream from before it was published (0 when the turn had been published
    before): ``client.events(session, since=since, turn=turn_id)`` reads all of it."""

    turn_id: str
    session: str
    since: int


class MemoryItem(msgspec.Struct, frozen=True, kw_only=True):
    """A memory an agent keeps across sessions (``schemas.memory``), as a client reads it:
    ``kind`` ``user`` or ``agent``, ``name`` the user's id or the agent's name."""

    id: str
    kind: str
    name: str
    text: str
    created_at: float = 0.0
    source: MemorySource | None = None


class Fork(msgspec.Struct, frozen=True, kw_only=True):
    """A session made by :meth:`~loopmesh.client.Client.fork`: ``session`` holds
    ``source`` as it was at the end of ``at_turn`` (``None``: none of its turns);
    ``turns``: the turns it holds, oldest first; ``messages``: its conversation's length."""

    session: str
    source: str
    agent: str = "default"
    at_turn: str | None = None
    turns: tuple[str, ...] = ()
    messages: int = 0


class Rewind(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`~loopmesh.client.Client.rewind` did: ``session`` now ends with
    ``to_turn`` (``None``: it is empty); ``undone``: the turns taken back, oldest first;
    ``calls``: their tool calls that ran (their side effects stay)."""

    session: str
    to_turn: str | None = None
    undone: tuple[str, ...] = ()
    calls: tuple[RanCall, ...] = ()
    messages: int = 0


class Erased(msgspec.Struct, frozen=True):
    """A session erased (:meth:`~loopmesh.client.Client.delete_session`): when, the
    sessions of the agents it called (erased with it), and how many stored messages went
    from where (``events``, ``sessions``, ``effects``, ``a2a_tasks``, ...)."""

    session: str
    erased_at: float
    children: list[str]
    removed: dict[str, int]


class SessionPage(msgspec.Struct, frozen=True):
    """A page of sessions, most recently active first (:meth:`Client.sessions`);
    ``next_cursor``: pass it as ``cursor`` for the next page (``None``: the last)."""

    sessions: list[SessionSummary]
    next_cursor: str | None = None


class Transport(Protocol):
    """NATS or the gateway, as :class:`~loopmesh.client.Client` uses them."""

    #: Where it goes, for messages: ``NATS, tenant local``, ``gateway http://...``.
    where: str

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(self, turn: Turn) -> Submitted:
        """Publish ``turn`` (deduplicated by its id)."""
        ...

    def events(
        self, session: str, *, since: int, turn: str | None, follow: bool
    ) -> AsyncGenerator[SessionEvent, None]:
        """The session's events after ``since`` (of ``turn`` only, if given): those
        stored, then, with ``follow``, new ones as they come."""
        ...

    async def send(self, control: Control) -> None: ...

    async def agents(self) -> list[AgentSpec]: ...

    async def memories(self, kind: str, name: str) -> list[MemoryItem]: ...

    async def remember(self, kind: str, name: str, text: str) -> MemoryItem: ...

    async def forget(self, kind: str, name: str, id: str) -> bool: ...

    async def erase_memories(self, kind: str, name: str) -> int: ...

    async def fork(self, session: str, *, turn: str, before: bool, into: str | None) -> Fork:
        """A new session (``into``, or an id picked) as ``session`` was at the end of
        ``turn`` (``before``: at its start)."""
        ...

    async def rewind(self, session: str, *, turn: str, before: bool) -> Rewind:
        """Take ``session`` back to the end of ``turn`` (``before``: to its start)."""
        ...

    async def sessions(self, tenant: str, query: Query) -> SessionPage:
        """A page of the tenant's sessions that match ``query``."""
        ...

    async def delete_session(self, tenant: str, session: str) -> Erased:
        """Erase the session everywhere; :class:`~loopmesh.client.errors.NotFound` if
        nothing of it is stored."""
        ...
