"""The fleet's LLM rate limits (``[llm.limits]``) on real loop workers, a real
nats-server and the fake LLM over HTTP: what the fake receives is counted, never timed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from loop_worker.controls import send_control
from loop_worker.engine.settings import LimitSettings, ModelLimits
from loop_worker.limiter import SharedLimiter
from loopmesh.jetstream import kv_values
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short, wait_for
from loopmesh.testing.fake_replies import error
from schemas import Cancel, decode
from schemas.events import LoopEnd, LoopStart
from schemas.limits import LimiterState
from tests.conftest import BOTH
from tests.loop_worker.durable import Mesh, Running, Watch, mesh_on, send_turn, turn

MODEL = "fake-model"


def limits(**fields: object) -> dict[str, LimitSettings]:
    """``[llm.limits]`` with ``fields`` for the model the mesh's workers ask for."""
    return {"limits": LimitSettings(models={MODEL: ModelLimits(**fields)})}  # type: ignore[arg-type]


def most_in_any_window(arrivals: list[float], window_s: float) -> int:
    """The most requests the fake received within any ``window_s`` (half-open)."""
    times = sorted(arrivals)
    return max(sum(1 for t in times if start <= t < start + window_s) for start in times)


def rate_limited() -> float:
    """The 429s this process's workers were answered (``loopmesh_llm_rate_limited``)."""
    labels = {"gen_ai_request_model": MODEL}
    return REGISTRY.get_sample_value("loopmesh_llm_rate_limited_total", labels) or 0.0


def leader_of(*workers: Running) -> SharedLimiter:
    for w in workers:
        limiter = w.service.limiter
        if limiter.leader is not None and limiter.leader.leading:
            return limiter
    raise AssertionError("no leader")


async def a_leader(*workers: Running) -> SharedLimiter:
    def led() -> bool:
        return any(w.service.limiter.leader.leading for w in workers)

    await wait_for(led, what="a rate-limit leader")
    return leader_of(*workers)


@pytest.fixture
async def mesh(durable) -> AsyncIterator[Mesh]:
    async with mesh_on(durable.url, replicas=durable.replicas) as mesh:
        yield mesh


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_two_workers_sharing_a_limit_never_pass_it_together(mesh):
    # 2 requests in any second between them, 10 one-call turns over 10 sessions; 5 places
    # each, so that both take turns (a worker takes all it has places for when it asks)
    shared = {"llm_settings": limits(rpm=120, window_s=1.0), "max_active_turns": 5}
    w1 = await mesh.loop_worker("w1", **shared)
    w2 = await mesh.loop_worker("w2", **shared)
    await a_leader(w1, w2)
    sessions = [f"s{i}" for i in range(10)]
    ends: list[LoopEnd] = []
    async with contextlib.AsyncExitStack() as stack:
        watches = [await stack.enter_async_context(Watch(mesh.nc, session=s)) for s in sessions]
        for s in sessions:
            await send_turn(mesh.nc, turn(f"t-{s}", "go", session=s))
        for s, watch in zip(sessions, watches, strict=True):
            ends.append(await watch.wait("loop_end", f"t-{s}", timeout=60))  # type: ignore[arg-type]
        workers = {
            e.worker for w in watches for e in w.of("loop_start") if isinstance(e, LoopStart)
        }
    assert [e.reason for e in ends] == ["task_completion"] * 10
    assert workers == {"w1", "w2"}  # both took turns, and waited on one limit
    assert len(mesh.fake.arrivals) == 10
    assert most_in_any_window(mesh.fake.arrivals, 1.0) <= 2


