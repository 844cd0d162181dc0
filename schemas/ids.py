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

    def __init__(self, kind: str, value: object, form: str | None = None) -> None:
        self.kind = kind
        self.value = value
        if form is None:
            super().__init__(
                f"invalid {kind} id {value!r}: must be 1-64 characters from A-Z a-z 0-9 _ -"
            )
        else:
            super().__init__(f"invalid {kind} {value!r}: must be {form}")


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


@functools.lru_cache(maxsize=16_384)  # the event sink keys every event by it
def turn_msg_id(tenant: str, session: str, turn_id: str) -> str:
    """The ``Nats-Msg-Id`` of a turn, and the key of everything derived from it:
    ``<tenant>.<session>.<turn>``.

    The turns stream deduplicates on ``Nats-Msg-Id`` across all its subjects, so a bare
    turn id would let one tenant's turn ``t1`` swallow another's. Tokens hold no ``.``,
    so no two (tenant, session, turn) triples share this id.
    """
    check_token(tenant, "tenant")
    check_token(session, "session")
    return f"{tenant}.{session}.{check_token(turn_id, 'turn')}"


def check_turn_msg_id(key: str) -> str:
    """Return ``key`` if it has the form of :func:`turn_msg_id`, else raise
    :class:`InvalidIdError`: code keyed by turn catches a bare turn id here."""
    parts = key.split(".") if isinstance(key, str) else ()
    if len(parts) != 3 or not all(is_token(p) for p in parts):
        raise InvalidIdError("turn key", key, "<tenant>.<session>.<turn id> (Turn.msg_id)")
    return key


_SCOPE_HEX = 24  # 96 bits of blake2s over tenant, session and turn


def call_id(tenant: str, session: str, turn_id: str, iteration: int, index: int) -> str:
    """The deterministic id of a tool call: a replayed iteration gets the same ids.

    It is the call's ``Nats-Msg-Id``, its effect record's key and the root of its
    events' ids, so it carries its tenant and session: ``<turn>-<iteration>-<index>-<h>``
    where ``h`` hashes ``<tenant>.<session>.<turn>`` (the turn part is cut short when
    the whole would pass 64 characters; the hash covers it whole). Two tenants'
    turns ``t1`` get different call ids.
    """
    scope = _scope(tenant, session, turn_id)
    suffix = f"-{iteration}-{index}-{scope}"
    room = 64 - len(suffix)
    if room < 1:  # an absurd iteration count: hash it all
        raw = f"{scope}-{iteration}-{index}".encode()
        return f"c{hashlib.blake2s(raw, digest_size=16).hexdigest()}"
    return f"{turn_id[:room]}{suffix}"


def _scope(tenant: str, session: str, turn_id: str) -> str:
    key = turn_msg_id(tenant, session, turn_id).encode()
    return hashlib.blake2s(key, digest_size=_SCOPE_HEX // 2).hexdigest()


_CALL_ID = re.compile(r"-([0-9]+)-([0-9a-f]{24})\Z")


def check_call_id(value: str, tenant: str, session: str, turn_id: str, iteration: int) -> int:
    """Return the index of call id ``value`` if it is :func:`call_id` of this tenant,
    session, turn and iteration, else raise :class:`InvalidIdError` saying what differs.

    The index is read from the id (the digits before the hash) and the id made again
    from it; only an exact match passes. A call id keys the effect record, so a request
    whose id is another turn's would be answered with that turn's result (or record
    over it): the tool worker refuses it with this check.

    The long ``c<hash>`` form is refused: it hides the index, so it cannot be checked
    without guessing one. :func:`call_id` makes it only when the iteration and the index
    have 37 decimal digits between them; a loop counts its LLM calls and a completion's
    tool calls from zero, so none gets near. Negative indexes are refused too (a
    completion's calls are numbered from 0).
    """
    check_token(value, "call id")
    match = _CALL_ID.search(value)
    if match is None:
        raise InvalidIdError(
            "call id",
            value,
            "<turn>-<iteration>-<index>-<24 hex scope hash> as schemas.call_id makes it "
            "(its long c<hash> form cannot be checked)",
        )
    if match[2] != _scope(tenant, session, turn_id):
        raise InvalidIdError(
            "call id",
            value,
            f"a call id of tenant {tenant!r}, session {session!r}, turn {turn_id!r} "
            "(its scope hash is another turn's)",
        )
    index = int(match[1])
    expected = call_id(tenant, session, turn_id, iteration, index)
    if value != expected:
        raise InvalidIdError(
            "call id",
            value,
            f"{expected!r} (turn {turn_id!r}, iteration {iteration}, index {index})",
        )
    return index
