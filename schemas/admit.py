"""Admission: the subject a turn or control arrived on is authoritative.

NATS grants permissions by subject, so a message is trusted only for the tenant and
session its subject names. :func:`admit_turn` and :func:`admit_control` decode a
message and refuse it (:class:`Refused`) when:

- ``invalid_subject``: the subject names no valid tenant and session (nobody to tell);
- ``unsupported_version``: its ``v`` is newer than :data:`SCHEMA_VERSION` (or below 1);
- ``invalid_message``: it is not JSON, or not a valid turn / control (missing fields,
  an id that is no token, a wrong type): the decoder's message says which field;
- ``subject_mismatch``: its ``tenant`` or ``session`` differs from the subject's (both
  are required in the body, so a turn or control stays self-describing wherever it is
  stored), or a turn's ``priority`` differs from its subject's lane;
- ``invalid_msg_id``: a turn published with a ``Nats-Msg-Id`` other than
  ``<tenant>.<session>.<id>`` (:func:`schemas.ids.turn_msg_id`). The turns stream
  deduplicates on that header across all tenants, so a bare turn id could make one
  tenant's turn swallow another's. A turn published without the header is admitted
  (it is simply not deduplicated).

A refusal carries the subject's tenant and session (``None`` for ``invalid_subject``)
and the message's turn id when it could be read, so the service can publish an
``error`` event where the publisher listens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .codec import DecodeError, decode
from .ids import InvalidIdError, is_token
from .subjects import Subjects
from .types import SCHEMA_VERSION
from .wire import Control, Turn


class Refused(Exception):
    """A message that will not be acted on. Carries ``.code``, ``.message`` (what was
    wrong, for a person), ``.tenant`` and ``.session`` (from the subject, ``None``
    when it names none) and ``.turn_id`` (the body's, when readable)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        tenant: str | None = None,
        session: str | None = None,
        turn_id: str | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.tenant = tenant
        self.session = session
        self.turn_id = turn_id


def admit_turn(subjects: Subjects, subject: str, data: bytes, msg_id: str | None = None) -> Turn:
    """The turn in ``data`` delivered on ``subject`` with ``Nats-Msg-Id`` ``msg_id``;
    raise :class:`Refused` unless the subject vouches for it."""
    try:
        tenant, session, priority = subjects.turn_lane(subject)
    except InvalidIdError as exc:
        raise Refused("invalid_subject", str(exc)) from None
    try:
        turn = decode(data, Turn)
    except DecodeError as exc:
        raise _undecodable(exc, data, "turn", "id", tenant, session) from None
    _check(turn.v, turn.tenant, turn.session, tenant, session, "turn", turn.id)
    if turn.priority != priority:
        raise Refused(
            "subject_mismatch",
            f"the turn's priority is {turn.priority!r} but it was published to the "
            f"{priority} lane ({subject}): publish it to "
            f"{subjects.turn(tenant, session, turn.priority)}",
            tenant=tenant,
            session=session,
            turn_id=turn.id,
        )
    if msg_id is not None and msg_id != turn.msg_id:
        raise Refused(
            "invalid_msg_id",
            f"the turn was published with Nats-Msg-Id {msg_id!r}; publish it with "
            f"{turn.msg_id!r} (<tenant>.<session>.<turn id>)",
            tenant=tenant,
            session=session,
            turn_id=turn.id,
        )
    return turn


def admit_control(subjects: Subjects, subject: str, data: bytes) -> Control:
    """The control message in ``data`` delivered on ``subject``; raise :class:`Refused`
    unless the subject vouches for it."""
    try:
        tenant, session = subjects.control_session(subject)
    except InvalidIdError as exc:
        raise Refused("invalid_subject", str(exc)) from None
    try:
        control: Control = decode(data, Control)
    except DecodeError as exc:
        raise _undecodable(exc, data, "control", "turn_id", tenant, session) from None
    _check(control.v, control.tenant, control.session, tenant, session, "control", control.turn_id)
    return control


def _check(
    v: int,
    body_tenant: str,
    body_session: str,
    tenant: str,
    session: str,
    what: str,
    turn_id: str | None,
) -> None:
    where = {"tenant": tenant, "session": session, "turn_id": turn_id}
    if not 1 <= v <= SCHEMA_VERSION:
        raise Refused("unsupported_version", _version_message(what, v), **where)
    if (body_tenant, body_session) != (tenant, session):
        raise Refused(
            "subject_mismatch",
            f"the {what} names tenant {body_tenant!r} session {body_session!r} but was "
            f"published to tenant {tenant!r} session {session!r}: a {what} may only act on "
            "the session its subject names",
            **where,
        )


def _version_message(what: str, v: object) -> str:
    return (
        f"the {what} has schema version {v!r}; this worker reads schema versions 1 "
        f"to {SCHEMA_VERSION}: upgrade the workers or publish version {SCHEMA_VERSION}"
    )


def _undecodable(
    exc: DecodeError, data: bytes, what: str, id_field: str, tenant: str, session: str
) -> Refused:
    """Why a body did not decode. A version newer than ours says more than the field
    it trips on, so it is reported first when the body is a JSON object that has one."""
    body: Any = None
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        pass
    turn_id = None
    if isinstance(body, dict):
        candidate = body.get(id_field)
        turn_id = candidate if isinstance(candidate, str) and is_token(candidate) else None
        v = body.get("v")
        if isinstance(v, int) and not isinstance(v, bool) and v > SCHEMA_VERSION:
            return Refused(
                "unsupported_version",
                _version_message(what, v),
                tenant=tenant,
                session=session,
                turn_id=turn_id,
            )
    return Refused(
        "invalid_message",
        f"not a valid {what}: {exc.detail}",
        tenant=tenant,
        session=session,
        turn_id=turn_id,
    )