@pytest.mark.parametrize("configured", [False, True], ids=["unlimited-model", "limited-model"])
async def test_a_429_with_retry_after_pauses_the_model_for_both_workers(mesh, configured):
    # one turn at a time per worker: the second turn goes to the worker that was not 429'd
    service = {"max_active_turns": 1, "max_waiting_turns": 0}
    llm = {"max_retries": 1, **(limits(rpm=10_000) if configured else {})}
    w1 = await mesh.loop_worker("w1", llm_settings=llm, **service)
    w2 = await mesh.loop_worker("w2", llm_settings=llm, **service)
    if configured:
        await a_leader(w1, w2)
    assert mesh.fake is not None
    mesh.fake.script(error(429, "slow down", retry_after=2))
    before = rate_limited()
    async with Watch(mesh.nc, session="a") as a, Watch(mesh.nc, session="b") as b:
        await send_turn(mesh.nc, turn("ta", "go", session="a"))
        retry = await a.wait("retry", "ta")  # the 429 came back; the pause is out
        await send_turn(mesh.nc, turn("tb", "go", session="b"))
        end_a = await a.wait("loop_end", "ta", timeout=20)
        end_b = await b.wait("loop_end", "tb", timeout=20)
        ran_a, ran_b = a.of("loop_start")[0].worker, b.of("loop_start")[0].worker  # type: ignore[attr-defined]
    assert (end_a.reason, end_b.reason) == ("task_completion", "task_completion")  # type: ignore[attr-defined]
    assert ran_a != ran_b
    assert retry.delay_s == 2  # type: ignore[attr-defined]
    first, *later = mesh.fake.arrivals  # the 429'd request, then a's retry and b's call
    assert len(later) == 2
    assert [t for t in later if t < first + 2] == []  # none inside the pause
    assert rate_limited() == before + 1


async def test_a_cancelled_turn_stops_waiting_and_gives_its_place_up(mesh):
    w1 = await mesh.loop_worker("w1", llm_settings=limits(rpm=1))  # one request a minute
    limiter = await a_leader(w1)
    assert limiter.leader is not None
    async with Watch(mesh.nc, session="a") as a, Watch(mesh.nc, session="b") as b:
        await send_turn(mesh.nc, turn("ta", "go", session="a"))
        await a.wait("loop_end", "ta")
        await send_turn(mesh.nc, turn("tb", "go", session="b"))
        book = limiter.leader.book
        assert book is not None
        await wait_for(lambda: book.waiting(MODEL) == 1, what="tb to wait for the limit")
        cancel = Cancel(tenant="acme", session="b", turn_id="tb", reason="enough")
        await send_control(mesh.nc, SUBJECTS, cancel)
        end = await b.wait("loop_end", "tb")
    assert end.reason == "cancelled"  # type: ignore[attr-defined]
    assert len(mesh.fake.requests) == 1  # tb never reached the model
    await wait_for(lambda: book.waiting(MODEL) == 0, what="tb's place to be given up")


async def test_a_turn_waiting_long_for_the_limit_keeps_its_lease_and_delivery(mesh):
    # AckWait and the lease TTL are 2 s; the second turn waits about 5 s
    w1 = await mesh.loop_worker("w1", llm_settings=limits(rpm=12, window_s=5.0))  # 1 per 5 s
    await a_leader(w1)
    async with Watch(mesh.nc, session="a") as a, Watch(mesh.nc, session="b") as b:
        await send_turn(mesh.nc, turn("ta", "go", session="a"))
        await a.wait("loop_end", "ta")
        await send_turn(mesh.nc, turn("tb", "go", session="b"))
        end = await b.wait("loop_end", "tb", timeout=30)
        starts = b.of("loop_start", "tb")
    assert end.reason == "task_completion"  # type: ignore[attr-defined]
    assert mesh.fake.arrivals[1] - mesh.fake.arrivals[0] >= 5  # it did wait
    assert len(starts) == 1  # delivered once: not redelivered, nor resumed elsewhere
    assert w1.service.stats["lost"] == 0 and w1.service.stats["resumed"] == 0


# -- the limiter alone: two workers' limiters on their own connections ------------------


