"""Audit records: what was erased, when and by whom, on the tenant-wide subject
``<prefix>.audit.<tenant>`` (:meth:`~schemas.subjects.Subjects.audit`), kept in the
audit stream. A record names the session and counts what went; it holds none of the
session's content."""

from __future__ import annotations

from typing import Literal

import msgspec

from .types import Timestamp, Token

#: ``delete``: everything of the session went; ``snapshot``: its last snapshot stays.
EraseMode = Literal["delete", "snapshot"]


class SessionErased(msgspec.Struct, frozen=True, kw_only=True, tag_field="type",
                    tag="session_erased"):  # fmt: skip
    """A session erased (``reason`` ``request``: ``DELETE /v1/sessions/{session}`` or the
    client; ``retention``: it was idle past its retention). ``mode`` ``snapshot``: its
    last snapshot was kept. ``by``: the API key's name, or ``retention``. ``children``:
    the sessions of the agents it called, erased with it. ``removed``: messages removed,
    by where they were (``events``, ``turns``, ``sessions``, ``effects``, ...)."""

    tenant: Token
    session: Token
    at: Timestamp
    reason: Literal["request", "retention"] = "request"
    mode: EraseMode = "delete"
    by: str = ""
    children: tuple[str, ...] = ()
    removed: dict[str, int] = {}
