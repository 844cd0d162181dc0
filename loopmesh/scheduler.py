"""The scheduler: every loop worker and gateway runs one, and each tick of each schedule
fires once across all of them (docs/ARCHITECTURE.md, "Schedules").

A tick is claimed by a revision-checked write of the schedule's state
(``<tenant>.<id>.state``) that moves ``last_tick`` to it: every scheduler reads the
state, and only the one whose write lands publishes the turn; the others' writes fail
on the revision, and their next read shows the tick taken. The claim records the run
(its turn id, derived from the schedule and the tick, and the overlap policy's verdict)
before the turn is published, and a second write marks it published. A run claimed by a
scheduler that died before that mark is published again by another (the same
``Nats-Msg-Id``: the turns stream drops it if the first copy got out).

Ticks come from the state, not from a process's memory: a tick missed while no
scheduler ran is fired when one comes back, if it is at most the schedule's
``catch_up_s`` old (older ones are recorded as one ``missed`` run)::

    async with Scheduler(nc, subjects, SchedulerSettings(), name="w1"):
        await stop.wait()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Self

import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

from schemas import DecodeError, Subjects, Turn, decode, encode
from schemas.schedules import (
    RUNS_KEPT,
    Schedule,
    ScheduleRun,
    ScheduleState,
    schedule_turn_id,
    state_key,
)

from .aio import raise_if_cancelled
from .backlog import unfinished
from .kv import open_kv
from .publisher import Publisher, acked
from .retry import retry
from .schedules import ScheduleStore, next_tick, ticks
from .settings import SchedulerSettings
from .watch import BucketWatch

log = logging.getLogger("loopmesh.scheduler")

#: Ticks a ``missed`` run counts at most (a schedule of every second, back after a week).
MAX_MISSED_COUNTED = 100_000
#: The catch-up window is never shorter than this: a scheduler a few seconds late (a
#: busy machine, a claim that took a while) has not missed the tick.
LATE_S = 10.0


class Gone(Exception):
    """The schedule was deleted, paused or replaced, or has no tick left."""


class Schedules(BucketWatch[Schedule]):
    """The active schedules, by key, kept current by a watch of the definitions' keys
    (``<tenant>.<id>``; the states' writes, one or two a tick, never reach it)."""

    what = "schedules"
    values_change = True  # a pause or a new cron is a change of the same key
    keys = "*.*"

    def decode(self, key: str, revision: int, value: bytes) -> Schedule | None:
        try:
            schedule = decode(value, Schedule)
        except DecodeError as exc:
            log.warning("unreadable schedule key=%s error=%s", key, exc)
            return None
        return schedule if schedule.key == key and not schedule.paused else None


class Scheduler:
    """Fires the ticks of every schedule in the bucket (see the module docstring).

    One task per schedule follows it. The schedules come from a watch of the bucket
    (:class:`Schedules`): a write of one schedule reaches every scheduler as that
    schedule, which starts, restarts or ends that schedule's task and reads nothing of
    the others. The scheduler owns its tasks: ``async with`` (or :meth:`start` and the
    idempotent :meth:`close`) bounds them."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: SchedulerSettings,
        *,
        name: str,
        publisher: Publisher | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.settings = settings
        self.name = name
        self._publisher = publisher
        self._own_publisher = publisher is None
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()
        self._following: dict[str, tuple[Schedule, asyncio.Task[None]]] = {}
        self.store: ScheduleStore | None = None
        self.ready = asyncio.Event()  # set once the schedules were first read
        self.claimed = 0  # ticks this scheduler won

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler")

    async def close(self) -> None:
        """Stop following the schedules. Idempotent."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_publisher and self._publisher is not None:
            await self._publisher.close()
            self._publisher = None

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(self.nc)
        return self._publisher

    # -- following the bucket --------------------------------------------------------------

    async def open(self) -> ScheduleStore:
        """Open the schedules bucket, waiting for it to be provisioned."""
        bucket = self.subjects.schedules_bucket
        warned = False
        while self.store is None:
            try:
                kv = await open_kv(self.js, self.publisher, bucket)
            except NotFoundError:
                raise_if_cancelled()
                if not warned:
                    log.warning("no bucket %s: nothing is scheduled until it is made", bucket)
                    warned = True
                await asyncio.sleep(self.settings.reload_s)
                continue
            self.store = ScheduleStore(
                kv, self.js, self.subjects, max_per_tenant=self.settings.max_per_tenant
            )
        return self.store

    async def _run(self) -> None:
        await self.open()
        watch = Schedules(
            self.nc, self.subjects.schedules_bucket, on_change=lambda _: self._dirty.set()
        )
        try:
            async with watch, asyncio.TaskGroup() as tg:
                while not watch.is_loaded:
                    try:
                        await watch.loaded()
                    except TimeoutError as exc:
                        log.warning("cannot read the schedules error=%s", exc)
                    raise_if_cancelled()
                while True:
                    self._dirty.clear()
                    self._follow_all(tg, {s.key: s for s in watch.items()})
                    self.ready.set()
                    await self._dirty.wait()
        finally:
            for _, task in self._following.values():
                task.cancel()
            self._following.clear()

    def _follow_all(self, tg: asyncio.TaskGroup, found: dict[str, Schedule]) -> None:
        """A task for each active schedule; the tasks of those gone, paused or changed
        end. A task that ended by itself (no tick left) is not started again until its
        schedule changes."""
        for key, (schedule, task) in list(self._following.items()):
            if found.get(key) != schedule:
                task.cancel()
                del self._following[key]
        for key, schedule in found.items():
            if key not in self._following:
                task = tg.create_task(self._follow(schedule), name=f"schedule {key}")
                self._following[key] = (schedule, task)

    async def _follow(self, schedule: Schedule) -> None:
        failures = 0
        while True:
            try:
                wait = await self.step(schedule)
                failures = 0
            except Gone:  # what became of it reaches the watch, which starts its next task
                return
            except Exception as exc:
                failures += 1
                wait = min(0.1 * 2**failures, self.settings.reload_s)
                log.warning("schedule %s: error=%r; again in %.1fs", schedule.key, exc, wait)
            raise_if_cancelled()  # nats-py may have swallowed a cancel
            if wait > 0:
                await asyncio.sleep(wait)

    # -- one schedule ------------------------------------------------------------------------

    async def step(self, schedule: Schedule) -> float:
        """Do what the schedule has due now (one write at most); the seconds until
        something may be due (0: look again at once)."""
        assert self.store is not None
        now = self._clock()
        state, revision = await self.store.state(schedule.tenant, schedule.id)
        if state is None or state.uid != schedule.uid:
            state = ScheduleState(uid=schedule.uid)  # none yet, or a deleted namesake's
        pending = next((r for r in state.runs if r.outcome == "fired" and not r.published), None)
        if pending is not None and now - pending.at >= self.settings.republish_after_s:
            await self._recover(schedule, pending, now)
            return 0.0
        if state.buffered is not None and not await self._busy(schedule, state):
            run = msgspec.structs.replace(state.buffered, outcome="fired", at=now)
            changed = msgspec.structs.replace(state, buffered=None, runs=_put(state.runs, run))
            if await self._write(schedule, changed, revision):
                await self._publish(schedule, run)
            return 0.0
        tick = next_tick(schedule, max(state.last_tick, schedule.active_since))
        if tick is None:
            raise Gone
        if tick > now:
            wait = tick - now
            if state.buffered is not None:
                wait = min(wait, self.settings.buffer_check_s)
            if pending is not None:
                wait = min(wait, self.settings.republish_after_s - (now - pending.at))
            return max(wait, 0.0)
        await self._still(schedule)
        if tick < now - max(schedule.catch_up_s, LATE_S):
            await self._write(schedule, self._missed(schedule, state, tick, now), revision)
            return 0.0
        run = await self._verdict(schedule, state, tick, now)
        changed = msgspec.structs.replace(state, last_tick=tick, runs=_put(state.runs, run))
        if run.outcome == "buffered":
            changed = msgspec.structs.replace(changed, buffered=run)
        if await self._write(schedule, changed, revision):
            self.claimed += 1
            log.info(
                "schedule tick claimed schedule=%s tick=%d outcome=%s turn=%s by=%s",
                schedule.key, tick, run.outcome, run.turn_id, self.name,
            )  # fmt: skip
            if run.outcome == "fired":
                await self._publish(schedule, run)
        return 0.0

    async def _verdict(
        self, schedule: Schedule, state: ScheduleState, tick: float, now: float
    ) -> ScheduleRun:
        """The run of ``tick`` as the overlap policy has it."""
        turn_id = schedule_turn_id(schedule, tick)
        session = schedule.session or turn_id
        fire = ScheduleRun(
            tick=tick, at=now, outcome="fired", turn_id=turn_id, session=session,
            events_seq=await self._events_seq(schedule.tenant, session),
        )  # fmt: skip
        if schedule.policy == "allow":
            return fire
        busy = await self._busy(schedule, state)
        if not busy:
            return fire
        skipped = ScheduleRun(tick=tick, at=now, outcome="skipped")
        if schedule.policy == "skip":
            return msgspec.structs.replace(skipped, reason=f"run {busy[0]} has not ended")
        if schedule.session is not None:  # buffer_one: the session queues one behind
            if len(busy) >= 2:
                return msgspec.structs.replace(
                    skipped, reason=f"run {busy[0]} runs and {busy[1]} waits"
                )
            return fire
        if state.buffered is not None:  # buffer_one, a session per run: held here
            return msgspec.structs.replace(
                skipped, reason=f"run {state.buffered.turn_id} waits already"
            )
        return msgspec.structs.replace(fire, outcome="buffered")

    async def _busy(self, schedule: Schedule, state: ScheduleState) -> list[str]:
        """The schedule's runs that have not ended, newest first: those not published yet
        (on their way), and those still in the turns stream with no ``loop_end``."""
        fired = [r for r in state.runs if r.outcome == "fired" and r.turn_id and r.session]
        if not fired:
            return []
        if schedule.session is None:
            fired = fired[:1]  # runs of their own sessions: the last one is the previous
        ids = {r.turn_id for r in fired}
        waiting = {r.turn_id for r in fired if not r.published}
        for session in {r.session for r in fired if r.published}:
            assert session is not None
            queued = await unfinished(self.publisher, self.subjects, schedule.tenant, session)
            waiting.update(q.turn_id for q in queued if q.turn_id in ids)
        return [r.turn_id for r in fired if r.turn_id in waiting]  # type: ignore[misc]

    def _missed(
        self, schedule: Schedule, state: ScheduleState, first: float, now: float
    ) -> ScheduleState:
        """The state with the ticks older than the catch-up window recorded as missed."""
        last, count = first, 0
        for tick in ticks(schedule, first - 1):
            if tick >= now - max(schedule.catch_up_s, LATE_S) or count >= MAX_MISSED_COUNTED:
                break
            last, count = tick, count + 1
        run = ScheduleRun(
            tick=first, at=now, outcome="missed", missed=count,
            reason=f"older than the catch-up window ({schedule.catch_up_s:g} s)",
        )  # fmt: skip
        log.warning("schedule %s missed %d ticks from %d", schedule.key, count, first)
        return msgspec.structs.replace(state, last_tick=last, runs=_put(state.runs, run))

    async def _still(self, schedule: Schedule) -> None:
        """Raise :class:`Gone` unless the schedule is as this task follows it (a pause,
        a delete or a new schedule of the same id ends the task before a tick)."""
        assert self.store is not None
        current = await self.store.get(schedule.tenant, schedule.id)
        if current != schedule:
            raise Gone

    async def _write(self, schedule: Schedule, state: ScheduleState, revision: int) -> bool:
        """Write the state if it is still at ``revision``: whether this scheduler won."""
        assert self.store is not None
        key = state_key(schedule.tenant, schedule.id)
        try:
            await self.store.kv.update(key, encode(state), last=revision)
        except KeyWrongLastSequenceError:
            return False  # another scheduler wrote first: the next read shows what
        return True

    # -- publishing -------------------------------------------------------------------------

    async def _events_seq(self, tenant: str, session: str) -> int:
        """The last sequence of the stream that holds the session's events (its
        partition's): the run's ``loop_end`` is looked for after it, in that stream
        (:func:`loopmesh.schedules.run_ends`)."""
        stream = self.subjects.events_stream_of(tenant, session)
        info = await retry(lambda: self.js.stream_info(stream), f"{stream} info")
        return int(info.state.last_seq)

    async def _publish(self, schedule: Schedule, run: ScheduleRun) -> None:
        """Publish the run's turn (deduplicated by its id), then mark the run published."""
        assert run.turn_id is not None and run.session is not None
        turn = Turn(
            id=run.turn_id, tenant=schedule.tenant, session=run.session, input=schedule.input,
            created_at=self._clock(), agent=schedule.agent, on_busy="enqueue",
            metadata={"schedule": schedule.id, "tick": str(int(run.tick))},
            priority=schedule.priority,
        )  # fmt: skip
        subject = self.subjects.turn(turn.tenant, turn.session, turn.priority)
        ack = await retry(
            lambda: acked(self.publisher, subject, encode(turn), {"Nats-Msg-Id": turn.msg_id}),
            f"publish the turn of schedule {schedule.key}",
        )
        await self._mark(schedule, run.turn_id, _published)
        log.info(
            "schedule turn published schedule=%s tick=%d turn=%s duplicate=%s by=%s",
            schedule.key, run.tick, run.turn_id, ack.duplicate, self.name,
        )  # fmt: skip

    async def _recover(self, schedule: Schedule, run: ScheduleRun, now: float) -> None:
        """A run claimed but not marked published: its scheduler stopped in between.
        Within ``republish_within_s`` of the claim it is published again (a copy that
        did get out is dropped by the duplicate window); later it is recorded as lost."""
        assert run.turn_id is not None
        if now - run.at <= self.settings.republish_within_s:
            log.warning("schedule %s: publishing run %s again", schedule.key, run.turn_id)
            await self._publish(schedule, run)
            return
        await self._mark(
            schedule, run.turn_id,
            lambda r: msgspec.structs.replace(
                r, outcome="lost", reason="its scheduler stopped before it was published"
            ),
        )  # fmt: skip

    async def _mark(
        self, schedule: Schedule, turn_id: str, change: Callable[[ScheduleRun], ScheduleRun]
    ) -> None:
        """Change the run of ``turn_id`` in the state, however many writes come between."""
        assert self.store is not None
        while True:
            state, revision = await self.store.state(schedule.tenant, schedule.id)
            if state is None or state.uid != schedule.uid:
                return
            runs = tuple(change(r) if r.turn_id == turn_id else r for r in state.runs)
            if runs == state.runs:
                return  # rolled off the history, or marked already
            if await self._write(schedule, msgspec.structs.replace(state, runs=runs), revision):
                return


def _published(run: ScheduleRun) -> ScheduleRun:
    return msgspec.structs.replace(run, published=True)


def _put(runs: tuple[ScheduleRun, ...], run: ScheduleRun) -> tuple[ScheduleRun, ...]:
    """``runs`` with ``run`` in: in the place of a run of the same turn, else first; the
    newest :data:`~schemas.schedules.RUNS_KEPT`."""
    if run.turn_id is not None and any(r.turn_id == run.turn_id for r in runs):
        return tuple(run if r.turn_id == run.turn_id else r for r in runs)
    return (run, *runs)[:RUNS_KEPT]