@contextlib.asynccontextmanager
async def limiters(url: str, settings: LimitSettings, n: int) -> AsyncIterator[list[SharedLimiter]]:
    """``n`` limiters as ``n`` workers run them, each campaigning in a task."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for i in range(n):
            nc = await connect_fast(url)
            stack.push_async_callback(nc.close)
            limiter = SharedLimiter(nc, SUBJECTS, settings, name=f"w{i}", leader_ttl_s=3.0)
            await limiter.start()
            task = asyncio.create_task(limiter.run())
            stack.push_async_callback(_stop, limiter, task)
            out.append(limiter)
        yield out


async def _stop(limiter: SharedLimiter, task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await limiter.close()


async def leading(limiters: list[SharedLimiter]) -> SharedLimiter:
    await wait_for(lambda: any(lim.leader and lim.leader.leading for lim in limiters))
    return next(lim for lim in limiters if lim.leader and lim.leader.leading)


async def test_waiting_requests_are_served_fairly_across_tenants(nats_server, nc):
    await provision_short(nc)
    settings = LimitSettings(models={MODEL: ModelLimits(rpm=600, window_s=0.1)})  # 1 per 0.1 s
    async with limiters(nats_server.url, settings, 2) as (busy_worker, quiet_worker):
        leader = await leading([busy_worker, quiet_worker])
        assert leader.leader is not None and leader.leader.book is not None
        book = leader.leader.book
        order: list[str] = []

        async def call(limiter: SharedLimiter, tenant: str) -> None:
            permit = await limiter.acquire(MODEL, tenant, 10)
            order.append(tenant)
            await permit.settle(10)

        first = await busy_worker.acquire(MODEL, "busy", 10)  # holds the window
        async with asyncio.TaskGroup() as tg:
            for _ in range(5):
                tg.create_task(call(busy_worker, "busy"))
            await wait_for(lambda: book.waiting(MODEL) == 5, what="busy's calls to wait")
            tg.create_task(call(quiet_worker, "quiet"))
            await wait_for(lambda: book.waiting(MODEL) == 6, what="quiet's call to wait")
            await first.settle(10)
    assert order == ["busy", "quiet", "busy", "busy", "busy", "busy"]


async def test_a_new_leader_takes_over_and_counts_what_the_last_one_granted(nats_server, nc):
    await provision_short(nc)
    settings = LimitSettings(models={MODEL: ModelLimits(rpm=1)})  # one a minute
    async with limiters(nats_server.url, settings, 2) as workers:
        old = await leading(workers)
        permit = await old.acquire(MODEL, "acme", 10)
        await permit.settle(10)
        other = next(w for w in workers if w is not old)
        await old.close()  # a stop: its state and key are left for the next
        new = await leading([other])
        assert new.leader is not None and new.leader.book is not None
        book = new.leader.book
        waiting = asyncio.create_task(other.acquire(MODEL, "acme", 10))
        await wait_for(lambda: book.waiting(MODEL) == 1, what="the ask to wait at the new leader")
        assert not waiting.done()  # the last leader's grant still counts
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await wait_for(lambda: book.waiting(MODEL) == 0, what="the place to be given up")


async def test_a_leader_that_crashes_is_replaced_and_its_grants_still_count(nats_server, nc):
    await provision_short(nc)
    settings = LimitSettings(models={MODEL: ModelLimits(rpm=1)})  # one a minute
    async with limiters(nats_server.url, settings, 2) as workers:
        old = await leading(workers)
        other = next(w for w in workers if w is not old)
        permit = await old.acquire(MODEL, "acme", 10)
        await permit.settle(10)

        async def saved() -> bool:  # the leader's state, as it leaves it every tick
            stored = await kv_values(nc.jetstream(), SUBJECTS.limits_bucket, "state")
            state = decode(stored["state"], LimiterState) if "state" in stored else None
            return state is not None and any(w.kind == "requests" for w in state.windows)

        await wait_for(saved, what="the leader's state to count the grant")
        await old.nc.close()  # a crash: no hand-over, the key left to lapse
        new = await leading([other])
        assert new.leader is not None and new.leader.book is not None
        book = new.leader.book
        waiting = asyncio.create_task(other.acquire(MODEL, "acme", 10))
        await wait_for(lambda: book.waiting(MODEL) == 1, what="the ask to wait at the new leader")
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
