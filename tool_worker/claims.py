"""Claims: which delivery of a tool call runs it, so that two deliveries at once run it
once.

JetStream hands a call to one worker at a time, with one exception on a cluster: a
consumer leader that was paused (or cut off) while another was elected delivers, when
it resumes and before it hears of its successor, what the successor has delivered too.
Two workers then start the same call together (the chaos suite saw it: one call applied
by two workers within a millisecond). The effect record cannot tell them apart, since
neither has finished. So on a replicated effects bucket, before a call runs, its
delivery claims it: the key ``claim.<call id>`` of the effects bucket, written with a
revision check, holds the stream sequence and delivery count of the message that runs
it, and the worker. A delivery runs the call only if its write wins::

    if await claims.take(call_id, seq=meta.sequence.stream, delivery=meta.num_delivered):
        ...  # run it

A delivery that finds the call claimed by the same message at the same or a later
delivery leaves it to that one (not acked, not nakked: the claimant acks the message). A
later delivery takes the claim over: the claimant died, or stalled past AckWait, and a
redelivery runs the call again as before (at least once after a crash or such a stall).
A call published again under the same id after the stream's duplicate window is a new
message (another sequence), which takes the claim over too.

On one server there is one consumer leader and no such moment: no claim is written
(``Claims.open`` looks at the bucket's replicas), so a call costs nothing more there. On
a cluster a claim costs one revision-checked write before the tool runs (and a read on
a redelivery); claims expire with the bucket's TTL, like the effect records.
"""

from __future__ import annotations

import functools

import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError

from loopmesh.jetstream import KV, KVEntry, Publisher, replicated, retry
from schemas import Subjects


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    seq: int  # the stream sequence of the request message
    delivery: int  # its delivery count
    worker: str


class Claims:
    def __init__(self, kv: KV | None, worker: str) -> None:
        self._kv = kv  # None: no claims (one server)
        self._worker = worker

    @classmethod
    async def open(
        cls, nc: Client, publisher: Publisher, subjects: Subjects, worker: str
    ) -> Claims:
        bucket = subjects.effects_bucket
        info = await retry(lambda: nc.jetstream().stream_info(f"KV_{bucket}"), "effects info")
        kv = KV(publisher, bucket, leader=True) if replicated(info) else None
        return cls(kv, worker)

    async def take(self, call_id: str, *, seq: int, delivery: int) -> bool:
        """Claim the call for this delivery; False when another delivery has it."""
        kv = self._kv
        if kv is None:
            return True
        key = f"claim.{call_id}"
        mine = Claim(seq=seq, delivery=delivery, worker=self._worker)
        value = msgspec.json.encode(mine)
        # a first delivery tries a create at once; a redelivery reads what is there
        entry = await self._read(key) if delivery > 1 else None
        for _ in range(3):
            last = 0
            if entry is not None:
                if entry.value is not None:
                    held = msgspec.json.decode(entry.value, type=Claim)
                    if held == mine:
                        return True  # our own write, landed before its ack was lost
                    if held.seq == seq and held.delivery >= delivery:
                        return False
                last = entry.revision
            try:
                await retry(functools.partial(kv.update, key, value, last), f"claim {call_id}")
                return True
            except KeyWrongLastSequenceError:
                entry = await self._read(key)
        return False

    async def _read(self, key: str) -> KVEntry | None:
        kv = self._kv
        assert kv is not None
        return await retry(lambda: kv.entry(key), f"read {key}")
