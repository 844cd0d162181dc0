"""Decoding every wire type from arbitrary bytes: a value of the type comes out, or
:class:`~schemas.DecodeError`; nothing else (no ``msgspec`` error, no crash)."""

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import EVENT_TYPES, DecodeError, decode, encode
from tests.schemas.strategies import for_type, json_values
from tests.schemas.test_codec import WIRE_TYPES

TYPES: list[Any] = [*WIRE_TYPES, *EVENT_TYPES]


def _name(type_: Any) -> str:
    return getattr(type_, "__name__", str(type_))


def decodes_or_refuses(data: bytes, type_: Any) -> None:
    try:
        value = decode(data, type_)
    except DecodeError as exc:
        assert exc.type_name and exc.detail
        return
    assert msgspec.json.decode(encode(value)) is not None  # a real value: it encodes


@pytest.mark.parametrize("type_", TYPES, ids=_name)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_decode_error(type_, data):
    decodes_or_refuses(data, type_)


@pytest.mark.parametrize("type_", TYPES, ids=_name)
@given(
    value=json_values
    | st.dictionaries(
        st.sampled_from(
            [
                "id",
                "type",
                "v",
                "tenant",
                "session",
                "input",
                "call_id",
                "status",
                "messages",
                "content",
            ]
        ),
        json_values,
    )
)
def test_arbitrary_json_decodes_or_raises_decode_error(type_, value):
    decodes_or_refuses(msgspec.json.encode(value), type_)


@pytest.mark.parametrize("type_", TYPES, ids=_name)
@given(data=st.data())
def test_a_valid_message_with_bytes_changed_decodes_or_raises_decode_error(type_, data):
    """(It found invalid UTF-8 in a pattern-checked string escaping as a
    ``UnicodeDecodeError``; a worker took such a turn for a crash and retried it.)"""
    raw = bytearray(encode(data.draw(for_type(type_))))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    decodes_or_refuses(bytes(raw[:cut] if data.draw(st.booleans()) else raw), type_)
