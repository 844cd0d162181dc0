"""The rate-limit leader's key on a real nats-server (one, or a 3-node cluster): a renew
whose reply is lost or late, and calls when no leader answers. What a write's reply does
is injected (a :class:`KV` whose writes of the leader key commit, then fail or wait);
every write and read is real."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import TypeVar

import nats.errors
import pytest
from nats.aio.client import Client

from loop_worker.engine.settings import LimitSettings, ModelLimits
from loop_worker.errors import LimiterUnavailableError
from loop_worker.limiter import SharedLimiter
from loop_worker.limiter_leader import LEADER_KEY, LimiterLeader
from loopmesh.jetstream import KV, Publisher, open_kv
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short, wait_for
from schemas import decode, encode
from schemas.events import Error, LoopEnd
from schemas.limits import LeaderRecord, LimitAnswer, LimitAsk, LimitSettle
from tests.conftest import BOTH, durable_nc
from tests.loop_worker.durable import Watch, mesh_on, send_turn, turn
from tests.loop_worker.test_ratelimit import MODEL, leading, limiters

nc = durable_nc()
K = TypeVar("K", bound=KV)

TTL_S = 3.0
SETTINGS = LimitSettings(models={MODEL: ModelLimits(rpm=6000)})


class LostReply(KV):
    """Once armed, the next write of the leader key commits, then raises the timeout a
    lost reply would."""

    armed = False
    committed = 0  # the revision it wrote

    async def update(self, key: str, value: bytes, last: int, *, timeout: float = 5.0) -> int:
        revision = await super().update(key, value, last, timeout=timeout)
        if key == LEADER_KEY and self.armed:
            self.armed, self.committed = False, revision
            raise nats.errors.TimeoutError
        return revision


class LateReply(KV):
    """Once armed, the next write of the leader key commits (``committed`` is set), and
    its reply comes when the test sets ``release``; the write after it is not sent
    before the test sets ``resume``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.armed = False
        self.committed = asyncio.Event()
        self.revision = 0
        self.release = asyncio.Event()
        self.resume = asyncio.Event()
        self._hold_next = False

    async def update(self, key: str, value: bytes, last: int, *, timeout: float = 5.0) -> int:
        if key == LEADER_KEY and self._hold_next:
            await self.resume.wait()
        revision = await super().update(key, value, last, timeout=timeout)
        if key == LEADER_KEY and self.armed:
            self.armed, self.revision = False, revision
            self.committed.set()
            await self.release.wait()
            self._hold_next = True
        return revision


@contextlib.asynccontextmanager
async def a_leader(
    nc: Client, kind: type[K], owner: str = "a", ttl_s: float = TTL_S
) -> AsyncIterator[tuple[LimiterLeader, K]]:
    """A candidate for leader on ``nc`` campaigning in a task, and the ``kind`` of KV its
    key's writes go through; it has led once this returns."""
    publisher = Publisher(nc)
    real = await open_kv(nc.jetstream(), publisher, SUBJECTS.limits_bucket)
    kv = kind(publisher, real.bucket, leader=real.leader)
    leader = LimiterLeader(
        nc, SUBJECTS, SETTINGS, owner=owner, kv=kv, ttl_s=ttl_s, pauses=dict
    )  # fmt: skip
    task = asyncio.create_task(leader.run())
    try:
        await wait_for(lambda: leader.leading, what="the candidate to lead")
        yield leader, kv
    finally:
        await _cancelled(task)
        await leader.close()
        await publisher.close()


