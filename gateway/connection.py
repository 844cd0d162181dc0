"""The gateway's NATS connection and what every read and write on it goes through.

A call that NATS does not answer within ``timeout`` raises
:class:`~gateway.errors.Unavailable` (a 503 that says to try again); KV buckets are opened
once and a missing one is ``Unavailable`` too; revision-checked KV and direct gets go
through the connection's one :class:`~loopmesh.jetstream.Publisher`; a stream is read by
an ephemeral consumer (:meth:`Connection.stored_events`); :meth:`Connection.ready` is the
readiness probe. :class:`~gateway.backend.Backend` builds the gateway's operations on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from loopmesh.aio import quietly
from loopmesh.jetstream import KV, KVEntry, Publisher, kv_entries, replicated
from loopmesh.schedules import ScheduleStore
from loopmesh.settings import SchedulerSettings
from schemas import Subjects

from .errors import Unavailable

T = TypeVar("T")


class Connection:
    """One NATS connection of the gateway. ``max_schedules`` is ``[scheduler]
    max_per_tenant`` (:class:`~loopmesh.schedules.ScheduleStore`)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        timeout: float = 5.0,
        max_schedules: int = SchedulerSettings().max_per_tenant,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout = timeout
        self.max_schedules = max_schedules
        self.js: JetStreamContext = nc.jetstream(timeout=timeout)
        self._buckets: dict[str, KeyValue] = {}
        self._kvs: dict[str, KV] = {}
        self._publisher: Publisher | None = None  # for reads through the stream API
        self._schedules: ScheduleStore | None = None

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.timeout):
                return await call
        except TimeoutError:
            raise Unavailable(f"NATS did not answer in time ({what}); try again") from None

    async def _bucket(self, name: str) -> KeyValue:
        kv = self._buckets.get(name)
        if kv is None:
            try:
                kv = await self._call(f"open bucket {name}", self.js.key_value(name))
            except NotFoundError:
                raise Unavailable(
                    f"KV bucket {name} is missing; is loopmesh provisioned?"
                ) from None
            self._buckets[name] = kv
        return kv

    async def kv(self, bucket: str) -> KV:
        """``bucket`` for revision-checked reads and writes (read from the stream's leader
        on a cluster, so a write checked against a read never works from a stale one)."""
        kv = self._kvs.get(bucket)
        if kv is None:
            status = await self._call(
                f"bucket {bucket} status", (await self._bucket(bucket)).status()
            )
            kv = self._kvs[bucket] = KV(
                self.publisher(), bucket, leader=replicated(status.stream_info)
            )
        return kv

    async def entries(self, bucket: str, keys: str) -> dict[str, KVEntry]:
        """Every live key of ``bucket`` matching ``keys``, with its revision and value."""
        await self._bucket(bucket)
        return await self._call(
            f"list {bucket}", kv_entries(self.js, bucket, keys, timeout=self.timeout)
        )

    def publisher(self) -> Publisher:
        """The connection's publisher (acks and direct gets on one inbox)."""
        if self._publisher is None:
            self._publisher = Publisher(self.nc)
        return self._publisher

    async def call(self, what: str, call: Awaitable[T]) -> T:
        """``call``, or :class:`~gateway.errors.Unavailable` when NATS does not answer in time."""
        return await self._call(what, call)

    async def stored_events(
        self, stream: str, subject: str, start: int, what: str, batch: int = 256
    ) -> AsyncGenerator[list[Msg]]:
        """The messages of events stream ``stream`` (a partition's: the one that holds
        ``subject``'s events) on ``subject`` from sequence ``start`` to the last
        one stored when this starts, in batches of at most ``batch``, read by an ephemeral
        consumer (no acks, in memory, gone 30 s after its last use). A caller that stops
        early closes it (``contextlib.aclosing``) so the consumer goes at once. ``what``
        names the read in the error when NATS does not answer in time."""
        sub = await self._call(
            f"open {what}",
            self.js.pull_subscribe(
                subject,
                stream=stream,
                config=js_api.ConsumerConfig(
                    deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=start,
                    ack_policy=js_api.AckPolicy.NONE,
                    inactive_threshold=30.0,
                    mem_storage=True,
                ),
            ),
        )
        try:
            info = await self._call(f"{what} info", sub.consumer_info())
            pending = info.num_pending or 0
            while pending > 0:
                msgs = await self._call(
                    f"fetch {what}", sub.fetch(min(pending, batch), timeout=self.timeout)
                )
                if msgs:
                    pending = msgs[-1].metadata.num_pending or 0
                yield msgs
        finally:
            await quietly(sub.unsubscribe())

    # -- health -----------------------------------------------------------------------

    async def ready(self) -> str | None:
        """``None`` when NATS is connected and every stream exists, else what is wrong."""
        if not self.nc.is_connected:
            return "not connected to NATS"
        s = self.subjects
        for stream in (*s.turns_streams, *s.events_streams):
            try:
                await self._call("stream info", self.js.stream_info(stream))
            except NotFoundError:
                return f"stream {stream} is missing"
            except Unavailable as exc:
                return exc.message
        return None
