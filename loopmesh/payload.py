"""Messages that would not fit in one NATS message are cut to fit, never dropped.

nats-server refuses a message larger than its ``max_payload`` (1 MiB by default; the
client learns it on connect, ``nc.max_payload``), and nats-py raises before sending it.
A tool result, a model reply or a snapshot larger than that would otherwise fail its
publish every time: a tool call handed back and re-run until it is given up on, a turn
that can never checkpoint. So before publishing such a message a service passes it
through :func:`fit`: the longest text in it is cut, with a marker saying how much was
kept, until the encoded message fits; the caller then says so in a ``payload_truncated``
event (:class:`schemas.events.PayloadTruncated`).

Cutting keeps exactly-once: the tool worker records the cut result as the call's
effect, so a repeat of the call is answered with the very same text.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from schemas import encode

T = TypeVar("T")

#: Bytes kept free below ``max_payload`` for the message's headers (``Nats-Msg-Id`` and
#: the like): the server counts headers and payload together.
HEADROOM = 2048
#: The smallest limit :func:`limit_of` returns, whatever the server says.
MIN_LIMIT = 4096

_SHORT = 256  # texts this short are never cut (ids, names, codes)
_MARKER = (
    "\n[cut by loopmesh: {kept} of {size} bytes kept; the whole did not fit in one NATS message]"
)


class DoesNotFit(ValueError):
    """Nothing left to cut, and the message is still larger than ``limit``."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes cannot be cut to {limit} bytes")
        self.size = size
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Fitted(Generic[T]):
    """``value`` and its encoding; ``size`` the encoding's bytes before cutting, ``cut``
    the paths of the texts cut (empty when the message fitted as it was)."""

    value: T
    data: bytes
    size: int
    cut: tuple[str, ...] = ()


def limit_of(nc: Any) -> int:
    """The largest message body to publish on ``nc``: its ``max_payload`` less headroom."""
    return max(MIN_LIMIT, int(nc.max_payload) - HEADROOM)


def fit(
    value: T,
    limit: int,
    *,
    keys: Collection[str] | None = None,
    json_keys: Collection[str] = (),
) -> Fitted[T]:
    """``value`` itself when its encoding fits in ``limit`` bytes, else a copy whose
    longest texts (of more than 256 characters: never an id) are cut, each with a
    marker, until it does. ``keys``: only texts under
    these field names may be cut (None: any text). A text under one of ``json_keys``
    holds JSON (a tool call's arguments) and stays JSON: it becomes
    ``{"cut_by_loopmesh": "<marker>", "start": "<the text's start>"}``. Raises
    :class:`DoesNotFit`."""
    data = encode(value)
    size = len(data)
    if size <= limit:
        return Fitted(value, data, size)
    tree = _mutable(msgspec.to_builtins(value))
    originals: dict[tuple[int, Any], tuple[str, int]] = {}  # text, characters kept
    exhausted: set[tuple[int, Any]] = set()
    paths: list[str] = []
    while len(data) > limit:
        found = _longest(tree, keys, exhausted, "")
        if found is None:
            raise DoesNotFit(size, limit)
        container, key, path = found
        ident = (id(container), key)
        if ident not in originals:
            originals[ident] = (container[key], len(container[key]))
            paths.append(path)
        original, kept = originals[ident]
        body = original[:kept]
        per_char = max(1.0, (len(msgspec.json.encode(body)) - 2) / max(1, len(body)))
        over = len(data) - limit + len(_MARKER) + 40
        kept = max(0, kept - math.ceil(over / per_char))
        if kept == 0:
            exhausted.add(ident)
        originals[ident] = (original, kept)
        marker = _MARKER.format(kept=len(original[:kept].encode()), size=len(original.encode()))
        if key in json_keys:
            cut = {"cut_by_loopmesh": marker.strip(), "start": original[:kept]}
            container[key] = msgspec.json.encode(cut).decode()
        else:
            container[key] = original[:kept] + marker
        data = msgspec.json.encode(tree)
    fitted: T = msgspec.convert(tree, type(value))
    return Fitted(fitted, encode(fitted), size, tuple(paths))


def _mutable(node: Any) -> Any:
    """``msgspec.to_builtins``' output with its tuples as lists, so texts can be replaced."""
    if isinstance(node, dict):
        return {k: _mutable(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_mutable(v) for v in node]
    return node


def _longest(
    tree: Any, keys: Collection[str] | None, exhausted: set[tuple[int, Any]], path: str
) -> tuple[Any, Any, str] | None:
    """The container, key and path of the longest text that can still be cut."""
    best: tuple[Any, Any, str] | None = None
    best_len = -1
    stack: list[tuple[Any, str]] = [(tree, path)]
    while stack:
        node, where = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            here = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            if isinstance(child, dict | list):
                stack.append((child, here))
            elif (
                isinstance(child, str)
                and len(child) > _SHORT
                and (keys is None or key in keys)
                and (id(node), key) not in exhausted
                and len(child) > best_len
            ):
                best, best_len = (node, key, here.lstrip(".")), len(child)
    return best