@contextlib.asynccontextmanager
async def a_late_leader(
    url: str, nc: Client, ttl_s: float = TTL_S
) -> AsyncIterator[tuple[LimiterLeader, LateReply, SharedLimiter]]:
    """A leader whose key's writes go through :class:`LateReply` (released and resumed
    at the end), and a worker that asks, on a connection of its own."""
    asker_nc = await connect_fast(url)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(asker_nc.close)
        leader, kv = await stack.enter_async_context(a_leader(nc, LateReply, ttl_s=ttl_s))
        stack.callback(kv.resume.set)
        stack.callback(kv.release.set)
        asker = SharedLimiter(asker_nc, SUBJECTS, SETTINGS, name="asker")
        yield leader, kv, await stack.enter_async_context(asker)


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_renew_that_committed_but_whose_reply_was_lost_keeps_the_leader(
    durable, nc, caplog
):
    caplog.set_level(logging.INFO, logger="loopmesh.loop_worker.limiter")
    await provision_short(nc, replicas=durable.replicas)
    async with a_leader(nc, LostReply) as (leader, kv):
        kv.armed = True
        await wait_for(lambda: kv.committed > 0, what="a renew to commit and lose its reply")

        async def renewed_twice_since() -> bool:
            entry = await kv.entry(LEADER_KEY)
            return entry is not None and entry.revision >= kv.committed + 2

        await wait_for(renewed_twice_since, timeout=30, what="two renews after the lost reply")
        assert leader.leading
    stepped_down = [
        r.getMessage()
        for r in caplog.records
        if "leader no more" in r.getMessage() and "stopped" not in r.getMessage()
    ]
    assert stepped_down == []  # it led throughout: no candidate had to wait for its key


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_leader_whose_renew_was_answered_late_grants_nothing_once_taken_over(durable, nc):
    await provision_short(nc, replicas=durable.replicas)
    async with contextlib.AsyncExitStack() as stack:
        leader, kv, asker = await stack.enter_async_context(a_late_leader(durable.url, nc))
        kv.armed = True
        await kv.committed.wait()
        seen_at = time.monotonic()  # the earliest any candidate saw this revision
        # another candidate, by the rule: the key's revision unchanged for the TTL
        await wait_for(lambda: time.monotonic() - seen_at >= TTL_S, timeout=TTL_S + 5)
        other = encode(LeaderRecord(owner="other", at=time.time()))
        await kv.update(LEADER_KEY, other, kv.revision)
        kv.release.set()  # the old leader hears at last that its renew went through
        call = asyncio.create_task(asker.acquire(MODEL, "acme", 10))
        stack.push_async_callback(_cancelled, call)
        await wait_for(lambda: call.done() or not leader.leading, what="a grant, or a step-down")
        assert not call.done()  # the old leader granted nothing: the key was not its own


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_leader_that_lapsed_while_the_key_stayed_its_own_takes_it_back_at_once(durable, nc):
    # a renew's reply is late past the lease: the leader steps down at the next ask. The
    # key is still its own, so it takes it back before the other candidate's TTL is up
    await provision_short(nc, replicas=durable.replicas)
    async with contextlib.AsyncExitStack() as stack:
        late = a_late_leader(durable.url, nc, ttl_s=6.0)
        leader, kv, asker = await stack.enter_async_context(late)
        kv.armed = True
        await kv.committed.wait()
        other, _ = await stack.enter_async_context(a_candidate(nc, "b"))
        while leader.leading:  # it grants until its lease lapses, then steps down
            call = asyncio.create_task(asker.acquire(MODEL, "acme", 10))
            stack.push_async_callback(_cancelled, call)
            await wait_for(partial(granted_or_gone, call, leader), what="a grant, or a step-down")
            if call.done():
                await call.result().settle(10)
        kv.resume.set()
        kv.release.set()  # the late reply: the key is still the leader's
        await wait_for(lambda: leader.leading or other.leading, timeout=20, what="a leader")
        assert leader.leading


@contextlib.asynccontextmanager
async def a_candidate(nc: Client, owner: str) -> AsyncIterator[tuple[LimiterLeader, KV]]:
    """A candidate campaigning in a task with the key's writes as they are (not leading)."""
    publisher = Publisher(nc)
    kv = await open_kv(nc.jetstream(), publisher, SUBJECTS.limits_bucket)
    candidate = LimiterLeader(
        nc, SUBJECTS, SETTINGS, owner=owner, kv=kv, ttl_s=6.0, pauses=dict
    )  # fmt: skip
    task = asyncio.create_task(candidate.run())
    try:
        yield candidate, kv
    finally:
        await _cancelled(task)
        await candidate.close()
        await publisher.close()


def granted_or_gone(call: asyncio.Task[object], leader: LimiterLeader) -> bool:
    return call.done() or not leader.leading


