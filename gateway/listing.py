"""``GET /v1/sessions``: the filters a list takes, its order and its cursor, and the
checks of a session's title and labels.

A list is every session of the tenant (snapshot and metadata, read from the sessions
bucket), filtered, most recently active first (``updated_at``, then the session id),
cut into pages. A cursor names the last session of a page by its place in that order,
so a session that becomes active between two pages moves to the front and is not shown
twice; one that was erased is simply not there."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
from starlette.datastructures import QueryParams

from schemas import SessionMeta, SessionSnapshot, is_token

from . import api
from .errors import Unprocessable

#: Sessions on one page at most, and by default.
MAX_PAGE = 1_000
DEFAULT_PAGE = 100
MAX_LABELS = 32
MAX_LABEL_VALUE = 256
MAX_TITLE = 200
LABEL_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Query:
    """What a list asks for (each filter optional)."""

    agent: str | None = None
    labels: Mapping[str, str | None] = field(default_factory=dict)  # None: any value
    active_after: float | None = None
    active_before: float | None = None
    limit: int = DEFAULT_PAGE
    after: tuple[float, str] | None = None  # the cursor: the last session of the last page

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


def query_of(params: QueryParams) -> Query:
    """The :class:`Query` of a request's parameters; 422 naming the bad one."""
    agent = params.get("agent")
    if agent is not None and not is_token(agent):
        raise Unprocessable(f"invalid agent: {agent[:80]!r} is not an agent name", field="agent")
    labels: dict[str, str | None] = {}
    for raw in params.getlist("label"):
        key, sep, value = raw.partition("=")
        check_label(key, value if sep else "", field="label")
        labels[key] = value if sep else None
    limit = _number(params.get("limit"), "limit")
    limit = DEFAULT_PAGE if limit is None else limit
    if limit != int(limit) or not 1 <= limit <= MAX_PAGE:
        raise Unprocessable(f"`limit` must be an integer from 1 to {MAX_PAGE}", field="limit")
    cursor = params.get("cursor")
    return Query(
        agent=agent,
        labels=labels,
        active_after=_number(params.get("active_after"), "active_after"),
        active_before=_number(params.get("active_before"), "active_before"),
        limit=int(limit),
        after=_decode_cursor(cursor) if cursor is not None else None,
    )


def page(found: Sequence[tuple[SessionSnapshot, SessionMeta]], query: Query) -> api.SessionList:
    """One page of the sessions that match ``query``, with the next page's cursor."""
    chosen = [(s, m) for s, m in found if query.matches(s, m)]
    chosen.sort(key=lambda sm: (-sm[0].updated_at, sm[0].session))
    if query.after is not None:
        at = (-query.after[0], query.after[1])
        chosen = [(s, m) for s, m in chosen if (-s.updated_at, s.session) > at]
    shown = chosen[: query.limit]
    cursor = None
    if len(chosen) > query.limit:
        last = shown[-1][0]
        cursor = _encode_cursor(last.updated_at, last.session)
    return api.SessionList(sessions=[summary(s, m) for s, m in shown], next_cursor=cursor)


def summary(snapshot: SessionSnapshot, meta: SessionMeta) -> api.SessionSummary:
    s = snapshot
    running = s.status != "idle"
    return api.SessionSummary(
        session=s.session, status=s.status, turns=s.turns, updated_at=s.updated_at,
        agent=s.agent, title=meta.title, labels=dict(meta.labels),
        tokens=s.tokens + (s.turn_tokens if running else 0), last_turn=s.turn_id,
        last_end=s.last_end.reason if s.last_end is not None and not running else None,
        expired=meta.expired_at > 0,
    )  # fmt: skip


# -- title and labels ------------------------------------------------------------------


def check_title(title: str) -> str:
    if len(title) > MAX_TITLE:
        raise Unprocessable(
            f"`title` is {len(title)} characters, over the limit of {MAX_TITLE}", field="title"
        )
    return title


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise Unprocessable(f"at most {MAX_LABELS} labels, not {len(labels)}", field="labels")
    for key, value in labels.items():
        check_label(key, value, field=f"labels.{key[:64]}")
    return dict(labels)


def check_label(key: str, value: str, *, field: str) -> None:
    if not LABEL_KEY.fullmatch(key):
        raise Unprocessable(
            f"label key {key[:80]!r} must be 1-64 characters from A-Z a-z 0-9 _ - .",
            field=field,
        )
    if len(value) > MAX_LABEL_VALUE:
        raise Unprocessable(
            f"label {key!r} has a value of {len(value)} characters, over {MAX_LABEL_VALUE}",
            field=field,
        )


# -- the cursor -----------------------------------------------------------------------


def _encode_cursor(updated_at: float, session: str) -> str:
    raw = msgspec.json.encode([updated_at, session])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, session = msgspec.json.decode(raw, type=tuple[float, str])
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise Unprocessable(
            "`cursor` is not one this API gave (pass a list's `next_cursor` as it is)",
            field="cursor",
        ) from None
    return at, session


def _number(value: str | None, name: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if number != number or number < 0 or number == float("inf"):
        raise Unprocessable(f"`{name}` must be a non-negative number", field=name)
    return number
