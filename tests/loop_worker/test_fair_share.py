"""Fair share between tenants, on real loop-worker processes: a tenant's flood of turns
does not make another tenant's turns wait behind it; a tenant's ``max_active_turns``
caps its turns across the fleet; a session's turns keep their order. And the sharing
rule itself: each free place to the tenant holding the fewest for its weight."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest

from loop_worker.config import ServiceSettings
from loop_worker.lanes import Tenant
from loop_worker.share import FairShare
from loopmesh.settings import TenantSettings
from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    drained,
    provision_short,
    stream_events,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import tool_calls
from schemas import Turn
from tests.conftest import BOTH
from tests.loop_worker.durable import send_turn

pytestmark = pytest.mark.slow

READY = "loop worker ready"
PLACES = 4  # per worker
FLOOD_SESSIONS, FLOOD_EACH = 40, 4  # 160 turns: 20 times the fleet's places


def answer() -> object:
    """A model reply that takes about 0.2 s to stream, then ends the turn."""
    return tool_calls(("task_completion", {"result": "ok"}), content="abcd", chunk_size=1,
                      delay_s=0.05)  # fmt: skip


class Ends:
    """Every ``loop_start`` and ``loop_end`` of the mesh, in the order they arrive."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, str]] = []  # (type, tenant, session, turn)
        self.times: list[float] = []  # each one's ts: on a cluster events from two
        # workers may arrive in another order than they were sent (two routes)
        self.changed = asyncio.Event()

    async def on(self, msg) -> None:
        event = json.loads(msg.data)
        self.seen.append((event["type"], event["tenant"], event["session"], event["turn_id"]))
        self.times.append(event["ts"])
        self.changed.set()

    def ended(self, tenant: str) -> int:
        """The tenant's turns ended: each once, though a core subscriber may hear a turn's
        ``loop_end`` published twice (a worker that finds it ended says it again; the
        stream keeps one)."""
        return len({turn for t, ten, _, turn in self.seen if t == "loop_end" and ten == tenant})

    def ended_turn(self, tenant: str, turn_id: str) -> bool:
        return ("loop_end", tenant) in {
            (t, ten) for t, ten, _, turn in self.seen if turn == turn_id
        }

    async def until(self, tenant: str, count: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while self.ended(tenant) < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def fleet(durable, tmp_path):
    """Two loop-worker processes of ``PLACES`` places each, on a config whose
    ``[tenants]`` the test writes first (``fleet.config``)."""
    nc = await connect_fast(durable.url)
    await provision_short(nc, replicas=durable.replicas)
    config = tmp_path / "loopmesh.toml"
    config.write_text("")
    procs: list[Proc] = []
    ends = Ends()
    sub = await nc.subscribe("loopmesh.events.*.*.loop_start", cb=ends.on)
    sub_end = await nc.subscribe("loopmesh.events.*.*.loop_end", cb=ends.on)
    async with FakeLLM(default=answer()) as llm:

        async def start() -> None:
            for name in ("w1", "w2"):
                env = worker_env(
                    durable.url, llm.base_url, replicas=durable.replicas, name=name,
                    max_active_turns=PLACES, max_waiting_turns=PLACES,
                )  # fmt: skip
                proc = Proc("-m", "loop_worker", env={**env, "LOOPMESH_CONFIG": str(config)})
                procs.append(proc)
                await proc.start(READY)

        class Fleet:
            pass

        f = Fleet()
        f.nc, f.ends, f.start, f.config = nc, ends, start, config
        try:
            yield f
        finally:
            for proc in reversed(procs):
                await proc.close()
            await sub.unsubscribe()
            await sub_end.unsubscribe()
            await nc.close()


def _turn(tenant: str, session: str, turn_id: str, **kw) -> Turn:
    return Turn(
        id=turn_id, tenant=tenant, session=session, input="hi", created_at=time.time(), **kw
    )


async def _flood(nc, tenant: str = "flood", **kw) -> int:
    sends = [
        send_turn(nc, _turn(tenant, f"f{s}", f"f{s}t{i}", **kw))
        for i in range(FLOOD_EACH)
        for s in range(FLOOD_SESSIONS)
    ]
    for chunk in range(0, len(sends), 40):
        await asyncio.gather(*sends[chunk : chunk + 40])
    return len(sends)


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_another_tenants_turns_run_while_a_flood_of_one_tenant_waits(fleet):
    await fleet.start()
    flood = await _flood(fleet.nc)
    for k in range(3):  # published after the whole flood
        await send_turn(fleet.nc, _turn("calm", f"c{k}", f"c{k}t0"))
    await fleet.ends.until("calm", 3, timeout=60)
    # calm's turns ran while most of the flood still waited (first come, first served
    # would have run all of the flood first)
    assert fleet.ends.ended("flood") < flood // 2, fleet.ends.ended("flood")
    await fleet.ends.until("flood", flood, timeout=120)  # and the flood ran to its end
    for s in range(FLOOD_SESSIONS):  # each session's turns in the order published, once
        # from the stream, not the core subscription: a turn a loaded worker lost to a
        # takeover before its first checkpoint is started again, its loop_start published
        # twice and stored once
        stored = await stream_events(fleet.nc, "flood", f"f{s}")
        starts = [e.turn_id for e, _ in stored if e.type == "loop_start" and not e.resumed]
        assert starts == [f"f{s}t{i}" for i in range(FLOOD_EACH)]
    await drained(fleet.nc, SUBJECTS.turns_stream)  # every turn acked


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_tenants_max_active_turns_caps_its_turns_across_the_fleet(fleet):
    fleet.config.write_text("[tenants.flood]\nmax_active_turns = 2\n")
    await fleet.start()
    flood = await _flood(fleet.nc)
    await send_turn(fleet.nc, _turn("calm", "c0", "c0t0"))
    await fleet.ends.until("flood", flood, timeout=180)
    running, most = 0, 0
    in_time = sorted(zip(fleet.ends.times, fleet.ends.seen, strict=True), key=lambda p: p[0])
    for _, (type_, tenant, _, _) in in_time:
        if tenant == "flood":
            running += 1 if type_ == "loop_start" else -1
            most = max(most, running)
    assert most == 2  # the cap, reached and never passed, on two workers of 4 places
    assert fleet.ends.ended("calm") == 1


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_tenants_interactive_turns_run_before_its_batch_backlog_drains(fleet):
    await fleet.start()
    flood = await _flood(fleet.nc, "acme", priority="batch")
    for k in range(3):  # published after the whole batch flood, by the same tenant
        await send_turn(fleet.nc, _turn("acme", f"c{k}", f"c{k}t0"))
    async with asyncio.timeout(60):
        while not all(fleet.ends.ended_turn("acme", f"c{k}t0") for k in range(3)):
            fleet.ends.changed.clear()
            await fleet.ends.changed.wait()
    # they ran while most of the flood still waited (in stream order they came last)
    assert fleet.ends.ended("acme") - 3 < flood // 2, fleet.ends.ended("acme")
    await fleet.ends.until("acme", flood + 3, timeout=120)
    await drained(fleet.nc, SUBJECTS.turns_stream)


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_sessions_turns_keep_their_order_across_the_lanes(fleet):
    """A batch turn, then an interactive turn of its session, behind a batch flood: the
    interactive one is pulled first, and waits for the batch one to end."""
    await fleet.start()
    await send_turn(fleet.nc, _turn("acme", "s", "b1", priority="batch"))
    await send_turn(fleet.nc, _turn("acme", "s", "i2"))
    await send_turn(fleet.nc, _turn("acme", "s", "b3", priority="batch"))
    flood = await _flood(fleet.nc, "acme", priority="batch")
    await send_turn(fleet.nc, _turn("acme", "s", "i4"))
    await fleet.ends.until("acme", flood + 4, timeout=120)
    in_time = sorted(zip(fleet.ends.times, fleet.ends.seen, strict=True), key=lambda p: p[0])
    # (each once: a loop_end may be heard twice, said again by a worker that finds it ended)
    session = list(dict.fromkeys((t, turn) for _, (t, _, s, turn) in in_time if s == "s"))
    assert session == [
        (kind, turn) for turn in ("b1", "i2", "b3", "i4") for kind in ("loop_start", "loop_end")
    ], session
    await drained(fleet.nc, SUBJECTS.turns_stream)


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_an_interactive_turn_behind_a_batch_turn_of_its_session_waits_for_no_flood(fleet):
    """Another tenant's interactive flood fills every place; a batch turn, then an
    interactive turn of one session: the interactive one lends its rank to its tenant's
    batch lane, so both run while most of the flood still waits."""
    await fleet.start()
    flood = await _flood(fleet.nc)
    await send_turn(fleet.nc, _turn("acme", "s", "b1", priority="batch"))
    await send_turn(fleet.nc, _turn("acme", "s", "i2"))
    await fleet.ends.until("acme", 2, timeout=60)
    assert fleet.ends.ended("flood") < flood // 2, fleet.ends.ended("flood")
    await fleet.ends.until("flood", flood, timeout=120)
    await drained(fleet.nc, SUBJECTS.turns_stream)


# -- the sharing rule ------------------------------------------------------------------


def _share(**limits: TenantSettings) -> FairShare:
    settings = ServiceSettings(max_active_turns=8)
    return FairShare(None, SUBJECTS, settings, limits, deliver=lambda m, t: None)  # type: ignore[arg-type]


def _with(share: FairShare, name: str, *, waiting: int, held: int = 0, batch: int = 0) -> Tenant:
    t = share._tenant(name)
    t.lanes["interactive"].held = held
    for lane, n in zip(t.lanes.values(), (waiting, batch), strict=True):
        lane.waiting, lane.consumer = n, True
    return t


def test_a_tenant_alone_gets_every_free_place():
    share = _share()
    _with(share, "a", waiting=100)
    assert [(lane.tenant.name, n) for lane, n in share.assign(8)] == [("a", 8)]


def test_free_places_go_first_to_the_tenant_holding_fewest():
    share = _share()
    _with(share, "a", waiting=100, held=8)  # the flood holds every place
    _with(share, "b", waiting=1)
    assert [(lane.tenant.name, n) for lane, n in share.assign(1)] == [("b", 1)]
    _with(share, "c", waiting=5, held=2)
    given = Counter({lane.tenant.name: n for lane, n in share.assign(6)})
    assert given == {"b": 1, "c": 5}  # b's only turn; then c (2 held) before a (8 held)


def test_places_are_shared_by_weight():
    share = _share(heavy=TenantSettings(weight=3.0))
    _with(share, "heavy", waiting=100)
    _with(share, "light", waiting=100)
    given = {lane.tenant.name: n for lane, n in share.assign(8)}
    assert given == {"heavy": 6, "light": 2}


def test_a_tenant_with_nothing_waiting_gets_no_place_and_the_cap_per_worker_holds():
    share = _share()
    share.settings = ServiceSettings(max_active_turns=8, tenant_max_active=3)
    _with(share, "idle", waiting=0)
    _with(share, "busy", waiting=100, held=1)
    assert [(lane.tenant.name, n) for lane, n in share.assign(8)] == [("busy", 2)]


def _lanes(share: FairShare, places: int) -> list[tuple[str, str, int]]:
    return [(lane.tenant.name, lane.priority, n) for lane, n in share.assign(places)]


def test_interactive_turns_of_every_tenant_get_places_before_batch_ones():
    share = _share()
    _with(share, "bulk", waiting=0, batch=100)  # holds nothing: fewest for its weight
    _with(share, "a", waiting=2, held=3, batch=10)
    _with(share, "b", waiting=1, held=1)
    assert _lanes(share, 3) == [("b", "interactive", 1), ("a", "interactive", 2)]
    # the places left go to the batch lanes, the tenant holding fewest first
    assert _lanes(share, 5) == [
        ("b", "interactive", 1), ("a", "interactive", 2), ("bulk", "batch", 2)
    ]  # fmt: skip


def test_a_tenants_batch_lane_counts_its_interactive_places_and_the_cap_spans_both():
    share = _share()
    share.settings = ServiceSettings(max_active_turns=8, tenant_max_active=3)
    _with(share, "a", waiting=2, batch=100)
    _with(share, "b", waiting=0, held=1, batch=100)
    # a: 2 interactive, then 1 batch (its cap of 3); b: 2 batch (1 held, its cap of 3)
    assert sorted(_lanes(share, 8)) == [
        ("a", "batch", 1), ("a", "interactive", 2), ("b", "batch", 2)
    ]  # fmt: skip


def test_a_tenant_whose_interactive_turn_waits_for_a_batch_turn_has_its_batch_lane_served_first():
    share = _share()
    _with(share, "a", waiting=0, held=2, batch=5)
    _with(share, "b", waiting=100, held=2)
    assert _lanes(share, 2) == [("b", "interactive", 2)]
    share.inherit("a", True)  # a's interactive turn waits behind a batch turn of its session
    assert _lanes(share, 2) == [("a", "batch", 1), ("b", "interactive", 1)]  # shared fairly
    share.inherit("a", False)
    assert _lanes(share, 2) == [("b", "interactive", 2)]
