"""What every event carries (:class:`Event`, the tagged union's base), and a reply's
token :class:`Usage`. The event types are in ``loop_events.py`` and ``session_events.py``;
``events.py`` joins them into the union readers decode.
"""

from __future__ import annotations

import msgspec

from .types import SCHEMA_VERSION, Parent, Timestamp, Token


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """``parent``: set on the events of a child turn (an agent called by another's turn as
    a tool), naming the calling turn and call."""

    v: int = SCHEMA_VERSION
    tenant: Token
    session: Token
    turn_id: Token
    iteration: int = 0
    ts: Timestamp = 0.0
    parent: Parent | None = None

    @property
    def type(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """A reply's tokens as the provider counted them. ``cached_tokens``: the prompt tokens
    it read from its prompt cache (``prompt_tokens_details.cached_tokens``), a part of
    ``prompt_tokens``."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
