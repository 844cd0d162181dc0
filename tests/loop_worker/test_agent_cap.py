"""An agent's ``max_active_turns`` on real loop-worker processes: a tenant's turns of the
agent (naming it, or in a session of it) never run more than that many at once across
the fleet, the others wait (with a ``turn_queued`` naming the agent) and all end; the
tenant's turns of other agents are not held back; the slots of a worker killed with
SIGKILL free when their TTL passes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    drained,
    provision_short,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import tool_calls
from schemas import Turn
from tests.conftest import BOTH
from tests.loop_worker.durable import send_turn

pytestmark = pytest.mark.slow

READY = "loop worker ready"
CAP = 2
CONFIG = f"""
[[agents]]
name = "slow"
model = "slow-model"
max_active_turns = {CAP}
"""


def answer(delay_s: float) -> object:
    """A model reply that streams for about ``4 * delay_s``, then ends the turn."""
    return tool_calls(("task_completion", {"result": "ok"}), content="abcd", chunk_size=1,
                      delay_s=delay_s)  # fmt: skip


class Events:
    """The mesh's ``loop_start``, ``loop_end`` and ``turn_queued`` events, as they arrive."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.changed = asyncio.Event()

    async def on(self, msg) -> None:
        self.seen.append(json.loads(msg.data))
        self.changed.set()

    def of(self, type_: str, prefix: str) -> list[dict]:
        return [e for e in self.seen if e["type"] == type_ and e["turn_id"].startswith(prefix)]

    def ended(self, prefix: str) -> set[str]:
        return {e["turn_id"] for e in self.of("loop_end", prefix)}

    async def until(self, done, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    def most_running(self, prefix: str, *, worker: str = "", since: float = 0.0) -> int:
        """The most turns of ``prefix`` running at once (started on ``worker``, if given,
        and since ``since``), from the events' times: each turn once (a core subscriber
        may hear a turn's ``loop_end`` twice)."""
        started = {
            e["turn_id"]
            for e in self.of("loop_start", prefix)
            if e["ts"] >= since and (not worker or e["worker"] == worker)
        }
        moments: dict[tuple[str, str], float] = {}
        for e in self.seen:
            ours = e["type"] in ("loop_start", "loop_end") and e["turn_id"] in started
            if ours and e["ts"] >= since:
                moments.setdefault((e["type"], e["turn_id"]), e["ts"])
        running = most = 0
        for (type_, _), _ts in sorted(moments.items(), key=lambda p: (p[1], p[0][0] != "loop_end")):
            running += 1 if type_ == "loop_start" else -1
            most = max(most, running)
        return most


@pytest.fixture
def fleet_config() -> str:
    """The fleet's ``loopmesh.toml`` (a module of tests of another cap sets its own)."""
    return CONFIG


@pytest.fixture
async def fleet(durable, tmp_path, fleet_config):
    """Two loop-worker processes of 4 places each, configured by ``fleet_config`` (here,
    the ``slow`` agent capped)."""
    nc = await connect_fast(durable.url)
    await provision_short(nc, replicas=durable.replicas)
    config = tmp_path / "loopmesh.toml"
    config.write_text(fleet_config)
    events = Events()
    subs = [
        await nc.subscribe(f"loopmesh.events.*.*.{type_}", cb=events.on)
        for type_ in ("loop_start", "loop_end", "turn_queued")
    ]
    procs: dict[str, Proc] = {}
    async with FakeLLM(default=answer(0.05), models=("fake-model", "slow-model")) as llm:

        async def start() -> None:
            for name in ("w1", "w2"):
                env = worker_env(
                    durable.url, llm.base_url, replicas=durable.replicas, name=name,
                    max_active_turns=4, max_waiting_turns=4,
                )  # fmt: skip
                proc = Proc("-m", "loop_worker", env={**env, "LOOPMESH_CONFIG": str(config)})
                procs[name] = proc
                await proc.start(READY)

        class Fleet:
            pass

        f = Fleet()
        f.nc, f.events, f.llm, f.start, f.procs = nc, events, llm, start, procs
        try:
            yield f
        finally:
            for proc in procs.values():
                await proc.close()
            for sub in subs:
                await sub.unsubscribe()
            await nc.close()


def _turn(session: str, turn_id: str, agent: str | None = None) -> Turn:
    return Turn(
        id=turn_id, tenant="acme", session=session, input="hi", created_at=time.time(),
        agent=agent,
    )  # fmt: skip


async def _slow_turns(nc, count: int) -> None:
    """``count`` turns of the ``slow`` agent, each in a session of its own."""
    await asyncio.gather(*(send_turn(nc, _turn(f"s{k}", f"slow{k}", "slow")) for k in range(count)))


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_an_agents_max_active_turns_caps_its_turns_across_the_fleet(fleet):
    fleet.llm.script_for("slow-model", *[answer(0.25) for _ in range(40)])  # about 1 s each
    await fleet.start()
    await _slow_turns(fleet.nc, 8)
    for k in range(4):  # naming no agent: they run as their session's, and count in its cap
        await send_turn(fleet.nc, _turn(f"s{k}", f"slowb{k}"))
    for k in range(3):  # the tenant's turns of its default agent, published after
        await send_turn(fleet.nc, _turn(f"d{k}", f"dflt{k}"))
    await fleet.events.until(lambda: len(fleet.events.ended("dflt")) == 3, timeout=60)
    # they ran while the slow agent's turns still waited for its slots
    assert len(fleet.events.ended("slow")) < 12
    await fleet.events.until(lambda: len(fleet.events.ended("slow")) == 12, timeout=120)
    assert fleet.events.most_running("slow") == CAP  # reached, and never passed
    queued = fleet.events.of("turn_queued", "")
    assert queued and {e["agent"] for e in queued} == {"slow"}
    assert all(e["turn_id"].startswith("slow") for e in queued)
    await drained(fleet.nc, SUBJECTS.turns_stream)  # every turn acked


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_the_slots_of_a_killed_worker_free_and_the_waiting_turns_end(fleet):
    fleet.llm.script_for("slow-model", *[answer(0.5) for _ in range(40)])  # about 2 s each
    await fleet.start()
    await _slow_turns(fleet.nc, 5)
    await killing_a_holder_frees_its_slot(fleet, "slow", 5, CAP)


async def killing_a_holder_frees_its_slot(fleet, prefix: str, turns: int, cap: int) -> None:
    """SIGKILL the worker that started the first of the ``turns`` turns of ``prefix``,
    holding a slot; all of them end, and the other runs ``cap`` at once after the kill,
    once the slot the victim held lapsed."""
    await fleet.events.until(lambda: fleet.events.of("loop_start", prefix), timeout=60)
    victim = fleet.events.of("loop_start", prefix)[0]["worker"]
    other = "w2" if victim == "w1" else "w1"
    fleet.procs[victim].kill()
    killed = time.time()
    await fleet.events.until(lambda: len(fleet.events.ended(prefix)) == turns, timeout=120)
    assert fleet.events.most_running(prefix, worker=other, since=killed) == cap
    await drained(fleet.nc, SUBJECTS.turns_stream)
