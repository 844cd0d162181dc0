"""Telling a publisher why its turn or control was refused.

:mod:`schemas.admit` decides; this module reports. A refused message whose subject
names a valid tenant and session gets an ``error`` event on that session's events
subject (the publisher's own: the subject is what it was allowed to publish to), with
the refusal's code and a message saying what was wrong. A refused turn also gets a
``loop_end`` (reason ``error``), so a client waiting for its turn to end (``loopmesh
run``) stops waiting. The events carry the body's turn id when it could be read, else
``unknown``.

Their ``Nats-Msg-Id`` is ``<tenant>.<session>.<turn>:refused:<ref>:<type>``, where
``<ref>`` is the turn's stream sequence (a redelivered refusal is deduplicated) or a
fresh id for a control (core NATS delivers it once).
"""

from __future__ import annotations

import logging
import time

from loopmesh.jetstream import Publisher, acked, retry
from schemas import Subjects, encode, turn_msg_id
from schemas.admit import Refused
from schemas.events import EndReason, Error, Event, LoopEnd

log = logging.getLogger("loopmesh.loop_worker.refusals")

UNKNOWN_TURN = "unknown"


async def report(
    publisher: Publisher,
    subjects: Subjects,
    refused: Refused,
    *,
    what: str,
    ref: str,
    reason: EndReason = "error",
) -> bool:
    """Publish the events of a refused ``what`` ("turn" or "control"); False when its
    subject names nobody to tell (the refusal is only logged). A turn's ``loop_end``
    has ``reason``."""
    log.warning(
        "refused a %s code=%s tenant=%s session=%s turn=%s: %s",
        what, refused.code, refused.tenant, refused.session, refused.turn_id, refused.message,
    )  # fmt: skip
    tenant, session = refused.tenant, refused.session
    if tenant is None or session is None:
        return False
    turn_id = refused.turn_id or UNKNOWN_TURN
    now = time.time()
    events: list[Event] = [
        Error(
            tenant=tenant, session=session, turn_id=turn_id, ts=now, code=refused.code,
            message=f"{what} refused: {refused.message}", fatal=what == "turn",
        )
    ]  # fmt: skip
    if what == "turn":
        events.append(
            LoopEnd(
                tenant=tenant, session=session, turn_id=turn_id, ts=now, reason=reason,
                error=f"{refused.code}: {refused.message}",
            )
        )  # fmt: skip
    base = f"{turn_msg_id(tenant, session, turn_id)}:refused:{ref}"
    for event in events:
        subject = subjects.event(tenant, session, event.type)
        headers = {"Nats-Msg-Id": f"{base}:{event.type}"}
        payload = encode(event)
        await retry(
            lambda: acked(publisher, subject, payload, headers),  # noqa: B023 (awaited here)
            f"report a refused {what} on {subject}",
        )
    return True
