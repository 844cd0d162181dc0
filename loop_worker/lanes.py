"""What a loop worker knows of each tenant's turns, and who gets its free places.

A :class:`Tenant` has one :class:`Lane` per priority (:data:`LANES`), each counting the
turns believed waiting in its consumer, the places asked for and the turns held.

A place that frees on a worker goes to an interactive turn while any tenant has one
waiting, and to a batch turn only when none has: priority first, then fairness. Within a
lane it goes to the tenant with turns waiting that holds the fewest places there (both
lanes counted) for its weight (``[tenants]``). So a tenant alone gets every place (the
dispatch is work-conserving), one tenant's flood takes no place that another tenant's
turn of the same lane asks for (that turn waits for the next place to free, not behind
the flood), and no batch backlog stands in front of an interactive turn. An interactive
turn held behind a batch turn of its session lends its rank to its tenant's batch lane
while it waits (:attr:`Tenant.inheriting`). :func:`assign` is that rule; the pulls and
counts are :mod:`loop_worker.share`'s.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.types import Priority

#: The lanes, the first served first.
LANES: tuple[Priority, ...] = ("interactive", "batch")


@dataclass(eq=False)
class Lane:
    """What this worker knows of one lane of a tenant's turns: its consumer."""

    tenant: Tenant
    priority: Priority
    waiting: int = 0  # turns believed waiting in its consumer (errs high)
    asked: int = 0  # places asked for in pulls not yet answered
    held: int = 0  # its turns this worker holds
    rung: int = 0  # doorbells heard, ever
    consumer: bool = False  # its consumer is known to exist, with this lane's filter
    snooze_until: float = 0.0  # its consumer is at its fleet-wide cap until about then
    pulls: deque[str] = field(default_factory=deque)  # its pulls in flight, oldest first


@dataclass(eq=False)
class Tenant:
    """What this worker knows of one tenant's turns."""

    name: str
    weight: float
    inheriting: int = 0  # its interactive turns held here behind a batch turn of their session
    lanes: dict[Priority, Lane] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lanes = {p: Lane(self, p) for p in LANES}

    @property
    def held(self) -> int:
        return sum(lane.held for lane in self.lanes.values())

    @property
    def asked(self) -> int:
        return sum(lane.asked for lane in self.lanes.values())

    @property
    def waiting(self) -> int:
        return sum(lane.waiting for lane in self.lanes.values())

    def load(self, given: int = 0) -> float:
        return (self.held + self.asked + given) / self.weight


def assign(tenants: Iterable[Tenant], places: int, *, cap: int) -> list[tuple[Lane, int]]:
    """Share ``places`` between the tenants' lanes with turns waiting: the interactive
    lanes' first (and the batch lanes of tenants that inherit), then the batch lanes';
    within a rank one at a time to the tenant holding the fewest for its weight, its
    interactive lane first: ``[(lane, places), ...]``. ``cap``: the places one tenant may
    hold on this worker (0: no cap)."""
    tenants = list(tenants)
    given: dict[str, int] = {}  # places given to each tenant, both lanes
    lane_given: dict[Lane, int] = {}
    for rank in (0, 1):
        heap = [
            (t.load(given.get(t.name, 0)), t.name, LANES.index(lane.priority), lane)
            for t in tenants
            for lane in t.lanes.values()
            if _rank(lane) == rank and _wanting(lane, cap, 0, given.get(t.name, 0)) > 0
        ]
        heapq.heapify(heap)
        while places > 0 and heap:
            _, name, order, lane = heapq.heappop(heap)
            lane_given[lane] = lane_given.get(lane, 0) + 1
            given[name] = given.get(name, 0) + 1
            places -= 1
            if _wanting(lane, cap, lane_given[lane], given[name]) > 0:
                heapq.heappush(heap, (lane.tenant.load(given[name]), name, order, lane))
    return list(lane_given.items())


def _wanting(lane: Lane, cap: int, given: int = 0, tenant_given: int = 0) -> int:
    """Places ``lane`` could use now, beyond ``given`` (``tenant_given`` to its tenant,
    both lanes): its waiting turns not yet asked for, under this worker's per-tenant
    ``cap``."""
    if not lane.consumer or (
        lane.snooze_until and asyncio.get_running_loop().time() < lane.snooze_until
    ):
        return 0
    want = lane.waiting - lane.asked - given
    if cap:
        t = lane.tenant
        want = min(want, cap - t.held - t.asked - tenant_given)
    return want


def _rank(lane: Lane) -> int:
    """0: served first (an interactive lane, or the batch lane of a tenant whose
    interactive turn waits for a batch turn); 1: served when no rank 0 lane wants."""
    return 0 if lane.priority == "interactive" or lane.tenant.inheriting else 1
