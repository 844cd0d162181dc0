"""Claims: which delivery of a tool call runs it, so that two deliveries at once run it
once.

JetStream hands a call to one worker at a time, with two exceptions on a cluster, both
when a consumer's leader changes while a call runs:

- a consumer leader that was paused (or cut off) while another was elected delivers,
  when it resumes and before it hears of its successor, what the successor has
  delivered too (one call started by two workers within a millisecond);
- a new leader, elected when the old one was killed, delivers again at once a call the
  old one had just delivered, though its worker is running it (the in-progress acks
  went to the dead leader): on nats-server 2.10, two workers some milliseconds apart.

The effect record cannot tell them apart, since neither has finished. So on a
replicated effects bucket, before a call runs, its delivery claims it: the key
``claim.<call id>`` of the effects bucket, written with a revision check, holds the
stream sequence and delivery count of the message that runs it, the worker, and when
the claim was last written. A delivery runs the call only if its write wins::

    if await claims.take(call_id, seq=meta.sequence.stream, delivery=meta.num_delivered):
        ...  # run it

While the call runs, its worker writes the claim again with each round of in-progress
acks (:meth:`Claims.renew`). A delivery that finds a claim written less than the
consumer's AckWait ago leaves the call to its claimant (not acked, not nakked: the
claimant acks the message by its stream sequence); so does one that finds the call
claimed by the same message at the same or a later delivery. A delivery after that
takes the claim over: its claimant died, or stalled (renewals stall with the cluster)
past AckWait, and the call runs again as before — at least once after a crash or such a
stall. A delivery left alone is delivered again after AckWait, by when a dead
claimant's claim has aged. A call published again under the same id after the stream's
duplicate window is a new message (another sequence), which takes an aged claim over
too. The age is measured between two workers' wall clocks: a skew of a few seconds
against AckWait (30 s by default) only moves when a takeover happens.

On one server there is one consumer leader and no such moment: no claim is written
(``Claims.open`` looks at the bucket's replicas), so a call costs nothing more there. On
a cluster a claim costs one revision-checked write before the tool runs (and a read on
a redelivery), and one more per in-progress round of a long call; claims expire with
the bucket's TTL, like the effect records.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError

from loopmesh.jetstream import KV, KVEntry, Publisher, replicated, retry
from schemas import Subjects

log = logging.getLogger("tool_worker.claims")


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    seq: int  # the stream sequence of the request message
    delivery: int  # its delivery count
    worker: str
    at: float = 0.0  # the claimant's wall clock when it last wrote the claim


class Claims:
    def __init__(self, kv: KV | None, worker: str, *, ack_wait_s: float = 30.0) -> None:
        self._kv = kv  # None: no claims (one server)
        self._worker = worker
        self._ack_wait_s = ack_wait_s
        self._held: dict[str, tuple[Claim, int]] = {}  # call id: (claim, its revision)

    @classmethod
    async def open(
        cls,
        nc: Client,
        publisher: Publisher,
        subjects: Subjects,
        worker: str,
        *,
        ack_wait_s: float = 30.0,
    ) -> Claims:
        bucket = subjects.effects_bucket
        info = await retry(lambda: nc.jetstream().stream_info(f"KV_{bucket}"), "effects info")
        kv = KV(publisher, bucket, leader=True) if replicated(info) else None
        return cls(kv, worker, ack_wait_s=ack_wait_s)

    async def take(self, call_id: str, *, seq: int, delivery: int) -> bool:
        """Claim the call for this delivery; False when another delivery has it."""
        kv = self._kv
        if kv is None:
            return True
        key = _key(call_id)
        mine = Claim(seq=seq, delivery=delivery, worker=self._worker, at=time.time())
        value = msgspec.json.encode(mine)
        # a first delivery tries a create at once; a redelivery reads what is there
        entry = await self._read(key) if delivery > 1 else None
        for _ in range(3):
            last = 0
            if entry is not None:
                if entry.value is not None:
                    held = msgspec.json.decode(entry.value, type=Claim)
                    if held == mine:  # our own write, landed before its ack was lost
                        self._held[call_id] = (mine, entry.revision)
                        return True
                    if held.seq == seq and held.delivery >= delivery:
                        return False
                    if time.time() - held.at < self._ack_wait_s:
                        return False  # its claimant renews it: running, not dead
                last = entry.revision
            try:
                update = functools.partial(kv.update, key, value, last)
                self._held[call_id] = (mine, await retry(update, f"claim {call_id}"))
                return True
            except KeyWrongLastSequenceError:
                entry = await self._read(key)
        return False

    async def renew(self, older_than: float = 0.0) -> None:
        """Write again, with the time now, each claim this worker holds (its calls still
        run) that was written at least ``older_than`` seconds ago: a delivery that comes
        meanwhile leaves the call to it. A claim taken over meanwhile is given up (the
        call runs elsewhere too: its worker took this one for dead or stalled)."""
        kv = self._kv
        if kv is None:
            return
        due = time.time() - older_than
        held = [(call_id, claim, rev) for call_id, (claim, rev) in self._held.items()]
        # at once: one slow write must not hold back the others, nor the in-progress acks
        await asyncio.gather(*(self._renew(kv, *h) for h in held if h[1].at <= due))

    async def _renew(self, kv: KV, call_id: str, claim: Claim, revision: int) -> None:
        renewed = msgspec.structs.replace(claim, at=time.time())
        try:
            new = await kv.update(_key(call_id), msgspec.json.encode(renewed), revision)
        except KeyWrongLastSequenceError:
            log.warning("claim taken over while the call runs here call_id=%s", call_id)
            self._held.pop(call_id, None)
            return
        except Exception as exc:  # the next round tries again
            log.warning("claim not renewed call_id=%s error=%r", call_id, exc)
            return
        if call_id in self._held:  # not ended meanwhile
            self._held[call_id] = (renewed, new)

    def end(self, call_id: str) -> None:
        """The call has ended here: its claim is no longer renewed (it expires with
        the bucket's TTL; its effect record answers from now on)."""
        self._held.pop(call_id, None)

    async def _read(self, key: str) -> KVEntry | None:
        kv = self._kv
        assert kv is not None
        return await retry(lambda: kv.entry(key), f"read {key}")


def _key(call_id: str) -> str:
    return f"claim.{call_id}"
