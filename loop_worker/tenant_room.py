"""``[loop_worker] tenant_max_active``: at most that many turns of one tenant run in this
process at once (0: no limit). The fleet-wide cap is ``[tenants] max_active_turns``
(:mod:`.agent_slots`); this one keeps one tenant from taking every place of a worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TenantRoom:
    """``async with room.slot(tenant):`` waits until the tenant runs fewer than
    ``limit`` turns here, and holds one place of it meanwhile."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._running: dict[str, int] = {}
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        if not self.limit:
            yield
            return
        async with self._changed:
            await self._changed.wait_for(lambda: self._running.get(tenant, 0) < self.limit)
            self._running[tenant] = self._running.get(tenant, 0) + 1
        try:
            yield
        finally:
            async with self._changed:
                self._running[tenant] -= 1
                if not self._running[tenant]:
                    del self._running[tenant]
                self._changed.notify_all()
