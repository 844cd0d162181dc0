"""Which webhook each turn has, as its ``loop_start`` said.

The loop worker records a turn's webhook (the turn's own, else its agent's) in every
``loop_start`` of the turn. The service reads those in stream order, before any later
event of the turn (:meth:`Targets.record`), and keeps them in memory, the turns without
a webhook too, so a turn's ``loop_end`` costs no lookup. A webhook is also written to
the webhooks bucket under the turn's ``<tenant>.<session>.<turn>``, before its
``loop_start`` is acked: a restarted service, which has forgotten what it read,
finds it there (:meth:`Targets.of`), and so does another replica.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from loopmesh.kv import KV
from schemas import Webhook, turn_msg_id
from schemas.events import Event, LoopStart

#: Turns remembered at once (the oldest are forgotten; the bucket still has them).
REMEMBERED = 100_000

_DECODER = msgspec.json.Decoder(Webhook)


class Targets:
    """Turn → its webhook (``None``: it has none), in memory over the webhooks bucket."""

    def __init__(self, kv: KV, *, remembered: int = REMEMBERED) -> None:
        self.kv = kv
        self._known: OrderedDict[str, Webhook | None] = OrderedDict()
        self._remembered = remembered
        self.reads = 0  # bucket reads made (a turn not seen start here)

    async def record(self, start: LoopStart) -> None:
        """Note the webhook a ``loop_start`` names; store it when it is new, so that it
        outlives this process. Raises when it cannot be stored (the caller hands the
        event back: it is noted again when delivered again)."""
        key = turn_msg_id(start.tenant, start.session, start.turn_id)
        before = self._known.get(key)
        self._remember(key, start.webhook)
        if start.webhook is not None and start.webhook != before:
            await self.kv.put(key, msgspec.json.encode(start.webhook))

    async def of(self, event: Event) -> Webhook | None:
        """The webhook of the event's turn, or ``None``."""
        key = turn_msg_id(event.tenant, event.session, event.turn_id)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        self.reads += 1
        entry = await self.kv.entry(key)
        webhook = None
        if entry is not None and entry.value:
            try:
                webhook = _DECODER.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                webhook = None  # not one this service wrote: nothing to deliver to
        self._remember(key, webhook)
        return webhook

    def _remember(self, key: str, webhook: Webhook | None) -> None:
        self._known[key] = webhook
        self._known.move_to_end(key)
        while len(self._known) > self._remembered:
            self._known.popitem(last=False)
