"""Schedules: turns published on a cron expression, as the schedules KV bucket stores them.

The bucket (:attr:`~schemas.subjects.Subjects.schedules_bucket`) holds two keys per
schedule:

- ``<tenant>.<schedule>``: the :class:`Schedule`, what people write (create, pause,
  resume, delete);
- ``<tenant>.<schedule>.state``: its :class:`ScheduleState`, what the schedulers write
  with revision checks: the last tick handled, and the last runs.

A run's turn id, and the session of a schedule that makes a new session per run, derive
from (tenant, schedule, tick) (:func:`schedule_turn_id`): the scheduler that wins a tick
publishes the turn with that id as its ``Nats-Msg-Id``, so a second publish of the same
tick is dropped by the turns stream. The cron expression and the time zone are checked
by the runtime (``loopmesh/schedules.py``), which has the cron library.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

from .ids import check_token
from .keys import session_key
from .types import SCHEMA_VERSION, Priority, Timestamp, Token

#: What a tick does while the schedule's previous run has not ended: ``skip`` it,
#: ``buffer_one`` (keep at most one run waiting behind the running one), or ``allow``
#: (fire anyway: runs queue in the session, or run at once with a session per run).
OverlapPolicy = Literal["skip", "buffer_one", "allow"]

#: What became of a tick: ``fired`` (its turn was published), ``skipped`` (the overlap
#: policy said no), ``buffered`` (waiting for the previous run, ``buffer_one`` with a
#: session per run), ``missed`` (older than the catch-up window when a scheduler came
#: back; ``missed`` counts them) or ``lost`` (claimed by a scheduler that stopped before
#: it said the turn was published, and not published again in time: it may have run).
RunOutcome = Literal["fired", "skipped", "buffered", "missed", "lost"]

MAX_INPUT_CHARS = 100_000
MAX_CRON_CHARS = 200
#: Runs a schedule's state keeps, newest first.
RUNS_KEPT = 20
#: The longest catch-up window: a week.
MAX_CATCH_UP_S = 7 * 24 * 3600.0

CronText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CRON_CHARS)]
ZoneName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class Schedule(msgspec.Struct, frozen=True, kw_only=True):
    """One schedule, stored under ``<tenant>.<id>``.

    ``cron``: five fields (minute hour day-of-month month day-of-week) or six, seconds
    first; ``timezone``: an IANA name the ticks are computed in. ``session``: the
    session every run goes to, or ``None`` for a new session per run. ``active_since``:
    ticks after this count (its creation, or its last resume: ticks of a pause are not
    caught up). ``uid`` tells two schedules of the same id apart (one deleted, another
    made), so their runs' ids differ. ``catch_up_s``: a tick missed while no scheduler
    ran is fired when one comes back if it is at most this old (10 s at least: a
    scheduler a few seconds late has not missed it); older ones are recorded as ``missed``.
    """

    v: int = SCHEMA_VERSION
    id: Token
    tenant: Token
    uid: Token
    cron: CronText
    timezone: ZoneName = "UTC"
    agent: Token = "default"
    session: Token | None = None
    input: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_INPUT_CHARS)]
    policy: OverlapPolicy = "skip"
    catch_up_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_CATCH_UP_S)] = 3600.0
    paused: bool = False
    created_at: Timestamp = 0.0
    active_since: Timestamp = 0.0
    #: The lane of its runs' turns (:attr:`schemas.Turn.priority`): batch unless the
    #: schedule says otherwise.
    priority: Priority = "batch"

    @property
    def key(self) -> str:
        return schedule_key(self.tenant, self.id)


class ScheduleRun(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tick as a scheduler handled it. ``tick``: the cron time (seconds since the
    epoch); ``at``: when it was handled. A ``fired`` or ``buffered`` run names its turn
    and session; ``published`` is set once the turns stream has the turn, and
    ``events_seq`` is the events stream's last sequence just before (its ``loop_end``
    comes after). ``reason`` says why a tick was skipped; ``missed``, how many ticks a
    ``missed`` run stands for."""

    tick: Timestamp
    at: Timestamp
    outcome: RunOutcome
    turn_id: Token | None = None
    session: Token | None = None
    published: bool = False
    events_seq: int = 0
    reason: str = ""
    missed: int = 0


class ScheduleState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the schedulers keep of a schedule, under ``<tenant>.<id>.state``, written
    only with revision checks: the winner of a tick is whoever moves ``last_tick`` to it.
    ``runs``: the last :data:`RUNS_KEPT`, newest first; ``buffered``: a run waiting for
    the previous one to end (``buffer_one`` with a session per run)."""

    uid: Token
    last_tick: Timestamp = 0.0
    runs: tuple[ScheduleRun, ...] = ()
    buffered: ScheduleRun | None = None


def schedule_key(tenant: str, schedule: str) -> str:
    """The key of a schedule: ``<tenant>.<schedule>``."""
    return session_key(tenant, check_token(schedule, "schedule"))


def state_key(tenant: str, schedule: str) -> str:
    """The key of a schedule's state: ``<tenant>.<schedule>.state``."""
    return f"{schedule_key(tenant, schedule)}.state"


def schedule_turn_id(schedule: Schedule, tick: float) -> str:
    """The id of the turn a schedule runs at ``tick`` (and of its session, with a session
    per run): ``<schedule id, cut to 36>-<tick>-<8 hex of blake2s over tenant, id, uid>``,
    a token of at most 56 characters."""
    scope = f"{schedule.tenant}.{schedule.id}.{schedule.uid}".encode()
    digest = hashlib.blake2s(scope, digest_size=4).hexdigest()
    return f"{schedule.id[:36]}-{int(tick)}-{digest}"
