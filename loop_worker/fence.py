"""The fence of a running turn's writes: nothing once its lease lapsed by the worker's clock.

A loop worker cut off from NATS mid-turn cannot renew its lease; the lease's TTL frees it
on the server and another worker takes the turn over, and may end it before the network
heals. Whatever the cut-off worker wrote for the turn must not be stored after that: an
event after the turn's ``loop_end`` is a zombie write. The lease's revision checks fence
checkpoints only once someone else wrote the session; events have no such check. So the
worker fences itself, by its own clock (:meth:`Lease.lapsed <loop_worker.lease.Lease.lapsed>`,
:data:`MARGIN` of the TTL early; the server frees the lease no earlier, since its TTL
counts from a write the worker sent after it started counting):

- **no write after the lapse**: :meth:`Fence.writable` is the events sink's check before
  it hands an event to the client, and the checkpoint's before it goes out; an event of a
  turn that may not write stays pending and its flush raises
  :class:`~loop_worker.errors.LeaseLostError` (:mod:`.sink`);
- **nothing written before it delivered after it**: :meth:`Fence.run` looks every
  twentieth of the TTL; a running turn whose lease lapsed is lost (muted, stopped, no ack:
  :meth:`TurnRun.lose <loop_worker.turn.TurnRun.lose>`) and the connection is reset
  (:func:`loopmesh.nats.reset`). A cut drops packets without a word, so the client still
  believes itself connected, and what it wrote sits in the kernel, sent again and again
  until the network heals; a reset discards it, where a close would still deliver it.
  The worker reconnects; its other turns publish again what the reset dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from nats.aio.client import Client

from loopmesh.aio import raise_if_cancelled
from loopmesh.nats import reset

from .errors import LeaseLostError

if TYPE_CHECKING:
    from .lease import Leases
    from .turn import TurnRun

log = logging.getLogger("loopmesh.loop_worker.fence")

#: A lease counts as lapsed this share of its TTL before it expires by the local clock.
MARGIN = 0.1
CHECKS = 20  # looks per TTL


class Fence:
    """The fence of the turns running in one worker (``running``: by session key)."""

    def __init__(self, nc: Client, leases: Leases, running: Mapping[str, TurnRun]) -> None:
        self._nc = nc
        self._leases = leases
        self._running = running

    @property
    def margin_s(self) -> float:
        return self._leases.ttl_s * MARGIN

    def writable(self, key: str) -> bool:
        """Whether the turn ``key`` (its ``Turn.msg_id``) may still write: it runs here,
        and its lease was not lost and has not lapsed by this worker's clock."""
        held = self._running.get(key.rpartition(".")[0])  # tokens hold no "."
        if held is None or held.turn is None or held.turn.msg_id != key:
            return False
        lease = held.lease
        return (
            held.lost is None
            and lease is not None
            and not lease.released
            and not lease.lapsed(self.margin_s)
        )

    async def run(self) -> None:
        """Lose every running turn whose lease lapsed, and reset the connection."""
        while True:
            await asyncio.sleep(self._leases.ttl_s / CHECKS)
            lapsed = [h for h in self._running.values() if self.lapsed(h)]
            if lapsed:
                for held in lapsed:
                    self.lose(held)
                log.warning(
                    "%d lease(s) lapsed by this worker's clock: resetting its connection, "
                    "so nothing it wrote under them is delivered late",
                    len(lapsed),
                )
                await reset(self._nc)
            raise_if_cancelled()

    def lapsed(self, held: TurnRun) -> bool:
        """Whether the running turn ``held``, not lost yet, has a lease that lapsed."""
        lease = held.lease
        return (
            held.lost is None
            and lease is not None
            and not lease.released
            and lease.lapsed(self.margin_s)
        )

    @staticmethod
    def lose(held: TurnRun) -> None:
        """Stop the turn ``held``, keeping nothing: its lease lapsed."""
        assert held.lease is not None
        key = held.lease.key
        held.lose(LeaseLostError(key, f"the lease of session {key} lapsed by this worker's clock"))
