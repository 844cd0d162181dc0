"""The keys of loopmesh's KV buckets: a session's, its controls', a tool's in the
catalog. Every id is checked before it becomes part of a key."""

from __future__ import annotations

import functools

from .ids import check_token


@functools.lru_cache(maxsize=16_384)
def session_key(tenant: str, session: str) -> str:  # a turn builds it a dozen times
    """The KV key of a session: ``<tenant>.<session>``."""
    return f"{check_token(tenant, 'tenant')}.{check_token(session, 'session')}"


#: Set on a control message whose sender already recorded it in the control bucket.
CONTROL_RECORDED_HEADER = "Loopmesh-Recorded"


def session_meta_key(tenant: str, session: str) -> str:
    """The sessions-bucket key of a session's metadata (title, labels: what a person set,
    kept apart from the snapshot the loop workers write): ``<tenant>.<session>.meta``."""
    return f"{session_key(tenant, session)}.meta"


def approval_key(tenant: str, session: str, call_id: str) -> str:
    """The control-bucket key of an approval decision:
    ``<tenant>.<session>.approval.<call_id>`` (a cancel, pause or resume is recorded under
    :func:`turn_control_key` when it names a turn, else :func:`session_key`)."""
    return f"{session_key(tenant, session)}.approval.{check_token(call_id, 'call')}"


def turn_admit_key(tenant: str, session: str, turn_id: str) -> str:
    """The control-bucket key that says whether a turn of a tenant with ``[tenants]
    max_backlog`` runs or was refused: ``<tenant>.<session>.admit.<turn_id>``
    (:mod:`loop_worker.backlog_guard`)."""
    return f"{session_key(tenant, session)}.admit.{check_token(turn_id, 'turn')}"


def turn_control_key(tenant: str, session: str, turn_id: str) -> str:
    """The control-bucket key of a cancel, pause or resume naming one turn:
    ``<tenant>.<session>.turn.<turn_id>``, beside the session's own key, so that it
    replaces neither another turn's nor a session-wide one."""
    return f"{session_key(tenant, session)}.turn.{check_token(turn_id, 'turn')}"


def catalog_key(server: str, tool: str) -> str:
    return f"{check_token(server, 'server')}.{check_token(tool, 'tool')}"
