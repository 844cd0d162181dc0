from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    EVENT_TYPES,
    AnyEvent,
    ChatMessage,
    Control,
    DecodeError,
    SessionSnapshot,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    Turn,
    WireError,
    decode,
    encode,
)
from tests.schemas.strategies import for_type

WIRE_TYPES: list[Any] = [
    Turn,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    WireError,
    Control,
    ChatMessage,
    SessionSnapshot,
    AnyEvent,
]


@pytest.mark.parametrize("type_", WIRE_TYPES, ids=lambda t: getattr(t, "__name__", str(t)))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_wire_type_round_trips_through_encode_and_decode(type_, data):
    value = data.draw(for_type(type_))
    assert decode(encode(value), type_) == value


@pytest.mark.parametrize("type_", EVENT_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_event_type_round_trips_through_the_event_union(type_, data):
    event = data.draw(for_type(type_))
    decoded = decode(encode(event), AnyEvent)
    assert type(decoded) is type_
    assert decoded == event


def test_decoding_a_message_of_the_wrong_shape_names_the_field():
    with pytest.raises(DecodeError) as info:
        decode(b'{"id": "t1", "tenant": "a", "session": "s", "input": 5}', Turn)
    assert info.value.type_name == "Turn"
    assert "$.input" in str(info.value)


def test_decoding_malformed_json_is_a_decode_error():
    with pytest.raises(DecodeError, match="malformed JSON"):
        decode(b'{"id": ', Turn)


def test_an_event_decodes_to_the_type_its_tag_names():
    raw = (
        b'{"type": "loop_end", "tenant": "a", "session": "s", "turn_id": "t", "reason": "converse"}'
    )
    event = decode(raw, AnyEvent)
    assert event.type == "loop_end"
    assert type(event).__name__ == "LoopEnd"
