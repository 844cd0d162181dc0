"""KV buckets on the hot path: reads and revision-checked writes through a
:class:`~loopmesh.publisher.Publisher`, a whole bucket read at once, and whether a
stream is replicated (on a cluster, reads go to the stream's leader).

    kv = await open_kv(js, publisher, "loopmesh-sessions")
    entry = await kv.entry("acme.s1")  # KVEntry(revision, value) or None
    revision = await kv.update("acme.s1", payload, last=entry.revision if entry else 0)

:class:`KeyWatch` wakes whoever waits for a key to be deleted, on the delete itself::

    async with watch.on("acme.s1") as deletions:
        while True:
            seen = deletions.count
            if await ready():  # a read of whatever the wait is for
                break
            await deletions.after(seen, timeout=5.0)  # a delete since ``seen``, or the timeout
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamInfo
from nats.js.client import JetStreamContext

from .aio import quietly
from .publisher import Publisher, acked
from .retry import retry

#: JetStream's error codes for a failed ``Nats-Expected-Last-Subject-Sequence`` check.
WRONG_LAST_SEQUENCE = (10071, 10164)


class KVEntry(msgspec.Struct, frozen=True):
    """A key's last revision: ``value`` is ``None`` for a delete or purge marker."""

    revision: int
    value: bytes | None


class KV:
    """The hot-path operations of one KV bucket through a :class:`Publisher`: a read is
    one get, a write one publish with a revision check.

    On a bucket with one replica a read is a direct get. With more (a cluster), a
    direct get may be answered by a follower that has not applied the last writes yet,
    so reads go to the stream's leader (``leader=True``, what :func:`open_kv` picks):
    a snapshot, a control or an effect record read stale could resume a turn from an
    old checkpoint or miss a recorded decision (docs/ARCHITECTURE.md, "On a cluster")."""

    def __init__(self, publisher: Publisher, bucket: str, *, leader: bool = False) -> None:
        self.publisher = publisher
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self.leader = leader

    async def entry(self, key: str, *, timeout: float = 5.0) -> KVEntry | None:
        """The key's last revision (a delete marker included), or ``None``."""
        get = self.publisher.leader_get if self.leader else self.publisher.direct_get
        msg = await get(self.stream, self.prefix + key, timeout=timeout)
        if msg is None:
            return None
        headers = msg.headers or {}
        revision = int(headers.get("Nats-Sequence", 0))
        if headers.get("KV-Operation"):
            return KVEntry(revision, None)
        return KVEntry(revision, msg.data)

    async def update(self, key: str, value: bytes, last: int, *, timeout: float = 5.0) -> int:
        """Write ``value`` if ``last`` is the key's revision (0: no key); the new revision.
        Raises :class:`~nats.js.errors.KeyWrongLastSequenceError` otherwise."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last)}
        return await self._write(key, value, headers, timeout)

    async def put(self, key: str, value: bytes, *, timeout: float = 5.0) -> int:
        """Write ``value`` whatever the key's revision; the new revision."""
        return await self._write(key, value, {}, timeout)

    async def delete(self, key: str, last: int, *, timeout: float = 5.0) -> int:
        """Put a delete marker if ``last`` is the key's revision; the marker's revision."""
        headers = {"KV-Operation": "DEL", "Nats-Expected-Last-Subject-Sequence": str(last)}
        return await self._write(key, b"", headers, timeout)

    async def _write(self, key: str, value: bytes, headers: dict[str, str], timeout: float) -> int:
        try:
            ack = await acked(self.publisher, self.prefix + key, value, headers, timeout=timeout)
        except nats.js.errors.APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                wrong = nats.js.errors.KeyWrongLastSequenceError(description=exc.description)
                raise wrong from None
            raise
        return ack.seq


class Deletions:
    """The deletions of one key seen since a watch of it began (:meth:`KeyWatch.on`)."""

    __slots__ = ("_changed", "count", "sub", "users")

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()
        self.users = 0
        self.sub: Subscription | None = None

    def seen(self) -> None:
        self.count += 1
        self._changed.set()

    async def after(self, seen: int, timeout: float) -> bool:
        """Wait until a deletion comes after the ``seen``-th (now or later), for at most
        ``timeout`` seconds; whether one came."""
        if self.count > seen:
            return True
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.count <= seen:
                    await self._changed.wait()
                    self._changed.clear()
        return self.count > seen


