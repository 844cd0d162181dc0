"""The tenants' LLM spend today, for the daily budgets (``[loop.budget]``).

Read from the usage ledger that the exporter writes from the events
(:mod:`loopmesh.usage`), at most once a second per tenant: a budget check before each
LLM call costs no read in between. The ledger is behind the events by the exporter's
flush (about a second) and what the tenant's other turns spend meanwhile, so a tenant
can pass its daily ceiling by what its turns spend in that time; a turn's own ceilings
(``turn_tokens``, ``turn_cost``) are exact.
"""

from __future__ import annotations

import time

from loopmesh.jetstream import KV, retry
from loopmesh.usage import day_of, read_day

_FRESH_S = 1.0


class LedgerUsage:
    """:class:`~loop_worker.engine.budget.UsageToday` over the usage bucket."""

    def __init__(self, kv: KV, *, fresh_s: float = _FRESH_S) -> None:
        self._kv = kv
        self._fresh_s = fresh_s
        self._read: dict[str, tuple[float, str, int, float]] = {}  # when, day, tokens, cost

    async def spent_today(self, tenant: str) -> tuple[int, float]:
        now, day = time.monotonic(), day_of(time.time())
        cached = self._read.get(tenant)
        if cached is not None and cached[1] == day and now - cached[0] < self._fresh_s:
            return cached[2], cached[3]
        found = await retry(lambda: read_day(self._kv, tenant, day), f"usage of {tenant}")
        tokens, cost = (found.tokens, found.cost) if found is not None else (0, 0.0)
        self._read[tenant] = (now, day, tokens, cost)
        return tokens, cost
