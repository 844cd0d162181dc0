"""The scheduler's claim of a tick and its overlap policies, on a real nats-server. Each
test drives schedulers step by step on a clock of its own (no loop worker runs: a
published turn stays in the turns stream, unfinished until a ``loop_end`` says it ended),
and one lets them run on their own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from loopmesh.scheduler import Gone, Scheduler
from loopmesh.schedules import new_schedule
from loopmesh.settings import SchedulerSettings
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short, wait_for
from schemas import Turn, decode, encode
from schemas.events import LoopEnd
from schemas.schedules import Schedule, ScheduleRun, ScheduleState, schedule_turn_id, state_key

T0 = float(int(time.time()))


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def env(nats_server) -> AsyncIterator[Env]:
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    env = Env(nc)
    try:
        yield env
    finally:
        for s in env.schedulers:
            await s.close()
        await nc.close()


class Env:
    def __init__(self, nc) -> None:
        self.nc = nc
        self.clock = Clock()
        self.schedulers: list[Scheduler] = []

    async def scheduler(self, name: str, **settings) -> Scheduler:
        s = Scheduler(self.nc, SUBJECTS, SchedulerSettings(**settings), name=name, clock=self.clock)
        await s.open()
        self.schedulers.append(s)
        return s

    async def schedule(self, **fields) -> Schedule:
        values = {"cron": "* * * * * *", "input": "tick", "now": T0, "id": "every", **fields}
        schedule = new_schedule("acme", **values)
        await self.schedulers[0].store.create(schedule)
        return schedule

    async def at(self, seconds: float, schedule: Schedule) -> None:
        """Move the clock to ``T0 + seconds``; every scheduler steps until none has
        anything due."""
        self.clock.now = T0 + seconds
        while True:
            waits = await asyncio.gather(*(s.step(schedule) for s in self.schedulers))
            if all(w > 0 for w in waits):
                return

    async def state(self, schedule: Schedule) -> ScheduleState:
        state, _ = await self.schedulers[0].store.state("acme", schedule.id)
        assert state is not None
        return state

    async def turns(self) -> list[Turn]:
        js = self.nc.jetstream()
        info = await js.stream_info(SUBJECTS.turns_stream)
        out: list[Turn] = []
        if not info.state.messages:
            return out
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(SUBJECTS.turns_stream, seq)
            out.append(decode(msg.data or b"", Turn))
        return out

    async def end(self, turn_id: str, session: str) -> None:
        end = LoopEnd(tenant="acme", session=session, turn_id=turn_id, reason="task_completion")
        await self.nc.jetstream().publish(SUBJECTS.event("acme", session, "loop_end"), encode(end))


def ran(state: ScheduleState) -> list[tuple[int, str]]:
    """(tick - T0, outcome) of each run, oldest first."""
    return [(int(r.tick - T0), r.outcome) for r in reversed(state.runs)]


async def test_three_schedulers_claim_each_tick_once(env) -> None:
    schedulers = [await env.scheduler(f"s{i}") for i in range(3)]
    schedule = await env.schedule(policy="allow")
    for k in range(1, 6):
        await env.at(k + 0.5, schedule)
    assert sum(s.claimed for s in schedulers) == 5
    turns = await env.turns()
    assert [t.id for t in turns] == [schedule_turn_id(schedule, T0 + k) for k in range(1, 6)]
    assert all(t.session == t.id and t.metadata["schedule"] == "every" for t in turns)
    state = await env.state(schedule)
    assert ran(state) == [(k, "fired") for k in range(1, 6)]
    assert all(r.published for r in state.runs)


@pytest.mark.parametrize("priority", ["batch", "interactive", None])
async def test_a_schedules_turns_are_batch_unless_it_says_otherwise(env, priority) -> None:
    await env.scheduler("s1")
    schedule = await env.schedule(**({"priority": priority} if priority else {}))
    await env.at(1.5, schedule)
    [turn] = await env.turns()
    assert turn.priority == (priority or "batch")
    info = await env.nc.jetstream().stream_info(SUBJECTS.turns_stream, subjects_filter=">")
    assert info.state.subjects == {SUBJECTS.turn("acme", turn.session, turn.priority): 1}


async def test_a_late_scheduler_fires_missed_ticks_in_the_window_and_records_the_rest(env) -> None:
    await env.scheduler("s1")
    schedule = await env.schedule(policy="allow", catch_up_s=3)  # at least LATE_S: 10 s
    await env.at(20.5, schedule)  # nobody ran from T0 until now
    state = await env.state(schedule)
    assert ran(state) == [(1, "missed"), *((k, "fired") for k in range(11, 21))]
    assert state.runs[-1].missed == 10
    assert len(await env.turns()) == 10


async def test_skip_skips_while_the_previous_run_has_not_ended(env) -> None:
    await env.scheduler("s1")
    await env.scheduler("s2")
    schedule = await env.schedule(session="s1", policy="skip")
    await env.at(1.5, schedule)
    await env.at(2.5, schedule)
    await env.at(3.5, schedule)
    first = schedule_turn_id(schedule, T0 + 1)
    state = await env.state(schedule)
    assert ran(state) == [(1, "fired"), (2, "skipped"), (3, "skipped")]
    assert state.runs[0].reason == f"run {first} has not ended"
    await env.end(first, "s1")
    await env.at(4.5, schedule)
    assert ran(await env.state(schedule))[-1] == (4, "fired")
    assert [t.id for t in await env.turns()] == [first, schedule_turn_id(schedule, T0 + 4)]


async def test_buffer_one_in_a_session_keeps_one_run_waiting(env) -> None:
    await env.scheduler("s1")
    schedule = await env.schedule(session="s1", policy="buffer_one")
    for k in (1, 2, 3):
        await env.at(k + 0.5, schedule)
    assert ran(await env.state(schedule)) == [(1, "fired"), (2, "fired"), (3, "skipped")]
    assert len(await env.turns()) == 2


async def test_buffer_one_with_a_session_per_run_fires_the_buffered_run_when_the_last_ends(
    env,
) -> None:
    await env.scheduler("s1")
    schedule = await env.schedule(policy="buffer_one")
    for k in (1, 2, 3):
        await env.at(k + 0.5, schedule)
    assert ran(await env.state(schedule)) == [(1, "fired"), (2, "buffered"), (3, "skipped")]
    first, second = (schedule_turn_id(schedule, T0 + k) for k in (1, 2))
    await env.end(first, first)
    await env.at(3.7, schedule)  # before the next tick: the buffered run goes at once
    state = await env.state(schedule)
    assert ran(state) == [(1, "fired"), (2, "fired"), (3, "skipped")]
    assert state.buffered is None
    assert [t.id for t in await env.turns()] == [first, second]


async def test_a_claim_whose_scheduler_died_is_published_by_another(env) -> None:
    await env.scheduler("s1", republish_after_s=2, republish_within_s=30)
    schedule = await env.schedule(policy="allow")
    turn_id = schedule_turn_id(schedule, T0 + 1)
    claimed = ScheduleRun(tick=T0 + 1, at=T0 + 1, outcome="fired", turn_id=turn_id, session="x1")
    orphan = ScheduleRun(tick=T0 - 50, at=T0 - 50, outcome="fired", turn_id="old", session="x0")
    state = ScheduleState(uid=schedule.uid, last_tick=T0 + 1, runs=(claimed,))
    kv = await env.nc.jetstream().key_value(SUBJECTS.schedules_bucket)
    await kv.put(state_key("acme", "every"), encode(state))
    await env.at(1.5, schedule)  # the claim is too fresh to be taken for dead
    assert await env.turns() == []
    await env.at(3.2, schedule)  # published again first, then ticks 2 and 3
    assert [t.id for t in await env.turns()] == [
        schedule_turn_id(schedule, T0 + k) for k in (1, 2, 3)
    ]
    runs = (await env.state(schedule)).runs
    assert runs[-1].published and runs[-1].turn_id == turn_id
    # a claim older than the window is recorded as lost, not published
    stale = msgspec.structs.replace(await env.state(schedule), runs=(orphan, *runs))
    await kv.put(state_key("acme", "every"), encode(stale))
    await env.at(3.4, schedule)
    assert next(r for r in (await env.state(schedule)).runs if r.turn_id == "old").outcome == "lost"
    assert len(await env.turns()) == 3  # ticks 2 and 3, nothing for the lost one


async def test_a_paused_schedule_does_not_fire_and_resumes_from_now(env) -> None:
    s = await env.scheduler("s1")
    schedule = await env.schedule(policy="allow")
    await env.at(1.5, schedule)
    await s.store.set_paused("acme", "every", True, now=T0 + 1.6)
    with pytest.raises(Gone):
        await env.at(4.5, schedule)  # the task following it ends at its next tick
    resumed = await s.store.set_paused("acme", "every", False, now=T0 + 5.2)
    assert resumed is not None and resumed.active_since == T0 + 5.2
    await env.at(6.5, resumed)
    assert ran(await env.state(schedule)) == [(1, "fired"), (6, "fired")]


async def test_running_schedulers_fire_a_new_schedule_once_per_tick(nats_server) -> None:
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    schedulers = [Scheduler(nc, SUBJECTS, SchedulerSettings(), name=f"s{i}") for i in range(3)]
    try:
        for s in schedulers:
            s.start()
        await asyncio.gather(*(s.ready.wait() for s in schedulers))
        schedule = new_schedule("acme", id="live", cron="* * * * * *", input="x", policy="allow")
        await schedulers[0].store.create(schedule)  # pushed to them: no reload needed

        async def runs() -> list[ScheduleRun]:
            state, _ = await schedulers[0].store.state("acme", "live")
            return [r for r in state.runs if r.published] if state else []

        await wait_for(lambda: _at_least(runs, 3), timeout=20, what="three runs")
    finally:
        for s in schedulers:
            await s.close()
    state, _ = await schedulers[0].store.state("acme", "live")
    assert state is not None
    ticks = sorted(int(r.tick) for r in state.runs)
    assert ticks == list(range(ticks[0], ticks[-1] + 1))  # none missing, none twice
    assert sum(s.claimed for s in schedulers) == len(ticks)
    await nc.close()


async def _at_least(runs, n: int) -> bool:
    return len(await runs()) >= n


async def test_a_schedule_written_is_the_only_one_a_running_scheduler_reads_again(
    nats_server,
) -> None:
    """Each scheduler follows the bucket through a watch: a write of one schedule reaches
    it as that schedule, and it reads nothing of the others (no snapshot of the bucket,
    no get of their keys)."""
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    own = await connect_fast(nats_server.url, name="scheduler")
    snoop = await connect_fast(nats_server.url, name="snoop")
    bucket = SUBJECTS.schedules_bucket
    kv = await nc.jetstream().key_value(bucket)
    yearly = {"cron": "0 0 1 1 *", "input": "x", "now": time.time()}
    for name in ("a", "b", "c"):
        schedule = new_schedule("acme", id=name, **yearly)
        await kv.put(schedule.key, encode(schedule))
    requests: list[tuple[str, bytes]] = []

    async def seen(msg) -> None:
        requests.append((msg.subject, msg.data))

    await snoop.subscribe("$JS.API.>", cb=seen)
    await snoop.flush()
    scheduler = Scheduler(own, SUBJECTS, SchedulerSettings(), name="s0")
    try:
        scheduler.start()
        await scheduler.ready.wait()
        await wait_for(lambda: len(scheduler._following) == 3, what="three followed")

        def stepped(name: str) -> bool:  # its task read its state, then sleeps a year
            return any(f"acme.{name}.state" in s + d.decode() for s, d in requests)

        await wait_for(lambda: all(map(stepped, "abc")), what="each task's first step")
        written = len(requests)
        new = new_schedule("acme", id="d", **yearly)
        await kv.put(new.key, encode(new))  # a plain publish: no API request
        await wait_for(lambda: "acme.d" in scheduler._following, what="the new one followed")
        await own.flush()
        await snoop.flush()
    finally:
        await scheduler.close()
        for client in (snoop, own, nc):
            await client.close()
    after = [(s, d) for s, d in requests[written:] if bucket in s or bucket.encode() in d]
    assert not [s for s, _ in after if s.startswith("$JS.API.CONSUMER.")]  # no snapshot
    for subject, data in after:
        text = subject + data.decode(errors="replace")
        assert not [k for k in ("acme.a", "acme.b", "acme.c") if k in text], text
