"""Schedules as they come in: every field checked, the error naming it; ticks in the
schedule's time zone; run ids derived from the schedule and the tick; a tenant's
schedules capped by ``[scheduler] max_per_tenant`` in a real nats-server's bucket."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from loopmesh.jetstream import Publisher, open_kv
from loopmesh.schedules import (
    Exists,
    ScheduleError,
    ScheduleStore,
    TooMany,
    explain,
    new_schedule,
    next_tick,
    ticks,
)
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short
from schemas import decode, encode, is_token
from schemas.schedules import Schedule, ScheduleState, schedule_turn_id, state_key

NOW = datetime(2026, 3, 28, 12, 0, tzinfo=ZoneInfo("UTC")).timestamp()


def make(**fields) -> Schedule:
    values = {"cron": "0 9 * * *", "input": "report", "now": NOW, **fields}
    return new_schedule("acme", **values)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * * *"}, "cron"),
        ({"cron": "0 0 30 2 *"}, "cron"),
        ({"cron": "@reboot"}, "cron"),
        ({"cron": "* " * 150}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"timezone": "../etc/passwd"}, "timezone"),
        ({"timezone": "Europe"}, "timezone"),
        ({"timezone": "x" * 100}, "timezone"),
        ({"input": "  "}, "input"),
        ({"input": "x" * 200_000}, "input"),
        ({"policy": "sometimes"}, "policy"),
        ({"id": "no.dots"}, "id"),
        ({"agent": "a b"}, "agent"),
        ({"session": "s>"}, "session"),
        ({"catch_up_s": -1}, "catch_up_s"),
        ({"catch_up_s": 10**9}, "catch_up_s"),
    ],
)
def test_a_bad_field_is_refused_by_name(fields, field) -> None:
    with pytest.raises(ScheduleError) as caught:
        make(**fields)
    assert caught.value.field == field
    assert f"`{field}`" in str(caught.value)


def test_a_valid_schedule_round_trips_as_the_schedulers_read_it() -> None:
    schedule = make(id="daily", timezone="Europe/Paris", session="s1", policy="buffer_one")
    assert decode(encode(schedule), Schedule) == schedule
    assert (schedule.created_at, schedule.active_since) == (NOW, NOW)
    assert is_token(schedule.uid) and make().id != make().id  # an id is picked when none given


def test_ticks_are_computed_in_the_schedule_time_zone_across_a_dst_change() -> None:
    paris = make(cron="30 2 * * *", timezone="Europe/Paris")
    # 2026-03-29: clocks go from 02:00 to 03:00 in Paris, so 02:30 does not exist that day
    got = [datetime.fromtimestamp(t, ZoneInfo("Europe/Paris")) for t in _first(paris, 3)]
    assert [(d.day, d.hour, d.minute) for d in got] == [(29, 3, 0), (30, 2, 30), (31, 2, 30)]
    utc = make(cron="30 2 * * *")
    assert datetime.fromtimestamp(next_tick(utc, NOW), ZoneInfo("UTC")).hour == 2


def test_six_fields_put_seconds_first() -> None:
    every_5s = make(cron="*/5 * * * * *")
    assert [t - NOW for t in _first(every_5s, 3)] == [5.0, 10.0, 15.0]
    assert "fifth second" in explain(every_5s)  # cronsim's words


def test_a_run_id_derives_from_schedule_and_tick_and_is_a_token() -> None:
    schedule = make(id="x" * 64)
    first = schedule_turn_id(schedule, NOW)
    assert is_token(first) and len(first) <= 56
    assert schedule_turn_id(schedule, NOW) == first
    assert schedule_turn_id(schedule, NOW + 1) != first
    again = make(id="x" * 64)  # deleted and made again: another uid, other run ids
    assert schedule_turn_id(again, NOW) != first


def _first(schedule: Schedule, n: int) -> list[float]:
    out = []
    for tick in ticks(schedule, NOW):
        out.append(tick)
        if len(out) == n:
            return out
    return out


# -- max_per_tenant ----------------------------------------------------------------------------


@pytest.fixture
def store_at(nats_server) -> Callable[[int], AbstractAsyncContextManager[ScheduleStore]]:
    """``async with store_at(max_per_tenant) as store``: the schedules bucket of a
    provisioned server."""

    @asynccontextmanager
    async def at(max_per_tenant: int) -> AsyncIterator[ScheduleStore]:
        nc = await connect_fast(nats_server.url)
        publisher = Publisher(nc)
        try:
            await provision_short(nc)
            kv = await open_kv(nc.jetstream(), publisher, SUBJECTS.schedules_bucket)
            yield ScheduleStore(kv, nc.jetstream(), SUBJECTS, max_per_tenant=max_per_tenant)
        finally:
            await publisher.close()
            await nc.close()

    return at


async def test_a_tenant_past_max_per_tenant_is_refused_naming_the_setting(store_at) -> None:
    async with store_at(2) as store:
        first = make(id="a")
        await store.create(first)
        await store.create(make(id="b"))
        state = ScheduleState(uid=first.uid)  # what a scheduler writes beside it: not counted
        await store.kv.update(state_key("acme", "a"), encode(state), last=0)
        assert await store.count("acme") == 2
        with pytest.raises(TooMany) as caught:
            await store.create(make(id="c"))
        assert str(caught.value) == (
            "tenant acme has 2 schedule(s), the most allowed ([scheduler] max_per_tenant = 2): "
            "delete one first"
        )
        assert (caught.value.count, caught.value.limit) == (2, 2)
        assert await store.get("acme", "c") is None


async def test_at_the_cap_a_schedule_is_changed_and_a_deleted_one_makes_room(store_at) -> None:
    async with store_at(2) as store:
        await store.create(make(id="a"))
        await store.create(make(id="b"))
        paused = await store.set_paused("acme", "a", True)  # a write over it: no new one
        assert paused is not None and paused.paused
        with pytest.raises(Exists):  # its id is taken: that is the answer, not the cap
            await store.create(make(id="a"))
        assert await store.delete("acme", "a")
        await store.create(make(id="a"))  # the deleted one's tombstone does not count
        assert [s.id for s, _ in await store.all("acme")] == ["a", "b"]


async def test_another_tenant_has_a_cap_of_its_own(store_at) -> None:
    async with store_at(1) as store:
        await store.create(make(id="a"))
        with pytest.raises(TooMany):
            await store.create(make(id="b"))
        await store.create(new_schedule("acme2", id="a", cron="0 9 * * *", input="x"))
        await store.create(new_schedule("ac", id="b", cron="0 9 * * *", input="x"))
        assert await store.count("acme") == 1


async def test_max_per_tenant_zero_means_no_limit(store_at) -> None:
    async with store_at(0) as store:
        for i in range(5):
            await store.create(make(id=f"s{i}"))
        assert await store.count("acme") == 5
