"""Session leases: one loop worker runs a session at a time.

A lease is the key ``<tenant>.<session>`` in the leases bucket, whose TTL (the bucket's
max age) frees it when its holder dies. :meth:`Leases.try_acquire` creates the key
(``kv.create`` fails while someone holds it); :meth:`Lease.keep` renews it every third
of the TTL with a revision check, and raises :class:`~loop_worker.errors.LeaseLostError`
when it can no longer be sure it holds it; :meth:`Lease.release` deletes it if it is
still ours. (The loop worker renews the leases of all its turns from one loop instead,
with :meth:`Lease.due` and :meth:`Lease.renew`: a task per turn costs more than the
turn's requests.) The delete leaves a marker whose revision the worker remembers, so
taking the same session's lease again is one write (``kv.create`` would need three
round trips over a marker: a failed create, a read, an update; a take while the
worker's own release of the key is on its way waits for it), and when that write
succeeds nobody held the key since (:attr:`Lease.continued`; what the loop worker
makes of that: :func:`loop_worker.turn.warm`). Only a release that ends a run of the
session (``release(continuable=True)``) leaves a marker to continue from: a lease taken
and given back unused (the session's last turn was still in the stream) vouches for
nothing the worker kept of the session, which may be turns old.

The same bucket holds the slots of agents' ``max_active_turns`` (:mod:`.agent_slots`):
:meth:`Leases.try_acquire_one` takes a lease on any free key of a set, a semaphore whose
places free as leases do.

A worker that waits for a session (its lease, or its last turn's hand-over, which ends
with the lease's release) is woken by the release itself (:meth:`Leases.handover`: a
watch of the key's deletes), not by polling; it reads again a few times just after a
wake (what the wake announced can take a moment to show: a cluster applies an ack to
the stream after it answers it), then only on a slow timer, for a lease that lapses
(its holder died: a lapse writes nothing)::

    lease = await leases.acquire("acme", "s1", turn_id)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(lease.keep())
            ...
    finally:
        await lease.release()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence

import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError
from prometheus_client import Counter, Gauge

from loopmesh.aio import raise_if_cancelled
from loopmesh.jetstream import KV, Deletions, KeyWatch, Publisher, is_transient, replicated, retry
from schemas import Subjects, session_key
from schemas.streams import LEASE_TTL_S

from .errors import LeaseLostError

log = logging.getLogger("loopmesh.loop_worker.lease")

HELD = Gauge("loopmesh_leases_held", "Session leases this worker holds")
CONFLICTS = Counter(
    "loopmesh_lease_conflicts", "Lease attempts refused because another worker held the session"
)

DEFAULT_TTL_S = LEASE_TTL_S  # a bucket that states none
_MARKERS = 16_384  # released leases whose delete-marker revision is remembered
#: After a wake (or the watch's start), read again after these delays: what a release
#: announces can take a moment to show (an ack applied to a replicated stream after
#: it was answered; a watch's interest still reaching a cluster's other servers).
SETTLE_S = (0.005, 0.02, 0.1, 0.3)


class Handover:
    """A wait for a session's hand-over (:meth:`Leases.handover`)::

    while True:
        wait.mark()  # before each read of what is waited for
        if await ready():
            break
        await wait.next()
    """

    __slots__ = ("_deletions", "_idle_s", "_seen", "_settle")

    def __init__(self, deletions: Deletions, idle_s: float) -> None:
        self._deletions = deletions
        self._idle_s = idle_s
        self._seen = 0
        self._settle = 0

    def mark(self) -> None:
        """Note the releases seen so far: :meth:`next` waits for a later one."""
        self._seen = self._deletions.count

    async def next(self) -> None:
        """Until the next release (or one since :meth:`mark`), a settling read's delay
        after a wake, or the slow timer's."""
        settle = self._settle
        delay = SETTLE_S[settle] if settle < len(SETTLE_S) else self._idle_s
        self._settle += 1
        if await self._deletions.after(self._seen, delay):
            self._settle = 0


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a lease key holds: who, for which turn, which take, and a renewal count."""

    owner: str
    turn_id: str
    renewals: int = 0
    at: float = 0.0
    #: This take of the lease, among the worker's takes for the same turn (two
    #: deliveries of one turn can reach one worker): a release frees its own take only.
    take: str = ""


class Leases:
    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        owner: str,
        publisher: Publisher | None = None,
    ) -> None:
        self._nc = nc
        self._publisher = publisher or Publisher(nc)
        self._subjects = subjects
        self.owner = owner
        self._kv: KV | None = None
        self._markers: dict[str, int] = {}  # key → revision of the delete marker we left
        self._releasing: dict[str, asyncio.Event] = {}  # key → set once our release ends
        self._watch = KeyWatch(nc, subjects.leases_bucket)
        self.ttl_s = DEFAULT_TTL_S

    async def start(self) -> None:
        if self._kv is not None:
            return
        js = self._nc.jetstream()
        bucket = self._subjects.leases_bucket
        kv = await retry(lambda: js.key_value(bucket), "open leases bucket")
        status = await retry(kv.status, "leases bucket status")
        self.ttl_s = float(status.ttl or DEFAULT_TTL_S)
        await self._publisher.start()
        self._kv = KV(self._publisher, bucket, leader=replicated(status.stream_info))

    @property
    def kv(self) -> KV:
        if self._kv is None:
            raise RuntimeError("Leases not started")
        return self._kv

    async def try_acquire(self, tenant: str, session: str, turn_id: str) -> Lease | None:
        """The session's lease, or ``None`` while another worker holds it."""
        key = session_key(tenant, session)
        releasing = self._releasing.get(key)
        if releasing is not None:  # a turn of the session is handing it over here
            await releasing.wait()  # then its marker is known: one write takes the key
        record = LeaseRecord(
            owner=self.owner, turn_id=turn_id, at=time.time(), take=secrets.token_hex(6)
        )
        data = msgspec.json.encode(record)
        attempts = 0
        started = time.monotonic()
        last = marker = self._markers.pop(key, 0)

        async def create() -> int:
            nonlocal attempts, last
            attempts += 1
            try:
                return await self.kv.update(key, data, last)
            except KeyWrongLastSequenceError:
                if attempts > 1:
                    raise
                entry = await self.kv.entry(key)  # a holder, or a marker we do not know of
                current = entry.revision if entry is not None else 0
                if (entry is not None and entry.value is not None) or current == last:
                    raise
                last = current
                attempts += 1
                return await self.kv.update(key, data, last)

        try:
            revision = await retry(create, f"acquire lease {key}", timeout=self.ttl_s)
        except KeyWrongLastSequenceError:
            landed = await self._landed(key, data) if attempts > 1 else None
            if landed is None:
                CONFLICTS.inc()
                return None
            revision = landed
        lease = Lease(self, key, record, revision, expires=started + self.ttl_s)
        lease.continued = bool(marker) and attempts == 1
        return lease

    def _released(self, key: str, marker: int) -> None:
        if len(self._markers) >= _MARKERS:
            del self._markers[next(iter(self._markers))]
        self._markers[key] = marker

    async def try_acquire_one(
        self, keys: Sequence[str], turn_id: str, *, held: Gauge = HELD
    ) -> Lease | None:
        """A lease on one of ``keys`` that nobody holds, or ``None`` while all are held:
        a semaphore of ``len(keys)`` places (an agent's ``max_active_turns``). The keys
        are read at once, then the free ones tried in a random order (two workers that
        read the same free key race for it: the loser tries the next), each take a
        write checked against the revision read. ``held``: the gauge the lease counts in."""
        record = LeaseRecord(
            owner=self.owner, turn_id=turn_id, at=time.time(), take=secrets.token_hex(6)
        )
        data = msgspec.json.encode(record)
        started = time.monotonic()
        entries = await asyncio.gather(
            *(retry(functools.partial(self.kv.entry, key), f"read lease {key}") for key in keys)
        )
        free = [
            (key, entry.revision if entry is not None else 0)
            for key, entry in zip(keys, entries, strict=True)
            if entry is None or entry.value is None
        ]
        random.shuffle(free)
        for key, last in free:
            revision = await self._take(key, data, last)
            if revision is not None:
                return Lease(self, key, record, revision, expires=started + self.ttl_s, held=held)
        return None

    async def _take(self, key: str, data: bytes, last: int) -> int | None:
        """Write ``data`` to ``key`` if ``last`` is still its revision: the new revision,
        or ``None`` when someone wrote the key first."""
        attempts = 0

        async def write() -> int:
            nonlocal attempts
            attempts += 1
            return await self.kv.update(key, data, last)

        try:
            return await retry(write, f"acquire lease {key}", timeout=self.ttl_s)
        except KeyWrongLastSequenceError:  # a retried write may have landed the first time
            return await self._landed(key, data) if attempts > 1 else None

    @contextlib.asynccontextmanager
    async def released(self, keys: str, *, idle_s: float) -> AsyncIterator[Handover]:
        """A wait woken when a lease on ``keys`` (a key, or a pattern with ``*``) is
        released; without a release it reads again every ``idle_s``."""
        async with self._watch.on(keys) as deletions:
            yield Handover(deletions, idle_s=idle_s)

    async def acquire(self, tenant: str, session: str, turn_id: str) -> Lease:
        """Wait for the session's lease (it frees when released or its TTL passes),
        woken by its release."""
        lease = await self.try_acquire(tenant, session, turn_id)
        if lease is not None:
            return lease
        async with self.handover(tenant, session) as wait:
            while True:
                wait.mark()
                lease = await self.try_acquire(tenant, session, turn_id)
                if lease is not None:
                    return lease
                raise_if_cancelled()
                await wait.next()

    @contextlib.asynccontextmanager
    async def handover(self, tenant: str, session: str) -> AsyncIterator[Handover]:
        """A wait woken when the session's lease is released (its turn acked first).
        Without a release it reads again every sixth of the TTL: a holder that died
        lets its lease lapse, which writes nothing."""
        async with self._watch.on(session_key(tenant, session)) as deletions:
            yield Handover(deletions, idle_s=self.ttl_s / 6)

    async def holder(self, tenant: str, session: str) -> LeaseRecord | None:
        entry = await self.kv.entry(session_key(tenant, session))
        if entry is None or entry.value is None:
            return None
        return msgspec.json.decode(entry.value, type=LeaseRecord)

    async def _landed(self, key: str, data: bytes) -> int | None:
        entry = await retry(lambda: self.kv.entry(key), f"check lease {key}")
        return entry.revision if entry is not None and entry.value == data else None


