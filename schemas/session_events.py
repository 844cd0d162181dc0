"""The events that change a session's history rather than run a turn: a rolled-back turn
(``on_busy = "rollback"``), a session forked from another, a session rewound.
"""

from __future__ import annotations

import msgspec

from .event import Event


class RanCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call a rolled-back turn made, and how it ended."""

    call_id: str
    server: str = ""
    tool: str = ""
    status: str = "ok"


class RolledBack(Event, tag="rolled_back", frozen=True, kw_only=True):
    """An interrupted turn's session returned to its snapshot from before the turn
    began (``on_busy = "rollback"``): its events stay in the stream, this one after
    them. ``by_turn``: the turn that interrupted it; ``to_turn``: the turn whose end the
    session returned to (``None``: the session's start). A tool call's side effect is
    not undone: ``calls`` are the calls the turn made that ran."""

    by_turn: str = ""
    to_turn: str | None = None
    calls: tuple[RanCall, ...] = ()


class Forked(Event, tag="forked", frozen=True, kw_only=True):
    """The first event of a session made as a copy of another as of one of its turns
    (``POST /v1/sessions/{session}/fork``); published by the gateway under a turn id of
    its own. ``source``: the session copied, left as it was; ``at_turn``: the last of
    its turns the copy holds (``None``: none, the copy starts empty); ``turns``: the
    ids of the turns it holds, oldest first (their events stay in ``source``). Their
    tool calls ran once, in ``source``; nothing runs again."""

    source: str
    at_turn: str | None = None
    turns: tuple[str, ...] = ()


class Rewound(Event, tag="rewound", frozen=True, kw_only=True):
    """The session was taken back to the end of ``to_turn`` (``None``: its start) by
    ``POST /v1/sessions/{session}/rewind``; published by the gateway under a turn id of
    its own. ``turns``: the turns undone, oldest first: their events stay in the
    stream, before this one, and a reader shows them as undone; the next turn starts
    from the session as it was before them. A tool call's side effect is not undone:
    ``calls`` are the calls of the undone turns that a tool worker ran (``status``
    ``timeout``: it may have)."""

    to_turn: str | None = None
    turns: tuple[str, ...] = ()
    calls: tuple[RanCall, ...] = ()
