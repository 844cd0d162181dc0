"""Which webhook each turn has, as its ``loop_start`` said.

The loop worker records a turn's webhook (the turn's own, else its agent's) in every
``loop_start`` of the turn. The service reads those in stream order, before any later
event of the turn (:meth:`Targets.record`), writes each to the webhooks bucket under the
turn's ``<tenant>.<session>.<turn>`` (``null`` for a turn without one) and only then
remembers it: a write that failed is made again when the ``loop_start`` is delivered
again, and the ``loop_start`` is acked only after its write. A restarted service, which
has forgotten what it read, finds every turn there, and so does another replica.

A turn the bucket does not know (:meth:`Targets.of` answers :data:`UNKNOWN`) is one
whose ``loop_start`` is still being stored elsewhere, is held by a process that died
(it is delivered again after the consumer's AckWait), or does not exist (a turn refused
before it started). The service waits for it (:meth:`Targets.wait`), up to a bound past
the AckWait; only what the bucket or a ``loop_start`` said is remembered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from typing import Final

import msgspec

from loopmesh.kv import KV
from schemas import Webhook, turn_msg_id
from schemas.events import Event, LoopStart

#: Turns remembered at once (the oldest are forgotten; the bucket still has them).
REMEMBERED = 100_000
#: How soon a turn the bucket does not know yet is looked up again while waited for:
#: the first wait, doubled each time up to the second.
LOOKUP_EVERY_S = (0.25, 5.0)


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: The answer for a turn whose ``loop_start`` is not recorded (yet).
UNKNOWN: Final = _Unknown()

_DECODER = msgspec.json.Decoder(Webhook | None)


class Targets:
    """Turn → its webhook (``None``: it has none), in memory over the webhooks bucket."""

    def __init__(self, kv: KV, *, remembered: int = REMEMBERED) -> None:
        self.kv = kv
        self._known: OrderedDict[str, Webhook | None] = OrderedDict()
        self._remembered = remembered
        self._recorded = asyncio.Condition()
        self.reads = 0  # bucket reads made (a turn not seen start here)

    async def record(self, start: LoopStart) -> None:
        """Store the webhook a ``loop_start`` names (``None`` too), then remember it.
        Raises when it cannot be stored: the caller hands the event back, and it is
        stored when delivered again."""
        key = turn_msg_id(start.tenant, start.session, start.turn_id)
        if key not in self._known or self._known[key] != start.webhook:
            await self.kv.put(key, msgspec.json.encode(start.webhook))
        self._remember(key, start.webhook)
        async with self._recorded:
            self._recorded.notify_all()

    async def of(self, event: Event) -> Webhook | _Unknown | None:
        """The webhook of the event's turn, ``None``, or :data:`UNKNOWN`: no
        ``loop_start`` of the turn is recorded."""
        key = turn_msg_id(event.tenant, event.session, event.turn_id)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        self.reads += 1
        entry = await self.kv.entry(key)
        if entry is None or entry.value is None:
            return UNKNOWN
        try:
            webhook = _DECODER.decode(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            webhook = None  # not one this service wrote: nothing to deliver to
        self._remember(key, webhook)
        return webhook

    async def wait(self, event: Event, within: float) -> Webhook | _Unknown | None:
        """:meth:`of`, asked again until the turn is known or ``within`` seconds pass
        (a ``loop_start`` recorded here wakes it at once)."""
        deadline = time.monotonic() + within
        every, longest = LOOKUP_EVERY_S
        while True:
            found = await self.of(event)
            left = deadline - time.monotonic()
            if found is not UNKNOWN or left <= 0:
                return found
            async with self._recorded:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(every, left)):
                        await self._recorded.wait()
            every = min(every * 2, longest)

    def _remember(self, key: str, webhook: Webhook | None) -> None:
        self._known[key] = webhook
        self._known.move_to_end(key)
        while len(self._known) > self._remembered:
            self._known.popitem(last=False)
