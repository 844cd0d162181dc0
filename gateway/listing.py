"""``GET /v1/sessions``: its query parameters, checked (422 naming the bad one), and the
checks of a session's title and labels. The list itself, its order and its cursor:
:mod:`loopmesh.sessions`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from starlette.datastructures import QueryParams

from loopmesh import sessions
from loopmesh.sessions import DEFAULT_PAGE, MAX_PAGE, Query
from schemas import SessionMeta, SessionSnapshot, is_token

from . import api
from .errors import Unprocessable

MAX_LABELS = 32
MAX_LABEL_VALUE = 256
MAX_TITLE = 200
LABEL_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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
    if cursor is not None:
        try:
            sessions.decode_cursor(cursor)
        except ValueError as exc:
            raise Unprocessable(str(exc), field="cursor") from None
    return Query(
        agent=agent,
        labels=labels,
        active_after=_number(params.get("active_after"), "active_after"),
        active_before=_number(params.get("active_before"), "active_before"),
        limit=int(limit),
        after=cursor,
    )


def page(found: Sequence[tuple[SessionSnapshot, SessionMeta]], query: Query) -> api.SessionList:
    """One page of the sessions that match ``query``, with the next page's cursor."""
    shown, cursor = sessions.page(found, query)
    return api.SessionList(sessions=shown, next_cursor=cursor)


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
