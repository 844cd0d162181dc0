"""Hypothesis strategies for msgspec types, built from ``msgspec.inspect``.

Each field gets values its type constraints admit (a ``Token`` matches its pattern,
a ``Timestamp`` is >= 0), so every generated value is a valid message.
"""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi
from hypothesis import strategies as st

_INT64 = 2**63 - 1
_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-_INT64, _INT64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    _json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def for_type(type_: Any) -> st.SearchStrategy[Any]:
    """Valid values of ``type_``: a Struct, a union of Structs, or a field type."""
    return _from_info(mi.type_info(type_))


def _valid_or_none(cls: Any) -> Any:
    def build(**fields: Any) -> Any:
        try:
            return cls(**fields)
        except ValueError:
            return None

    return build


def _from_info(info: mi.Type) -> st.SearchStrategy[Any]:
    match info:
        case mi.Metadata(type=inner):
            return _from_info(inner)
        case mi.StrType(pattern=str() as pattern):
            return st.from_regex(pattern, fullmatch=True)
        case mi.StrType(min_length=low, max_length=high):
            return st.text(min_size=low or 0, max_size=min(40, high if high is not None else 40))
        case mi.BoolType():
            return st.booleans()
        case mi.IntType(ge=ge, gt=gt):
            low = ge if ge is not None else (gt + 1 if gt is not None else -_INT64)
            return st.integers(low, _INT64)
        case mi.FloatType(ge=ge, gt=gt):
            return st.floats(
                min_value=ge if gt is None else gt,
                exclude_min=gt is not None,
                allow_nan=False,
                allow_infinity=False,
            )
        case mi.NoneType():
            return st.none()
        case mi.AnyType():
            return json_values
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
        case mi.UnionType(types=types):
            return st.one_of([_from_info(t) for t in types])
        case mi.VarTupleType(item_type=item, min_length=low):
            return st.lists(_from_info(item), min_size=low or 0, max_size=max(3, low or 0)).map(
                tuple
            )
        case mi.ListType(item_type=item, min_length=low):
            return st.lists(_from_info(item), min_size=low or 0, max_size=max(3, low or 0))
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(_from_info(key), _from_info(value), max_size=3)
        case mi.StructType(cls=cls, fields=fields):
            # a Struct whose __post_init__ refuses a combination of valid fields
            # (FileRef: exactly one of two) raises ValueError: those draws are skipped
            return st.builds(
                _valid_or_none(cls), **{f.name: _from_info(f.type) for f in fields}
            ).filter(lambda value: value is not None)
    raise NotImplementedError(f"no strategy for {info!r}")
