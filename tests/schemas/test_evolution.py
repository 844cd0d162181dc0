"""Readers tolerate what a newer writer sends: an event type they do not know decodes
to a generic form, a ``loop_end`` reason they do not know still ends the turn.

The "old reader" is a decoder built from a frozen copy of the event types as they were
before the limits and ``retract`` were added, fed the events this version writes."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest

from schemas import DecodeError, decode, encode
from schemas.events import (
    ContentDelta,
    Event,
    LoopEnd,
    Message,
    Retract,
    UnknownEvent,
    decode_event,
)

#: ``EndReason`` before this version added deadline, max_tool_calls and tool_failed.
OldReason = Literal[
    "task_completion",
    "ask_question",
    "converse",
    "max_iterations",
    "cancelled",
    "circuit_open",
    "forced_summary",
    "llm_failed",
    "budget_exceeded",
    "error",
]


class OldLoopEnd(Event, tag="loop_end", frozen=True, kw_only=True):
    reason: OldReason
    content: str = ""
    iterations: int = 0
    error: str | None = None


#: An old reader's union: no ``retract``, the old reasons.
OldEvent = ContentDelta | Message | OldLoopEnd

COMMON = {"tenant": "acme", "session": "s1", "turn_id": "t1", "iteration": 2, "ts": 5.0}


def test_an_old_reader_reads_a_new_event_type_as_a_generic_event() -> None:
    data = encode(Retract(**COMMON, reason="nudge", chars=12))
    with pytest.raises(DecodeError):  # what a closed union does
        decode(data, OldEvent)
    event = decode_event(data, OldEvent)
    assert isinstance(event, UnknownEvent)
    assert (event.type, event.fields) == ("retract", {"reason": "nudge", "chars": 12})
    assert (event.tenant, event.session, event.turn_id, event.iteration) == ("acme", "s1", "t1", 2)


@pytest.mark.parametrize("reason", ["deadline", "max_tool_calls", "tool_failed"])
def test_an_old_reader_still_ends_the_turn_on_a_new_end_reason(reason: str) -> None:
    data = encode(LoopEnd(**COMMON, reason=reason, content="why", iterations=2))  # type: ignore[arg-type]
    event = decode_event(data, OldEvent)
    assert isinstance(event, OldLoopEnd)
    assert (event.reason, event.content, event.iterations) == ("error", "why", 2)
    assert event.error is not None and repr(reason) in event.error and "upgrade" in event.error


def test_known_events_with_new_fields_decode_as_their_type() -> None:
    raw = {**COMMON, "type": "message", "content": "hi", "added_later": [1, 2]}
    event = decode_event(msgspec.json.encode(raw), OldEvent)
    assert isinstance(event, Message) and event.content == "hi"


def test_this_version_reads_a_future_type_and_reason() -> None:
    future = {**COMMON, "type": "hook_error_v9", "hook": "x"}
    event = decode_event(msgspec.json.encode(future))
    assert isinstance(event, UnknownEvent) and event.type == "hook_error_v9"
    end = decode_event(msgspec.json.encode({**COMMON, "type": "loop_end", "reason": "someday"}))
    assert isinstance(end, LoopEnd) and end.reason == "error"


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1]",
        b'{"no_type": 1}',
        b'{"type": "message", "tenant": "acme", "iteration": "x"}',
    ],
)
def test_what_is_no_event_at_all_is_still_refused(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_event(data)