class Lease:
    """A held lease. ``expires`` is when, by the local clock, it may have lapsed."""

    def __init__(
        self,
        leases: Leases,
        key: str,
        record: LeaseRecord,
        revision: int,
        *,
        expires: float,
        held: Gauge = HELD,
    ) -> None:
        self._leases = leases
        self.key = key
        self.record = record
        self.revision = revision
        self.expires = expires
        self.released = False
        #: Taken over this worker's own release (a write checked against the revision
        #: of the delete marker it left): nobody held the session in between.
        self.continued = False
        self._held = held
        held.inc()

    async def renew(self) -> None:
        """Extend the lease by a TTL; raise :class:`LeaseLostError` if it is not ours."""
        kv = self._leases.kv
        record = msgspec.structs.replace(
            self.record, renewals=self.record.renewals + 1, at=time.time()
        )
        data = msgspec.json.encode(record)
        started = time.monotonic()
        attempts = 0

        async def update() -> int:
            nonlocal attempts
            attempts += 1
            return await kv.update(self.key, data, self.revision)

        try:
            revision = await retry(update, f"renew lease {self.key}", timeout=self._remaining())
        except KeyWrongLastSequenceError:
            landed = await self._leases._landed(self.key, data) if attempts > 1 else None
            if landed is None:
                raise LeaseLostError(self.key) from None
            revision = landed
        except Exception as exc:
            if is_transient(exc):
                raise LeaseLostError(self.key, f"could not renew the lease of {self.key}") from exc
            raise
        self.record, self.revision = record, revision
        self.expires = started + self._leases.ttl_s

    async def keep(self) -> None:
        """Renew every third of the TTL until cancelled; raise :class:`LeaseLostError`."""
        interval = self._leases.ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            await self.renew()
            raise_if_cancelled()

    async def release(
        self, *, after: Awaitable[object] | None = None, continuable: bool = False
    ) -> None:
        """Delete the key if it is still ours. Idempotent; never raises but what
        ``after`` raises.

        ``after``: awaited first (the turn's ack), while a take of the key by this worker
        already waits for the release. ``continuable``: the lease ends a run of the
        session whose last snapshot this worker keeps, so a take over this release's
        marker may count as :attr:`Lease.continued`.

        A renewal that lands just before the delete moves the revision on: the key is
        read again and, while it still holds this lease's record, deleted at the new
        revision."""
        if self.released:
            if after is not None:
                await after
            return
        self.released = True
        self._held.dec()
        kv = self._leases.kv
        releasing = self._leases._releasing[self.key] = asyncio.Event()
        try:
            if after is not None:
                await after
        finally:
            await self._delete(kv, releasing, continuable)

    async def _delete(self, kv: KV, releasing: asyncio.Event, continuable: bool) -> None:
        try:
            try:
                marker = await retry(
                    lambda: kv.delete(self.key, self.revision),
                    f"release lease {self.key}",
                    timeout=5.0,
                )
            except KeyWrongLastSequenceError:
                entry = await retry(lambda: kv.entry(self.key), f"check lease {self.key}")
                if entry is None or entry.value is None or not self._ours(entry.value):
                    return  # expired, or someone else's now
                revision = entry.revision
                marker = await retry(
                    lambda: kv.delete(self.key, revision), f"release lease {self.key}", timeout=5.0
                )
        except Exception as exc:  # it expires by itself
            log.info("lease not released key=%s error=%r", self.key, exc)
        else:
            if continuable:
                self._leases._released(self.key, marker)
        finally:
            if self._leases._releasing.get(self.key) is releasing:
                del self._leases._releasing[self.key]
            releasing.set()

    def _ours(self, value: bytes) -> bool:
        try:
            record = msgspec.json.decode(value, type=LeaseRecord)
        except msgspec.DecodeError:
            return False
        mine = self.record
        return (record.owner, record.turn_id, record.take) == (mine.owner, mine.turn_id, mine.take)

    def unlapsed(self) -> bool:
        """Taken or renewed less than 80% of a TTL ago by both the monotonic and the wall
        clock. A worker frozen for longer (a stop signal, a paused VM) cannot vouch that
        nobody else ran the session meanwhile, whatever its lease says."""
        ttl = self._leases.ttl_s
        age = ttl - (self.expires - time.monotonic())
        return age < ttl * 0.8 and time.time() - self.record.at < ttl * 0.8

    def lapsed(self, margin_s: float = 0.0) -> bool:
        """Whether, by the local monotonic clock, the lease has lapsed or will within
        ``margin_s``: from then on nobody vouches that this worker still holds it (its
        TTL on the server counts from a write this worker sent before :attr:`expires`'s
        start, so the server frees it no earlier). The fence of every write of its
        turn (the loop worker's :meth:`~loop_worker.service.LoopWorker._writable`)."""
        return time.monotonic() >= self.expires - margin_s

    def due(self, now: float) -> bool:
        """Whether the lease should be renewed: a third of its TTL has passed since it
        was taken or last renewed (what :meth:`keep` waits between renewals)."""
        return not self.released and self.expires - now <= self._leases.ttl_s * 2 / 3

    def _remaining(self) -> float:
        return max(0.1, self.expires - time.monotonic())
