"""Schedules in the schedules KV bucket: checked as they come in, read, paused, resumed,
deleted, and their ticks computed (:mod:`schemas.schedules` has the wire types).

Cron expressions are parsed by cronsim (five fields, or six with seconds first), in the
schedule's IANA time zone (:mod:`zoneinfo`; the ``tzdata`` package supplies the zones on
a machine without ``/usr/share/zoneinfo``)::

    schedule = new_schedule("acme", id="daily", cron="0 9 * * 1-5",
                            timezone="Europe/Paris", input="Summarise yesterday")  # ScheduleError
    store = ScheduleStore(kv, js, subjects, max_per_tenant=100)
    await store.create(schedule)  # Exists, TooMany
    tick = next_tick(schedule, after=time.time())

The schedulers (:mod:`loopmesh.scheduler`) fire the ticks; the gateway and ``loopmesh
schedules`` go through :class:`ScheduleStore`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TypeVar, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from cronsim import CronSim, CronSimError
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError

from schemas import DecodeError, Subjects, decode, encode, is_token, new_id
from schemas.schedules import (
    MAX_CATCH_UP_S,
    MAX_CRON_CHARS,
    MAX_INPUT_CHARS,
    OverlapPolicy,
    Schedule,
    ScheduleRun,
    ScheduleState,
    schedule_key,
    state_key,
)
from schemas.types import Priority

from .kv import KV, kv_entries
from .publisher import Publisher
from .retry import retry
from .settings import SchedulerSettings

POLICIES: tuple[OverlapPolicy, ...] = ("skip", "buffer_one", "allow")
#: Schedules of one tenant listed at most (``[scheduler] max_per_tenant`` caps how many
#: it may have).
MAX_SCHEDULES = 1_000

T = TypeVar("T")


class ScheduleError(ValueError):
    """A schedule that cannot be: ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"`{field}`: {message}")
        self.field = field
        self.message = message


# -- checks and ticks ----------------------------------------------------------------------


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; :class:`ScheduleError` (field ``timezone``) if none."""
    try:
        if len(name) > 64:
            raise ValueError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(
            "timezone", f"{name[:80]!r} is not an IANA time zone (such as UTC or Europe/Paris)"
        ) from None


def check_cron(cron: str, tz: ZoneInfo) -> str:
    """``cron``, checked: five fields (minute hour day-of-month month day-of-week) or six
    (seconds first), and a time it matches. :class:`ScheduleError` (field ``cron``)."""
    if len(cron) > MAX_CRON_CHARS:
        raise ScheduleError("cron", f"over {MAX_CRON_CHARS} characters")
    try:
        next(CronSim(cron, datetime.now(tz)))
    except (CronSimError, ValueError, LookupError, OverflowError) as exc:
        raise ScheduleError(
            "cron",
            f"{cron[:80]!r}: {exc} (five fields: minute hour day-of-month month "
            "day-of-week, or six with seconds first)",
        ) from None
    except StopIteration:
        raise ScheduleError("cron", f"{cron[:80]!r} matches no time") from None
    return cron


#: The day whose ticks :func:`shortest_gap` reads (the time fields tick alike every day).
_DAY = datetime(2000, 1, 1, tzinfo=UTC)
#: Days of a cron expression read at most to find two in a row.
_DAYS_READ = 400


def shortest_gap(cron: str, under: float) -> float | None:
    """The time between two consecutive ticks of ``cron`` (checked) when it can be under
    ``under`` seconds, else ``None``: the closest two of a day's ticks, and the last of a
    day and the first of the next when the expression has two days in a row. Measured in
    wall-clock time: a change of the clocks can bring two ticks closer once."""
    if under <= 1:
        return None  # cron's resolution: no two ticks are closer than a second
    fields = cron.split()
    days = fields[-3:]
    every_day = CronSim(" ".join([*fields[:-3], "*", "*", "*"]), _DAY - timedelta(seconds=1))
    last = None
    for at in every_day:  # a day's ticks, then the next day's first
        if last is not None:
            gap = (at - last).total_seconds()
            if gap < under and (at.day == last.day or _two_days_in_a_row(days)):
                return gap
        if at.day != _DAY.day:
            break
        last = at
    return None


def _two_days_in_a_row(days: list[str]) -> bool:
    """Whether the day fields (day-of-month month day-of-week) match two consecutive days
    within their first :data:`_DAYS_READ` days from 2000."""
    last = None
    for i, at in enumerate(CronSim(" ".join(["0", "0", *days]), _DAY - timedelta(seconds=1))):
        if last is not None and at - last == timedelta(days=1):
            return True
        if i >= _DAYS_READ:
            break
        last = at
    return False


def check_interval(cron: str, tenant: str, min_interval_s: float) -> None:
    """:class:`ScheduleError` (field ``cron``) when ``cron`` (checked) ticks closer than
    ``min_interval_s``, tenant ``tenant``'s ``min_schedule_interval_s``."""
    gap = shortest_gap(cron, min_interval_s)
    if gap is not None:
        raise ScheduleError(
            "cron",
            f"{cron[:80]!r} ticks {gap:g} s apart, more often than tenant {tenant}'s schedules "
            f'may ([tenants."{tenant}"], or else [tenants."*"], '
            f"min_schedule_interval_s = {min_interval_s:g})",
        )


