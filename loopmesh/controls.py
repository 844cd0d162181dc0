"""Sending a control (cancel, pause, resume, an approval decision) to a session's turn.

A control goes over core NATS to every loop worker, for speed, and is recorded in the
control bucket so that a turn that starts or resumes later still sees it
(``loop_worker/controls.py`` is the receiving side). :func:`send_control` records it
first, then publishes it marked ``Loopmesh-Recorded``, so the workers do not record it
again::

    await send_control(nc, Subjects("loopmesh"), Cancel(tenant="acme", session="s1"))
"""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client
from nats.js.kv import KeyValue

from schemas import ApprovalDecision, Control, Subjects, encode, session_key
from schemas.keys import CONTROL_RECORDED_HEADER, approval_key, turn_control_key

from .retry import retry


def control_key(control: Control) -> str:
    """Its key in the control bucket: its own for an approval decision; for a cancel,
    pause or resume, its turn's when it names one (an interrupt does), else the
    session's. Under each key the last one counts, so a control naming one turn
    replaces neither another turn's nor a session-wide one."""
    if isinstance(control, ApprovalDecision):
        return approval_key(control.tenant, control.session, control.call_id)
    if control.turn_id is not None:
        return turn_control_key(control.tenant, control.session, control.turn_id)
    return session_key(control.tenant, control.session)


async def record(kv: KeyValue, control: Control) -> None:
    """Put ``control`` in the control bucket under :func:`control_key`."""
    key = control_key(control)
    await retry(lambda: kv.put(key, encode(control)), f"record control {key}")


async def send_control(
    nc: Client,
    subjects: Subjects,
    control: Control,
    *,
    kv: KeyValue | None = None,
    flush: bool = True,
) -> None:
    """Record ``control`` (stamped with the time if it has none) in the control bucket
    (``kv``, if open already), then publish it to the session's control subject; with
    ``flush``, return once the server has it."""
    if not control.at:
        control = msgspec.structs.replace(control, at=time.time())
    if kv is None:
        kv = await nc.jetstream().key_value(subjects.control_bucket)
    await record(kv, control)
    await nc.publish(
        subjects.control(control.tenant, control.session),
        encode(control),
        headers={CONTROL_RECORDED_HEADER: "1"},
    )
    if flush:
        await nc.flush()
