"""Events: one tagged union (``type``) published to ``<prefix>.events.<tenant>.<session>.<type>``.

Every event carries the schema version, tenant, session, turn id, iteration and a
timestamp. The stream sequence is an event's id for readers that resume.

Evolution: new event types, new fields (with defaults) and new ``loop_end`` reasons
are added without a version bump, so readers must tolerate what they do not know.
Read with :func:`decode_event`, not ``decode(data, AnyEvent)``: an event of a type
this reader does not know becomes an :class:`UnknownEvent` (its type and fields kept),
and a ``loop_end`` with a reason it does not know stays a :class:`LoopEnd` with reason
``error`` (the original reason named in ``error``), so a turn still ends for it.

The types are defined by theme (``event.py``: the base; ``loop_events.py``: a turn's run;
``session_events.py``: a session's history) and imported from here.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec

from .codec import DecodeError, decode
from .event import Event, Usage
from .loop_events import (
    ANSWERED,
    ApprovalDecided,
    ApprovalRequired,
    BudgetReached,
    ContentDelta,
    ContextBudget,
    EndReason,
    Error,
    HookErrorEvent,
    LLMRequest,
    LLMResponse,
    LoopEnd,
    LoopIteration,
    LoopStart,
    MemoryPruned,
    Message,
    NoToolCall,
    OrchestratorFallback,
    Paused,
    PayloadTruncated,
    PlanUpdate,
    Question,
    Resumed,
    Retract,
    Retry,
    ThinkingDelta,
    ThinkingEnd,
    ThinkingStart,
    ToolCallEvent,
    ToolErrorEvent,
    ToolResultEvent,
    ToolSelection,
    ToolTimeout,
    TurnAccepted,
    TurnQueued,
)
from .session_events import Forked, RanCall, Rewound, RolledBack
from .types import SCHEMA_VERSION, Parent

__all__ = [
    "ANSWERED",
    "EVENT_NAMES",
    "EVENT_TYPES",
    "AnyEvent",
    "ApprovalDecided",
    "ApprovalRequired",
    "BudgetReached",
    "ContentDelta",
    "ContextBudget",
    "EndReason",
    "Error",
    "Event",
    "Forked",
    "HookErrorEvent",
    "LLMRequest",
    "LLMResponse",
    "LoopEnd",
    "LoopIteration",
    "LoopStart",
    "MemoryPruned",
    "Message",
    "NoToolCall",
    "OrchestratorFallback",
    "Paused",
    "PayloadTruncated",
    "PlanUpdate",
    "Question",
    "RanCall",
    "Resumed",
    "Retract",
    "Retry",
    "Rewound",
    "RolledBack",
    "ThinkingDelta",
    "ThinkingEnd",
    "ThinkingStart",
    "ToolCallEvent",
    "ToolErrorEvent",
    "ToolResultEvent",
    "ToolSelection",
    "ToolTimeout",
    "TurnAccepted",
    "TurnQueued",
    "UnknownEvent",
    "Usage",
    "decode_event",
    "tool_event_msg_id",
]


AnyEvent = (
    TurnAccepted
    | TurnQueued
    | LoopStart
    | LoopIteration
    | LLMRequest
    | LLMResponse
    | ThinkingStart
    | ThinkingDelta
    | ThinkingEnd
    | ContentDelta
    | Message
    | ToolCallEvent
    | ToolResultEvent
    | ToolErrorEvent
    | ToolTimeout
    | NoToolCall
    | PlanUpdate
    | ContextBudget
    | MemoryPruned
    | ApprovalRequired
    | ApprovalDecided
    | Question
    | Retry
    | Paused
    | Resumed
    | Retract
    | HookErrorEvent
    | OrchestratorFallback
    | RolledBack
    | Forked
    | Rewound
    | BudgetReached
    | LoopEnd
    | Error
    | PayloadTruncated
)


class UnknownEvent(Event, tag="unknown", frozen=True, kw_only=True):
    """The generic form of an event of a type this reader does not know (a newer
    writer's): the common fields, and everything else in ``fields``. Not published;
    :func:`decode_event` makes it. Its :attr:`type` is the event's own type."""

    kind: str
    fields: dict[str, Any] = {}

    @property
    def type(self) -> str:
        return self.kind


class _Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """What every event has, read without knowing its type (unknown fields ignored)."""

    type: str
    v: int = SCHEMA_VERSION
    tenant: str = ""
    session: str = ""
    turn_id: str = ""
    iteration: int = 0
    ts: float = 0.0
    parent: Parent | None = None


_COMMON = frozenset(f for f in _Envelope.__struct_fields__)


def decode_event(data: bytes | bytearray | memoryview | str, union: Any = None) -> Event:
    """Decode one event, tolerating what a newer writer may send (see the module
    docstring). ``union`` is the set of types this reader knows (:data:`AnyEvent`).
    Raises :class:`~schemas.codec.DecodeError` for bytes that are no event at all."""
    union = AnyEvent if union is None else union
    try:
        return decode(data, union)
    except DecodeError as exc:
        first = exc
    raw = decode(data, dict[str, Any])
    try:
        env = msgspec.convert(raw, _Envelope)
    except msgspec.ValidationError:
        raise first from None
    known = {t.__struct_config__.tag: t for t in typing.get_args(union)}
    if env.type == "loop_end" and "loop_end" in known:
        reason = str(raw.get("reason"))
        detail = raw.get("error") or ""
        note = f"this reader does not know the end reason {reason!r}; upgrade it"
        fixed = {**raw, "reason": "error", "error": f"{note}: {detail}" if detail else note}
        try:
            return msgspec.convert(fixed, known["loop_end"])
        except msgspec.ValidationError:
            pass
    if env.type in known:
        raise first  # a type it knows, with values that are wrong
    return UnknownEvent(
        v=env.v,
        tenant=env.tenant or "unknown",
        session=env.session or "unknown",
        turn_id=env.turn_id or "unknown",
        iteration=env.iteration,
        ts=env.ts,
        parent=env.parent,
        kind=env.type,
        fields={k: v for k, v in raw.items() if k not in _COMMON},
    )


def tool_event_msg_id(call_id: str, type: str) -> str:
    """The ``Nats-Msg-Id`` of a call's ``tool_result`` / ``tool_error`` / ``tool_timeout``.

    Both the tool worker that ran the call and the engine that awaited it publish this
    event; the shared id lets JetStream keep one.
    """
    return f"{call_id}:{type}"


EVENT_TYPES: tuple[type[Event], ...] = typing.get_args(AnyEvent)

#: Every event type name, in the order above.
EVENT_NAMES: tuple[str, ...] = tuple(
    t.__struct_config__.tag  # type: ignore[misc]
    for t in EVENT_TYPES
)