async def _cancelled(task: asyncio.Task[object]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("durable", BOTH, indirect=True)
@pytest.mark.parametrize("no_leader", ["fail", "allow"])
async def test_a_call_that_no_leader_answers_fails_or_goes_after_leader_wait_s(
    durable, nc, no_leader
):
    await provision_short(nc, replicas=durable.replicas)
    settings = LimitSettings(
        models={MODEL: ModelLimits(rpm=6000)}, leader_wait_s=2.0, no_leader=no_leader
    )
    async with limiters(durable.url, settings, 1) as workers:
        (worker,) = workers
        await leading(workers)
        assert worker.leader is not None
        await nc.jetstream().delete_key_value(SUBJECTS.limits_bucket)  # the bucket is down
        await wait_for(lambda: not worker.leader.leading, timeout=30, what="the leader to go")
        async with asyncio.timeout(30):  # a call that waits forever fails here
            if no_leader == "fail":
                with pytest.raises(LimiterUnavailableError) as raised:
                    await worker.acquire(MODEL, "acme", 10)
                assert raised.value.model == MODEL
            else:
                permit = await worker.acquire(MODEL, "acme", 10)
                await permit.settle(10)


@contextlib.asynccontextmanager
async def settles(nc: Client) -> AsyncIterator[list[LimitSettle]]:
    """The settles heard on ``limits.settle`` from now on, as a checker hears them."""
    heard: list[LimitSettle] = []

    async def on_settle(msg: object) -> None:
        heard.append(decode(msg.data, LimitSettle))  # type: ignore[attr-defined]

    sub = await nc.subscribe(SUBJECTS.limits_settle, cb=on_settle)
    await nc.flush()
    try:
        yield heard
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_each_settle_names_its_grants_leader_and_a_later_leaders_term_is_higher(durable, nc):
    await provision_short(nc, replicas=durable.replicas)
    async with settles(nc) as heard, limiters(durable.url, SETTINGS, 2) as workers:
        first = await leading(workers)
        assert first.leader is not None
        first_term = first.leader.term
        await (await first.acquire(MODEL, "acme", 10)).settle(10)
        other = next(w for w in workers if w is not first)
        await first.close()  # a stop: the other takes over within a tick
        second = await leading([other])
        assert second.leader is not None
        second_term = second.leader.term
        await (await other.acquire(MODEL, "acme", 10)).settle(10)
        await wait_for(lambda: len(heard) == 2, what="both settles")
    (a, b) = heard
    assert (a.leader, a.term) == (first.name, first_term)
    assert (b.leader, b.term) == (other.name, second_term)
    assert b.term > a.term and b.granted_at >= a.granted_at > 0


async def test_a_grant_of_a_lower_term_than_one_heard_is_refused(durable, nc):
    # the test answers the asks as two leaders would: the one of term 5, then a deposed
    # one of term 3 that answers first, then term 5 again
    await provision_short(nc)
    script = [5, 3, 5]
    asked: list[str] = []

    async def answer(msg: object) -> None:
        ask = decode(msg.data, LimitAsk)  # type: ignore[attr-defined]
        asked.append(ask.id)
        term = script.pop(0)
        grant = LimitAnswer(granted=True, leader=f"term{term}", term=term, at=time.time())
        await nc.publish(msg.reply, encode(grant))  # type: ignore[attr-defined]

    sub = await nc.subscribe(SUBJECTS.limits_ask, cb=answer)
    await nc.flush()
    asker_nc = await connect_fast(durable.url)
    try:
        async with settles(nc) as heard, SharedLimiter(
            asker_nc, SUBJECTS, LimitSettings(models={MODEL: ModelLimits(rpm=60)}), name="w"
        ) as worker:  # fmt: skip
            await (await worker.acquire(MODEL, "acme", 10)).settle(10)
            await (await worker.acquire(MODEL, "acme", 10)).settle(10)
            await wait_for(lambda: len(heard) == 2, what="both settles")
    finally:
        await sub.unsubscribe()
        await asker_nc.close()
    assert script == []  # the second call asked twice
    assert asked[1] == asked[2]  # under one id: it kept its place
    assert [s.term for s in heard] == [5, 5]


async def test_a_turn_whose_call_no_leader_answers_ends_llm_failed_saying_why(nats_server):
    limits = LimitSettings(models={MODEL: ModelLimits(rpm=6000)}, leader_wait_s=2.0)
    async with mesh_on(nats_server.url) as mesh:
        w1 = await mesh.loop_worker("w1", llm_settings={"limits": limits})
        leader = w1.service.limiter.leader
        await wait_for(lambda: leader.leading, what="the worker to lead")
        await mesh.nc.jetstream().delete_key_value(SUBJECTS.limits_bucket)  # the bucket is down
        await wait_for(lambda: not leader.leading, timeout=30, what="the leader to go")
        async with Watch(mesh.nc, session="a") as a:
            await send_turn(mesh.nc, turn("ta", "go", session="a"))
            end = await a.wait("loop_end", "ta", timeout=30)
            errors = a.of("error", "ta")
    assert isinstance(end, LoopEnd) and end.reason == "llm_failed"
    assert len(mesh.fake.requests) == 0  # nothing reached the model
    (error,) = errors
    assert isinstance(error, Error) and error.code == "llm_failed"
    assert "no rate-limit leader answered" in error.message
    assert "no_leader" in error.message