class KeyWatch:
    """Wakes the waiters of a bucket's key when anyone deletes or purges it, by a core
    subscription to the key's subject: a delete is a publish there (``KV-Operation``),
    seen whether the stream takes it or refuses it, so a waiter reads again whatever it
    waits for after a wake. Puts do not wake: a waiter for a key to be free would
    otherwise wake on every failed take of another waiter, and wake it in turn.

    A key's subscription is shared by its waiters in this process and ends with the
    last of them. What it cannot see: a value that lapses (the bucket's TTL writes
    nothing), and, on a cluster, a delete made before the subscription's interest
    reached the deleter's server (moments after it is made). So a waiter also reads
    again on a timer of its own choosing; a wake is a hint, the read decides."""

    def __init__(self, nc: Client, bucket: str) -> None:
        self._nc = nc
        self._prefix = f"$KV.{bucket}."
        self._keys: dict[str, Deletions] = {}

    @contextlib.asynccontextmanager
    async def on(self, key: str) -> AsyncIterator[Deletions]:
        """The deletions of ``key`` from now on (once the server holds the subscription)."""
        deletions = self._keys.get(key)
        if deletions is None:
            deletions = self._keys[key] = Deletions()

            async def wake(msg: Msg) -> None:
                if msg.headers and msg.headers.get("KV-Operation"):
                    deletions.seen()

            deletions.users += 1
            try:
                deletions.sub = await self._nc.subscribe(self._prefix + key, cb=wake)
            except BaseException:
                deletions.users -= 1
                self._drop(key, deletions)
                raise
        else:
            deletions.users += 1
        try:
            yield deletions
        finally:
            deletions.users -= 1
            sub = self._drop(key, deletions)
            if sub is not None:
                await quietly(sub.unsubscribe())

    def _drop(self, key: str, deletions: Deletions) -> Subscription | None:
        """Forget ``key``'s watch once nobody uses it; its subscription, to end."""
        if deletions.users or self._keys.get(key) is not deletions:
            return None
        del self._keys[key]
        return deletions.sub


async def open_kv(
    js: JetStreamContext, publisher: Publisher, bucket: str, *, timeout: float = 30.0
) -> KV:
    """A :class:`KV` of ``bucket`` (retrying through a reconnect): its reads go to the
    leader when the bucket has more than one replica."""
    kv = await retry(lambda: js.key_value(bucket), f"open bucket {bucket}", timeout=timeout)
    status = await retry(kv.status, f"bucket {bucket} status", timeout=timeout)
    await publisher.start()
    return KV(publisher, bucket, leader=replicated(status.stream_info))


def replicated(info: StreamInfo) -> bool:
    """Whether a stream keeps more than one replica (it runs on a cluster)."""
    return (info.config.num_replicas or 1) > 1


async def kv_values(
    js: JetStreamContext, bucket: str, keys: str = ">", *, timeout: float = 5.0
) -> dict[str, bytes]:
    """Every live key matching ``keys`` in ``bucket`` with its value, as of the call
    (see :func:`kv_entries`)."""
    entries = await kv_entries(js, bucket, keys, timeout=timeout)
    return {key: entry.value or b"" for key, entry in entries.items()}


async def kv_entries(
    js: JetStreamContext,
    bucket: str,
    keys: str = ">",
    *,
    timeout: float = 5.0,
    headers_only: bool = False,
) -> dict[str, KVEntry]:
    """Every live key matching ``keys`` in ``bucket`` with its last revision, as of the call
    (``headers_only``: with empty values, for whoever wants only the keys).

    A consumer that starts at each key's last revision, whose creation says how many
    messages it has to deliver, fetched until that many are in. (A KV watch cannot say
    when its initial values are in: nats-py marks them done early when the server has
    already pushed every value to a busy client.) Keys whose last revision lapses while
    being read are left out."""
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    config = ConsumerConfig(
        name=f"snapshot-{secrets.token_hex(8)}",
        filter_subject=prefix + keys,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=max(timeout, 5.0),
        headers_only=headers_only,
    )
    info = await js.add_consumer(stream, config)
    values: dict[str, KVEntry] = {}
    try:
        pending = info.num_pending or 0
        sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
        deadline = time.monotonic() + timeout
        try:
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(pending, 256), timeout=timeout)
                except TimeoutError:  # nats-py raises its own, or a plain one: the rest lapsed
                    break
                except nats.js.errors.ServiceUnavailableError:
                    # a consumer just made on a replicated stream answers 503 until its
                    # leader is elected (a loop worker's start on R3)
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
                    continue
                for msg in msgs:
                    pending = min(pending - 1, msg.metadata.num_pending)
                    key = msg.subject[len(prefix) :]
                    headers = msg.headers or {}
                    if headers.get("KV-Operation") or headers.get("Nats-Marker-Reason"):
                        values.pop(key, None)
                    else:
                        values[key] = KVEntry(msg.metadata.sequence.stream, msg.data)
        finally:
            await quietly(sub.unsubscribe())
    finally:
        await quietly(js.delete_consumer(stream, info.name))
    return values
