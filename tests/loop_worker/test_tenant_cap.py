"""A tenant's ``max_active_turns`` on real loop-worker processes: at most that many of
the tenant's turns run at once across the fleet, its interactive and batch turns
together (each lane's consumer alone would let that many run per lane); the others wait
(with a ``turn_queued`` whose ``cap`` is ``tenant``) and all end; another tenant's turns
are not held back; a turn waiting for its agent's cap holds none of its tenant's slots;
the slots of a worker killed with SIGKILL free when their TTL passes. The fleet is
:mod:`.test_agent_cap`'s, configured here."""

from __future__ import annotations

import time

import pytest

from loopmesh.testing.durable import SUBJECTS, drained
from schemas import Turn
from tests.conftest import BOTH
from tests.loop_worker.durable import send_turn
from tests.loop_worker.test_agent_cap import CONFIG, answer, fleet, killing_a_holder_frees_its_slot

__all__ = ["fleet"]  # the fixture, shared
pytestmark = pytest.mark.slow

CAP = 2


TENANT_CAPPED = f"""
[tenants.acme]
max_active_turns = {CAP}
"""


@pytest.fixture
def fleet_config() -> str:
    return TENANT_CAPPED


def _turn(
    tenant: str, session: str, turn_id: str, *, batch: bool = False, agent: str | None = None
) -> Turn:
    return Turn(
        id=turn_id, tenant=tenant, session=session, input="hi", created_at=time.time(),
        priority="batch" if batch else "interactive", agent=agent,
    )  # fmt: skip


async def _capped_turns(nc, count: int) -> None:
    """``count`` turns of the capped tenant in each lane, each in a session of its own."""
    for k in range(count):
        await send_turn(nc, _turn("acme", f"sb{k}", f"capb{k}", batch=True))
        await send_turn(nc, _turn("acme", f"si{k}", f"capi{k}"))


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_tenants_max_active_turns_caps_both_lanes_together_across_the_fleet(fleet):
    fleet.llm.script_for("fake-model", *[answer(0.25) for _ in range(60)])  # about 1 s each
    await fleet.start()
    await _capped_turns(fleet.nc, 6)
    for k in range(3):  # another tenant's, with no cap, published after
        await send_turn(fleet.nc, _turn("beta", f"f{k}", f"free{k}"))
    await fleet.events.until(lambda: len(fleet.events.ended("free")) == 3, timeout=60)
    # they ran while the capped tenant's turns still waited for its slots
    assert len(fleet.events.ended("cap")) < 12
    await fleet.events.until(lambda: len(fleet.events.ended("cap")) == 12, timeout=120)
    assert fleet.events.most_running("cap") == CAP  # reached, and never passed
    queued = fleet.events.of("turn_queued", "")
    assert queued and {e["cap"] for e in queued} == {"tenant"}
    assert all(e["turn_id"].startswith("cap") and not e["agent"] for e in queued)
    await drained(fleet.nc, SUBJECTS.turns_stream)  # every turn acked


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_the_tenant_slots_of_a_killed_worker_free_and_the_waiting_turns_end(fleet):
    fleet.llm.script_for("fake-model", *[answer(0.5) for _ in range(40)])  # about 2 s each
    await fleet.start()
    await _capped_turns(fleet.nc, 3)
    await killing_a_holder_frees_its_slot(fleet, "cap", 6, CAP)  # a slot of the tenant


@pytest.mark.parametrize("durable", BOTH, indirect=True)
@pytest.mark.parametrize("fleet_config", [CONFIG + "\n[tenants.acme]\nmax_active_turns = 3\n"])
async def test_a_turn_waiting_for_its_agent_holds_none_of_its_tenants_slots(fleet):
    # the slow agent is capped at 2 (test_agent_cap's CONFIG), the tenant at 3: the slow
    # agent's third turn waits for its agent, and leaves the tenant's third slot free
    fleet.llm.script_for("slow-model", *[answer(2.5) for _ in range(3)])  # about 10 s each
    await fleet.start()
    for k in range(3):
        await send_turn(fleet.nc, _turn("acme", f"s{k}", f"slow{k}", batch=True, agent="slow"))
    await fleet.events.until(lambda: fleet.events.of("turn_queued", "slow"), timeout=60)
    for k in range(3):  # the default agent's, one at a time in the tenant's third slot
        await send_turn(fleet.nc, _turn("acme", f"d{k}", f"dflt{k}"))
    await fleet.events.until(lambda: len(fleet.events.ended("dflt")) == 3, timeout=60)
    assert not fleet.events.ended("slow")  # no slow turn had to end to make room
    await fleet.events.until(lambda: len(fleet.events.ended("slow")) == 3, timeout=120)
    assert fleet.events.most_running("slow") == 2
    assert fleet.events.most_running("") == 3
    # the third slow turn waited for its agent first; once it has its agent's slot it may
    # still wait for its tenant's, as any turn of the tenant does
    caps = [e["cap"] for e in fleet.events.of("turn_queued", "slow")]
    assert caps[0] == "agent" and set(caps) <= {"agent", "tenant"}, caps
    await drained(fleet.nc, SUBJECTS.turns_stream)


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_capped_tenants_batch_turns_run_once_its_interactive_ones_have(fleet):
    # each worker hears all 16 turns published and takes about half: what it counted of
    # the others' stays counted unless its consumer is asked once a pull comes back empty
    fleet.llm.script_for("fake-model", *[answer(0.02) for _ in range(40)])
    await fleet.start()
    for k in range(16):
        await send_turn(fleet.nc, _turn("acme", f"si{k}", f"capi{k}"))
    await fleet.events.until(lambda: len(fleet.events.ended("capi")) == 16, timeout=120)
    for k in range(3):
        await send_turn(fleet.nc, _turn("acme", f"sb{k}", f"capb{k}", batch=True))
    await fleet.events.until(lambda: len(fleet.events.ended("capb")) == 3, timeout=60)
    await drained(fleet.nc, SUBJECTS.turns_stream)