def ticks(schedule: Schedule, after: float) -> Iterator[float]:
    """The schedule's ticks after ``after`` (seconds since the epoch), in order."""
    start = datetime.fromtimestamp(after, zone(schedule.timezone))
    for at in CronSim(schedule.cron, start):
        yield at.timestamp()


def next_tick(schedule: Schedule, after: float) -> float | None:
    """The schedule's first tick after ``after``, or ``None`` if it has none."""
    return next(ticks(schedule, after), None)


def explain(schedule: Schedule) -> str:
    """The cron expression in words ("At 09:00 on Monday through Friday")."""
    try:
        return str(CronSim(schedule.cron, datetime.now(zone(schedule.timezone))).explain())
    except Exception:  # explaining is a nicety: an expression it cannot word is still valid
        return ""


def new_schedule(
    tenant: str,
    *,
    cron: str,
    input: str,
    id: str | None = None,
    timezone: str = "UTC",
    agent: str = "default",
    session: str | None = None,
    policy: str = "skip",
    catch_up_s: float = 3600.0,
    priority: Priority = "batch",
    max_input_chars: int = MAX_INPUT_CHARS,
    min_interval_s: float = 0.0,
    now: float | None = None,
) -> Schedule:
    """A new schedule of ``tenant``, every field checked (``cron`` ticks at least
    ``min_interval_s`` apart, :func:`check_interval`); :class:`ScheduleError` names
    the first that is wrong. (That ``agent`` is defined is for the caller to check: it
    reads the agents bucket.)"""
    for field, value in (("id", id), ("agent", agent), ("session", session)):
        if value is not None and not is_token(value):
            raise ScheduleError(
                field, f"{value[:80]!r} must be 1-64 characters from A-Z a-z 0-9 _ -"
            )
    check_cron(cron, zone(timezone))
    check_interval(cron, tenant, min_interval_s)
    if not input.strip():
        raise ScheduleError("input", "must not be empty")
    limit = min(max_input_chars, MAX_INPUT_CHARS)
    if len(input) > limit:
        raise ScheduleError("input", f"{len(input)} characters, over the limit of {limit}")
    if policy not in POLICIES:
        raise ScheduleError("policy", f"{policy[:40]!r} is not one of {', '.join(POLICIES)}")
    if priority not in get_args(Priority):
        raise ScheduleError("priority", f"{priority[:40]!r} is not interactive or batch")
    if not 0 <= catch_up_s <= MAX_CATCH_UP_S:
        raise ScheduleError("catch_up_s", f"must be between 0 and {MAX_CATCH_UP_S:g} seconds")
    at = time.time() if now is None else now
    schedule = Schedule(
        id=id or new_id(), tenant=tenant, uid=new_id(), cron=cron, timezone=timezone,
        agent=agent, session=session, input=input, policy=policy,
        catch_up_s=catch_up_s, created_at=at, active_since=at, priority=priority,
    )  # fmt: skip
    try:  # what the schedulers will decode: a value the checks above let by is refused here
        decode(encode(schedule), Schedule)
    except DecodeError as exc:
        raise ScheduleError("schedule", str(exc)) from None
    return schedule


