"""The tool catalog: every served tool's :class:`~schemas.ToolSpec` in a KV bucket under
``<server>.<tool>``.

Each worker puts its tools' specs when it starts, again whenever its tools change (an
MCP server re-listed), and every third of the bucket's TTL; specs of tools that no live
worker serves expire with the TTL. ``loopmesh tools`` reads it
with :func:`loopmesh.catalog.read_catalog`.

A pool that may run no worker at all (KEDA scales it to zero) is *pinned*
(``[tool_worker] pinned``): its specs are put with ``Nats-TTL: never``, which outlives the
bucket's max age, and say ``pinned``, so loop workers keep offering them while no worker
refreshes them. Liveness stays apart from the catalog: a backlog on the pool's consumer
is what wakes a worker. A worker of the pool with ``pinned`` off puts its specs plainly
again, and they then lapse with the TTL (how a pool is unpinned).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from loopmesh.aio import raise_if_cancelled
from loopmesh.jetstream import retry
from loopmesh.provision import PIN_HEADERS
from schemas import Subjects, catalog_key, encode

from .errors import PoolProvisionError
from .registry import Registry

log = logging.getLogger("tool_worker.catalog")

DEFAULT_REFRESH_S = 10.0


class Catalog:
    """Keeps one pool's specs of ``registry`` fresh in the catalog bucket."""

    def __init__(
        self,
        kv: KeyValue,
        js: JetStreamContext,
        bucket: str,
        registry: Registry,
        pool: str,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        pinned: bool = False,
    ) -> None:
        self._kv = kv
        self._js = js
        self._bucket = bucket
        self.pinned = pinned
        self._registry = registry
        self._pool = pool
        self.refresh_s = refresh_s
        self._changed = asyncio.Event()
        self._published: set[str] = set()
        self._first_done = False
        registry.on_change(self._changed.set)

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        subjects: Subjects,
        registry: Registry,
        pool: str,
        *,
        pinned: bool = False,
    ) -> Catalog:
        bucket = subjects.catalog_bucket  # a worker starting while a node does waits for it
        kv = await retry(lambda: js.key_value(bucket), f"open bucket {bucket}")
        status = await retry(kv.status, f"read bucket {bucket}")
        if pinned and not status.stream_info.config.allow_msg_ttl:
            raise PoolProvisionError(
                pool,
                f"a pinned pool puts its tools with Nats-TTL: never, but the catalog bucket "
                f"{subjects.catalog_bucket} has no per-message TTL (nats-server 2.11 or newer "
                "has it, and loopmesh's provisioning turns it on); upgrade the server and "
                "provision again, or set pinned = false",
            )
        ttl = status.ttl
        refresh_s = ttl / 3 if ttl else DEFAULT_REFRESH_S
        return cls(
            kv, js, subjects.catalog_bucket, registry, pool, refresh_s=refresh_s, pinned=pinned
        )

    async def publish(self) -> int:
        """Put every spec now, delete the ones this worker stopped serving; return how many."""
        self._changed.clear()
        now = time.time()
        keys = set()
        for tool in self._registry:
            key = catalog_key(tool.server, tool.name)
            value = encode(tool.spec(self._pool, updated_at=now, pinned=self.pinned))
            if self.pinned:
                await self._js.publish(f"$KV.{self._bucket}.{key}", value, headers=PIN_HEADERS)
            else:
                await self._kv.put(key, value)
            keys.add(key)
        for gone in self._published - keys:
            try:
                await self._kv.delete(gone)
            except (KeyNotFoundError, KeyDeletedError):
                pass
        self._published = keys
        return len(keys)

    async def publish_first(self) -> None:
        """Publish once, before :meth:`run` (which then waits its first round): the tools
        are offered once this returns. A failure is logged; :meth:`run` tries again."""
        try:
            await self.publish()
            self._first_done = True
        except Exception as exc:
            log.warning("catalog publish failed: %r", exc)

    async def run(self) -> None:
        """Publish now (unless :meth:`publish_first` did), then on every change and every
        ``refresh_s``; until cancelled."""
        while True:
            try:
                if self._first_done:
                    self._first_done = False
                else:
                    await self.publish()
            except Exception as exc:  # NATS down: the next round tries again
                log.warning("catalog refresh failed: %r", exc)
            raise_if_cancelled()  # nats-py may have swallowed a cancel
            try:
                async with asyncio.timeout(self.refresh_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
