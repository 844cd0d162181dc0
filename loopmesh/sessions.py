"""A tenant's sessions as a list: read from the sessions bucket (each snapshot with its
metadata), filtered, most recently active first, in pages with a cursor. The gateway's
``GET /v1/sessions`` and the client over NATS list them the same way.

The order is ``updated_at`` (last activity), newest first, then the session id. A
cursor names the last session of a page by its place in that order, so a session that
becomes active between two pages moves to the front and is not shown twice; one that
was erased is simply not there::

    found = await read_sessions(js, subjects, "acme")
    shown, cursor = page(found, Query(labels={"team": "red"}, limit=50))
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
from nats.js import JetStreamContext

from schemas import DEFAULT_AGENT, DecodeError, SessionMeta, SessionSnapshot, Subjects, decode
from schemas.messages import SessionStatus

from .kv import kv_values

#: Sessions on one page at most, and by default.
MAX_PAGE = 1_000
DEFAULT_PAGE = 100


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A session in a list. ``updated_at``: its last activity; ``tokens``: LLM tokens of
    all its turns; ``last_turn`` and ``last_end``: its latest turn and how it ended
    (``null`` while it runs); ``expired``: retention kept its last snapshot only."""

    session: str
    status: SessionStatus
    turns: int
    updated_at: float
    agent: str = DEFAULT_AGENT
    title: str = ""
    labels: dict[str, str] = {}
    tokens: int = 0
    last_turn: str | None = None
    last_end: str | None = None
    expired: bool = False


@dataclass(frozen=True, slots=True)
class Query:
    """What a list asks for (each filter optional). ``labels``: every one must match
    (a value of ``None``: any value); ``after``: the cursor of the page before."""

    agent: str | None = None
    labels: Mapping[str, str | None] = field(default_factory=dict)
    active_after: float | None = None
    active_before: float | None = None
    limit: int = DEFAULT_PAGE
    after: str | None = None

    def matches(self, snapshot: SessionSnapshot, meta: SessionMeta) -> bool:
        if self.agent is not None and snapshot.agent != self.agent:
            return False
        if self.active_after is not None and snapshot.updated_at < self.active_after:
            return False
        if self.active_before is not None and snapshot.updated_at >= self.active_before:
            return False
        for key, value in self.labels.items():
            if key not in meta.labels or (value is not None and meta.labels[key] != value):
                return False
        return True


def page(
    found: Sequence[tuple[SessionSnapshot, SessionMeta]], query: Query
) -> tuple[list[SessionSummary], str | None]:
    """One page of the sessions that match ``query``, and the next page's cursor
    (``None``: this is the last). A cursor this module did not make: ``ValueError``."""
    chosen = [(s, m) for s, m in found if query.matches(s, m)]
    chosen.sort(key=lambda sm: (-sm[0].updated_at, sm[0].session))
    if query.after is not None:
        at, session = decode_cursor(query.after)
        chosen = [(s, m) for s, m in chosen if (-s.updated_at, s.session) > (-at, session)]
    shown = chosen[: query.limit]
    cursor = None
    if len(chosen) > query.limit:
        last = shown[-1][0]
        cursor = _encode_cursor(last.updated_at, last.session)
    return [summary(s, m) for s, m in shown], cursor


def summary(snapshot: SessionSnapshot, meta: SessionMeta) -> SessionSummary:
    s = snapshot
    running = s.status != "idle"
    return SessionSummary(
        session=s.session, status=s.status, turns=s.turns, updated_at=s.updated_at,
        agent=s.agent, title=meta.title, labels=dict(meta.labels),
        tokens=s.tokens + (s.turn_tokens if running else 0), last_turn=s.turn_id,
        last_end=s.last_end.reason if s.last_end is not None and not running else None,
        expired=meta.expired_at > 0,
    )  # fmt: skip


async def read_sessions(
    js: JetStreamContext, subjects: Subjects, tenant: str, *, timeout: float = 5.0
) -> list[tuple[SessionSnapshot, SessionMeta]]:
    """Every session of ``tenant`` with its metadata (empty where none was set)."""
    values = await kv_values(js, subjects.sessions_bucket, f"{tenant}.>", timeout=timeout)
    found: list[tuple[SessionSnapshot, SessionMeta]] = []
    for key, value in values.items():
        if key.count(".") != 1:
            continue
        try:
            snapshot = decode(value, SessionSnapshot)
        except DecodeError:
            continue
        found.append((snapshot, meta_of(values.get(f"{key}.meta"))))
    return found


def meta_of(value: bytes | None) -> SessionMeta:
    """A session's metadata (empty for none, or for an unreadable value)."""
    if not value:
        return SessionMeta()
    try:
        return decode(value, SessionMeta)
    except DecodeError:
        return SessionMeta()


def _encode_cursor(updated_at: float, session: str) -> str:
    raw = msgspec.json.encode([updated_at, session])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """The place a cursor names; ``ValueError`` for one this module did not make."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        return msgspec.json.decode(raw, type=tuple[float, str])
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise ValueError(
            "`cursor` is not one this API gave (pass a list's `next_cursor` as it is)"
        ) from None
