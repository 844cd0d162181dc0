"""Identifier tokens.

Tenant, session, turn, pool, server and tool identifiers become NATS subject tokens and
KV keys, so each must match ``[A-Za-z0-9_-]{1,64}``. A ``.``, ``*``, ``>`` or a space
would change what a subject means; such an id is refused here, never turned into one.
"""

from __future__ import annotations

import functools
import hashlib
import re
import uuid

TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_TOKEN = re.compile(TOKEN_PATTERN)
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class InvalidIdError(ValueError):
    """An identifier that cannot be a subject token. Carries ``.kind`` and ``.value``."""

    def __init__(self, kind: str, value: object) -> None:
        self.kind = kind
        self.value = value
        super().__init__(
            f"invalid {kind} id {value!r}: must be 1-64 characters from A-Z a-z 0-9 _ -"
        )


@functools.lru_cache(maxsize=16_384)
def _valid(value: str) -> bool:  # ids recur: a session's id is checked a dozen times a turn
    return _TOKEN.fullmatch(value) is not None


def check_token(value: str, kind: str = "id") -> str:
    """Return ``value`` if it is a valid token, else raise :class:`InvalidIdError`."""
    if not isinstance(value, str) or not _valid(value):
        raise InvalidIdError(kind, value)
    return value


def is_token(value: str) -> bool:
    return isinstance(value, str) and _valid(value)


def safe_token(name: str) -> str:
    """Map any name (an MCP tool name, say) to a stable valid token.

    Names that are already tokens are returned unchanged. Others have each unsafe
    character replaced by ``_`` and, so that two names never collide, a short hash of
    the original appended; the result is at most 64 characters.
    """
    if is_token(name):
        return name
    digest = hashlib.blake2s(name.encode(), digest_size=4).hexdigest()
    base = _UNSAFE.sub("_", name)[: 64 - 9] or "x"
    return f"{base}_{digest}"


def new_id() -> str:
    """A fresh random token (32 hex characters)."""
    return uuid.uuid4().hex


def call_id(turn_id: str, iteration: int, index: int) -> str:
    """The deterministic id of a tool call: a replayed iteration gets the same ids.

    Turn ids may be up to 64 characters, so the suffix is folded into a hash when the
    joined form would be too long.
    """
    raw = f"{turn_id}-{iteration}-{index}"
    if len(raw) <= 64:
        return raw
    digest = hashlib.blake2s(raw.encode(), digest_size=16).hexdigest()
    return f"c{digest}"
