"""KV buckets on the hot path: reads and revision-checked writes through a
:class:`~loopmesh.publisher.Publisher`, a whole bucket read at once, and whether a
stream is replicated (on a cluster, reads go to the stream's leader).

    kv = await open_kv(js, publisher, "loopmesh-sessions")
    entry = await kv.entry("acme.s1")  # KVEntry(revision, value) or None
    revision = await kv.update("acme.s1", payload, last=entry.revision if entry else 0)
"""

from __future__ import annotations

import secrets

import msgspec
import nats.errors
import nats.js.errors
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
    """Every live key matching ``keys`` in ``bucket`` with its value, as of the call.

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
    )
    info = await js.add_consumer(stream, config)
    values: dict[str, bytes] = {}
    try:
        pending = info.num_pending or 0
        sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
        try:
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(pending, 256), timeout=timeout)
                except nats.errors.TimeoutError:
                    break  # the rest lapsed
                for msg in msgs:
                    pending = min(pending - 1, msg.metadata.num_pending)
                    key = msg.subject[len(prefix) :]
                    headers = msg.headers or {}
                    if headers.get("KV-Operation") or headers.get("Nats-Marker-Reason"):
                        values.pop(key, None)
                    else:
                        values[key] = msg.data
        finally:
            await quietly(sub.unsubscribe())
    finally:
        await quietly(js.delete_consumer(stream, info.name))
    return values
