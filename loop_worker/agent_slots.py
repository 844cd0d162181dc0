"""An agent's ``max_active_turns``, and a tenant's: at most that many of a tenant's turns
(of the agent) run at once, across every loop worker.

The agent is in the turn's body, not in its subject, so the server cannot count it; and a
tenant's turns come through two consumers (its lanes), each of which can count only its
own. The workers count them together instead, in the leases bucket: a cap of ``N`` is
``N`` slot keys ``<tenant>.<agent>.<k>`` (``k`` from 0 to ``N - 1``), the tenant's own
under the name :data:`TENANT`, which no agent can have (an agent's name is a token, and a
token has no ``=``). A running turn holds one of them as it holds its session's lease
(:meth:`~loop_worker.lease.Leases.try_acquire_one`: the keys read at once, a free one
taken by a revision-checked write). The slot is renewed with the session's lease,
released after the turn's ack, and lapses with the bucket's TTL when its worker dies.
A tenant's cap is in the configuration (``[tenants]``, :meth:`FairShare.limits
<loop_worker.share.FairShare.limits>`): knowing a tenant has none reads nothing.

A turn that finds every slot taken is held, not handed back: each hand-back is a
delivery, and deliveries are the poison limit (``max_deliver``), so a turn behind a long
line of its agent's turns would be dead-lettered. It waits as a turn waits for an earlier
turn of its session (no running place used, in-progress acks), woken by a release of
one of the slots (a watch of their deletes), with a read every third of the lease TTL
for a slot that lapsed. One waiter per set of slots in each worker reads them; the others
queue behind it in the worker, in the order they came. A worker whose every place is
held hands back, to make room, a turn that waited ``order_wait_s``; a stopping worker
hands back the turns that wait.

A turn of a capped agent of a capped tenant takes its agent's slot first, then its
tenant's, and holds the first while it waits for the second. The other order would
hold a tenant's slot while waiting for an agent's: turns of a busy agent would fill
their tenant's cap doing nothing, and the tenant's other agents wait behind them. An
agent's slots are its tenant's (one set per tenant), so a turn holding one while it
waits for its tenant's keeps nothing from a turn that could run: that turn would need
a tenant slot too. Every turn takes them in that one order, and a turn holding a
tenant slot waits for no other slot, so no two turns wait for each other's slots.

Its session gets one ``turn_queued`` event when the wait begins, naming the agent, or
with ``cap = "tenant"`` for the tenant's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import Counter, Gauge

from loopmesh.jetstream import Publisher, acked, quietly
from schemas import Subjects, Turn, encode
from schemas.events import TurnQueued

from .agents import AgentBook
from .lease import Lease, Leases

log = logging.getLogger("loopmesh.loop_worker.agent_slots")

SLOTS_HELD = Gauge(
    "loopmesh_loop_agent_slots_held",
    "Slots of agents' max_active_turns this worker's running turns hold, by agent",
    ["agent"],
)
SLOT_WAITS = Counter(
    "loopmesh_loop_agent_slot_waits",
    "Turns that waited for a slot of their agent's max_active_turns, by agent",
    ["agent"],
)
TENANT_SLOTS_HELD = Gauge(
    "loopmesh_loop_tenant_slots_held",
    "Slots of tenants' max_active_turns this worker's running turns hold, by tenant",
    ["tenant"],
)
TENANT_SLOT_WAITS = Counter(
    "loopmesh_loop_tenant_slot_waits",
    "Turns that waited for a slot of their tenant's max_active_turns, by tenant",
    ["tenant"],
)

#: The name of a tenant's own slots, among its agents' (no agent's name has a ``=``).
TENANT = "=tenant"


def slot_keys(tenant: str, agent: str, cap: int) -> list[str]:
    """The leases bucket's keys of ``agent``'s ``cap`` slots for ``tenant``'s turns
    (``agent`` :data:`TENANT`: the tenant's own)."""
    return [f"{tenant}.{agent}.{k}" for k in range(cap)]


class GaveUp(Exception):
    """The turn stops waiting for a slot (its worker is full, or stopping): hand it back."""


class AgentSlots:
    """The slots of the capped agents and tenants, for one worker's turns::

    cap = await slots.cap(agent)  # None: no cap; a tenant's is in [tenants], read by .share
    slot = await slots.try_take(turn, agent, cap) or await slots.wait(turn, agent, cap, ...)
    try:
        ...  # run the turn; slot.renew() with its lease
    finally:
        await slot.release()
    """

    def __init__(
        self,
        leases: Leases,
        agents: AgentBook,
        publisher: Publisher,
        subjects: Subjects,
    ) -> None:
        self._leases = leases
        self._agents = agents
        self._publisher = publisher
        self._subjects = subjects
        self._lines: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # one waiter reads

    async def any_capped(self) -> bool:
        """Whether any agent has a cap (else a turn's agent need not be known here)."""
        try:
            await self._agents.loaded()
        except Exception:  # the engine refuses the turn (agents_unavailable)
            return False
        return any(spec.max_active_turns for spec in self._agents.items())

    async def cap(self, agent: str) -> int | None:
        """``agent``'s ``max_active_turns`` (``None``: no cap, or no such agent: the
        engine refuses its turns)."""
        try:
            spec = await self._agents.agent(agent)
        except Exception:  # the engine refuses the turn (agents_unavailable)
            return None
        return spec.max_active_turns if spec is not None else None

    async def try_take(self, turn: Turn, agent: str, cap: int) -> Lease | None:
        """A free slot of ``agent`` (:data:`TENANT`: of the turn's tenant) for ``turn``,
        or ``None`` while all are taken."""
        keys = slot_keys(turn.tenant, agent, cap)
        if agent == TENANT:
            held = TENANT_SLOTS_HELD.labels(turn.tenant)
        else:
            held = SLOTS_HELD.labels(agent)
        return await self._leases.try_acquire_one(keys, turn.id, held=held)

    async def wait(self, turn: Turn, agent: str, cap: int, *, give_up: Callable[[], bool]) -> Lease:
        """A slot of ``agent`` for ``turn``, once one frees; its session hears that it
        waits. Raises :class:`GaveUp` when ``give_up()`` says so after a read."""
        if agent == TENANT:
            TENANT_SLOT_WAITS.labels(turn.tenant).inc()
        else:
            SLOT_WAITS.labels(agent).inc()
        await self._queued(turn, agent)
        name = f"{turn.tenant}.{agent}"
        async with self._line(name):
            idle_s = self._leases.ttl_s / 3  # a slot that lapsed (its worker died)
            async with self._leases.released(f"{name}.*", idle_s=idle_s) as wait:
                while True:
                    wait.mark()
                    slot = await self.try_take(turn, agent, cap)
                    if slot is not None:
                        return slot
                    if give_up():
                        raise GaveUp
                    await wait.next()

    @contextlib.asynccontextmanager
    async def _line(self, name: str) -> AsyncIterator[None]:
        """Wait in this worker's line for ``name``'s slots: its first waiter alone reads
        them (a release wakes one reader per worker, not every waiting turn)."""
        lock, users = self._lines.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._lines[name]

    async def _queued(self, turn: Turn, agent: str) -> None:
        """Tell the turn's session that it waits for its agent, or its tenant (once: its
        ``Nats-Msg-Id`` is the turn's)."""
        tenant = agent == TENANT
        event = TurnQueued(
            tenant=turn.tenant, session=turn.session, turn_id=turn.id, ts=time.time(),
            parent=turn.parent, agent="" if tenant else agent,
            cap="tenant" if tenant else "agent",
        )  # fmt: skip
        subject = self._subjects.event(turn.tenant, turn.session, event.type)
        headers = {"Nats-Msg-Id": f"{turn.msg_id}:queued:{agent}"}
        await quietly(acked(self._publisher, subject, encode(event), headers))