# -- the bucket ------------------------------------------------------------------------------


class Exists(Exception):
    """A schedule of that id exists already."""


class TooMany(Exception):
    """The tenant has as many schedules as ``[scheduler] max_per_tenant`` allows."""

    def __init__(self, tenant: str, count: int, limit: int) -> None:
        super().__init__(
            f"tenant {tenant} has {count} schedule(s), the most allowed ([scheduler] "
            f"max_per_tenant = {limit}): delete one first"
        )
        self.tenant = tenant
        self.count = count
        self.limit = limit


class ScheduleStore:
    """A tenant's schedules and their states in the schedules bucket: reads go to the
    leader on a cluster (:class:`~loopmesh.kv.KV`), writes are revision-checked. A tenant
    has at most ``max_per_tenant`` schedules (0: no limit; ``[scheduler]
    max_per_tenant``)."""

    def __init__(
        self,
        kv: KV,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        max_per_tenant: int = SchedulerSettings().max_per_tenant,
    ) -> None:
        self.kv = kv
        self.js = js
        self.subjects = subjects
        self.max_per_tenant = max_per_tenant

    async def create(self, schedule: Schedule) -> None:
        """Store ``schedule``; :class:`Exists` if its id is taken, :class:`TooMany` if its
        tenant has ``max_per_tenant`` schedules. The count is read before the write, so
        two creates at the same moment may both pass it: a tenant can end a few over."""
        key = schedule.key
        entry = await self.kv.entry(key)
        if entry is not None and entry.value is not None:
            raise Exists(schedule.id)
        if self.max_per_tenant:
            count = await self.count(schedule.tenant)
            if count >= self.max_per_tenant:
                raise TooMany(schedule.tenant, count, self.max_per_tenant)
        try:
            await self.kv.update(key, encode(schedule), last=entry.revision if entry else 0)
        except KeyWrongLastSequenceError:
            raise Exists(schedule.id) from None

    async def count(self, tenant: str) -> int:
        """How many schedules ``tenant`` has (``<tenant>.*``: not their ``.state`` keys)."""
        keys = await retry(
            lambda: kv_entries(
                self.js, self.subjects.schedules_bucket, f"{tenant}.*", headers_only=True
            ),
            f"count the schedules of {tenant}",
        )
        return len(keys)

    async def get(self, tenant: str, schedule: str) -> Schedule | None:
        entry = await self.kv.entry(schedule_key(tenant, schedule))
        return _decoded(entry.value if entry else None, Schedule)

    async def state(self, tenant: str, schedule: str) -> tuple[ScheduleState | None, int]:
        """The schedule's state and its revision (0: none yet)."""
        entry = await self.kv.entry(state_key(tenant, schedule))
        if entry is None:
            return None, 0
        return _decoded(entry.value, ScheduleState), entry.revision

    async def all(self, tenant: str) -> list[tuple[Schedule, ScheduleState | None]]:
        """The tenant's schedules, each with its state, by id."""
        entries = await retry(
            lambda: kv_entries(self.js, self.subjects.schedules_bucket, f"{tenant}.>"),
            f"list the schedules of {tenant}",
        )
        found: dict[str, Schedule] = {}
        states: dict[str, ScheduleState] = {}
        for key, entry in entries.items():
            parts = key.split(".")
            if len(parts) == 2:
                schedule = _decoded(entry.value, Schedule)
                if schedule is not None:
                    found[parts[1]] = schedule
            elif len(parts) == 3 and parts[2] == "state":
                state = _decoded(entry.value, ScheduleState)
                if state is not None:
                    states[parts[1]] = state
        return [(s, _current(states.get(i), s)) for i, s in sorted(found.items())[:MAX_SCHEDULES]]

    async def delete(self, tenant: str, schedule: str) -> bool:
        """Delete the schedule and its state; whether there was one."""
        deleted = False
        for key in (schedule_key(tenant, schedule), state_key(tenant, schedule)):
            while True:
                entry = await self.kv.entry(key)
                if entry is None or entry.value is None:
                    break
                try:
                    await self.kv.delete(key, last=entry.revision)
                except KeyWrongLastSequenceError:
                    continue  # a scheduler wrote meanwhile: read again
                deleted = deleted or key == schedule_key(tenant, schedule)
                break
        return deleted

    async def set_paused(
        self, tenant: str, schedule: str, paused: bool, *, now: float | None = None
    ) -> Schedule | None:
        """Pause or resume; the schedule as it now is (``None``: there is none). A resumed
        schedule fires from the next tick on: ticks of the pause are not caught up."""
        key = schedule_key(tenant, schedule)
        while True:
            entry = await self.kv.entry(key)
            current = _decoded(entry.value if entry else None, Schedule)
            if entry is None or current is None:
                return None
            if current.paused == paused:
                return current
            changed = msgspec.structs.replace(current, paused=paused)
            if not paused:
                at = time.time() if now is None else now
                changed = msgspec.structs.replace(changed, active_since=at)
            try:
                await self.kv.update(key, encode(changed), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return changed

    async def one(self, tenant: str, schedule: str) -> tuple[Schedule, ScheduleState | None] | None:
        found = await self.get(tenant, schedule)
        if found is None:
            return None
        state, _ = await self.state(tenant, schedule)
        return found, _current(state, found)


def _current(state: ScheduleState | None, schedule: Schedule) -> ScheduleState | None:
    """``state`` if it is this schedule's (not a deleted one's of the same id)."""
    return state if state is not None and state.uid == schedule.uid else None


def _decoded(value: bytes | None, type_: type[T]) -> T | None:
    if not value:
        return None
    try:
        return decode(value, type_)
    except DecodeError:
        return None


# -- what became of the runs -------------------------------------------------------------------


class _End(msgspec.Struct):
    turn_id: str = ""
    reason: str = ""


_end = msgspec.json.Decoder(_End).decode

#: ``loop_end`` events read at most to find what became of a schedule's runs.
MAX_ENDS_READ = 500


async def run_ends(
    publisher: Publisher, subjects: Subjects, tenant: str, runs: tuple[ScheduleRun, ...]
) -> dict[str, str]:
    """The ``loop_end`` reason of each published run that has ended, by turn id: read
    per session, from the stream of its partition, from the oldest run's ``events_seq``
    on (at most :data:`MAX_ENDS_READ` events)."""
    wanted: dict[str, set[str]] = {}
    start: dict[str, int] = {}
    for run in runs:
        if run.published and run.turn_id and run.session:
            wanted.setdefault(run.session, set()).add(run.turn_id)
            start[run.session] = min(start.get(run.session, run.events_seq), run.events_seq)
    ends: dict[str, str] = {}
    budget = MAX_ENDS_READ
    for session, turns in wanted.items():
        subject = subjects.event(tenant, session, "loop_end")
        stream = subjects.events_stream_of(tenant, session)
        seq = start[session] + 1
        while turns and budget > 0:
            found = await retry(
                lambda at=seq, on=subject, of=stream: publisher.next_msg(of, on, at),  # type: ignore[misc]
                f"loop ends of {tenant}.{session}",
            )
            if found is None:
                break
            budget -= 1
            seq = found[0] + 1
            try:
                end = _end(found[1])
            except msgspec.DecodeError:
                continue
            if end.turn_id in turns:
                ends[end.turn_id] = end.reason
                turns.discard(end.turn_id)
    return ends
