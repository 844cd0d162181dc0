"""The tool pre-filter's embedding cache in a KV bucket, shared by every loop worker.

Key: :func:`loop_worker.engine.prefilter.cache_key` (the model's hash, then the
tool text's); value: the vector as little-endian float32. A vector depends only on its
key, so writes are create-only and a lost race is no error (the other worker wrote the
same vector). A cache never fails a turn: a read that fails is a miss, a write that
fails is dropped, and the pre-filter computes the vector again next time. The bucket
(``<prefix>-embeddings``) is provisioned with the others; its TTL drops the vectors of
tools that changed or left the catalog.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from array import array
from collections.abc import Mapping, Sequence

import nats.js.errors

from loopmesh.jetstream import KV, Publisher

log = logging.getLogger("loopmesh.loop_worker.embeddings")


def encode(vector: Sequence[float]) -> bytes:
    values = array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def decode(data: bytes) -> list[float] | None:
    if not data or len(data) % 4:
        return None
    values = array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


class KVEmbeddingCache:
    """:class:`~loop_worker.engine.prefilter.EmbeddingCache` over ``bucket``."""

    def __init__(self, publisher: Publisher, bucket: str, *, timeout_s: float = 2.0) -> None:
        self._kv = KV(publisher, bucket)
        self.timeout_s = timeout_s

    async def get(self, keys: Sequence[str]) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {}

        async def one(key: str) -> None:
            try:
                entry = await self._kv.entry(key, timeout=self.timeout_s)
            except Exception as exc:  # a miss: the pre-filter computes it
                log.debug("embedding cache read %s: %s", key, exc)
                return
            if entry is not None and entry.value is not None:
                vector = decode(entry.value)
                if vector is not None:
                    found[key] = vector

        async with asyncio.TaskGroup() as group:
            for key in dict.fromkeys(keys):
                group.create_task(one(key))
        return found

    async def put(self, items: Mapping[str, list[float]]) -> None:
        async def one(key: str, vector: list[float]) -> None:
            try:
                await self._kv.update(key, encode(vector), 0, timeout=self.timeout_s)
            except nats.js.errors.KeyWrongLastSequenceError:
                pass  # another worker stored it first: the same vector
            except Exception as exc:
                log.warning("embedding cache write %s: %s", key, exc)

        async with asyncio.TaskGroup() as group:
            for key, vector in items.items():
                group.create_task(one(key, vector))
