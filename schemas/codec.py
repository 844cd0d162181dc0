"""JSON encoding and decoding of wire types, with one encoder and one decoder per type."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type.

    ``.type_name`` names what was expected; the message says what was wrong, with the
    path of the bad field (msgspec's wording, e.g. ``Expected `str`, got `int` - at `$.id```).
    """

    def __init__(self, type_name: str, detail: str) -> None:
        self.type_name = type_name
        self.detail = detail
        super().__init__(f"invalid {type_name}: {detail}")


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    """The decoder for ``type_``, built on first use and kept."""
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    return dec


Data = bytes | bytearray | memoryview | str


@overload
def decode(data: Data, type_: type[T]) -> T: ...
@overload
def decode(data: Data, type_: Any) -> Any: ...


def decode(data: Data, type_: Any) -> Any:
    """Decode ``data`` as ``type_`` (a Struct or a union of them); raise :class:`DecodeError`."""
    try:
        return decoder(type_).decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError(_name(type_), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(_name(type_), f"malformed JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # a string with a pattern, not valid UTF-8
        raise DecodeError(_name(type_), f"malformed JSON: invalid UTF-8 ({exc.reason})") from None


def _name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_)
