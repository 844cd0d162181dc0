"""The memory bucket: agents' memories across sessions, per tenant (:mod:`schemas.memory`).

:class:`MemoryStore` puts, lists and deletes memories; the gateway serves it over HTTP
and the loop workers' memory tools write through it. Search is the loop worker's
(``loop_worker/memory.py``): it holds the vectors of the namespaces its turns use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from schemas.memory import Memory, memory_key, namespace_keys

from .kv import kv_values
from .retry import retry

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Memory).decode


def decode_memory(data: bytes) -> Memory | None:
    """A stored memory, or ``None`` when the value is not one (it is then skipped)."""
    try:
        return _decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


class MemoryStore:
    def __init__(self, js: JetStreamContext, bucket: str, *, timeout_s: float = 5.0) -> None:
        self._js = js
        self.bucket = bucket
        self.timeout_s = timeout_s
        self._kv: KeyValue | None = None
        self._opening = asyncio.Lock()

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            async with self._opening:
                if self._kv is None:
                    self._kv = await self._js.key_value(self.bucket)
        return self._kv

    async def put(self, memory: Memory) -> int:
        """Store ``memory`` (again, under the same id: the same key); its revision."""
        kv = await self._bucket()
        data = _encode(memory)
        return await retry(
            lambda: kv.put(memory.key, data), "store a memory", timeout=self.timeout_s
        )

    async def get(self, tenant: str, kind: str, name: str, id: str) -> Memory | None:
        kv = await self._bucket()
        try:
            entry = await kv.get(memory_key(tenant, kind, name, id))
        except NotFoundError:  # also KeyDeletedError
            return None
        return decode_memory(entry.value or b"")

    async def list(self, tenant: str, kind: str, name: str) -> list[Memory]:
        """The namespace's memories, oldest first."""
        values = await kv_values(
            self._js, self.bucket, namespace_keys(tenant, kind, name), timeout=self.timeout_s
        )
        found = [m for m in map(decode_memory, values.values()) if m is not None]
        return sorted(found, key=lambda m: (m.created_at, m.id))

    async def delete(self, tenant: str, kind: str, name: str, id: str) -> bool:
        """Erase one memory (its history too); whether there was one."""
        if await self.get(tenant, kind, name, id) is None:
            return False
        kv = await self._bucket()
        key = memory_key(tenant, kind, name, id)
        await retry(_purge(kv, key), "erase a memory", timeout=self.timeout_s)
        return True

    async def erase(self, tenant: str, kind: str, name: str, *, settle_s: float = 1.0) -> int:
        """Erase every memory of the namespace and all trace of them; how many there were.

        Each key is purged first, so that the loop workers following the namespace drop
        its memories, then, ``settle_s`` later, the purge markers go too: nothing of the
        namespace is left in the bucket."""
        values = await kv_values(
            self._js, self.bucket, namespace_keys(tenant, kind, name), timeout=self.timeout_s
        )
        kv = await self._bucket()
        for key in values:
            await retry(_purge(kv, key), "erase a memory", timeout=self.timeout_s)
        if values:
            await asyncio.sleep(settle_s)
        stream = f"KV_{self.bucket}"
        subject = f"$KV.{self.bucket}.{namespace_keys(tenant, kind, name)}"
        await retry(
            lambda: self._js.purge_stream(stream, subject=subject),
            "erase a namespace's memories",
            timeout=self.timeout_s,
        )
        return len(values)


def _purge(kv: KeyValue, key: str) -> Callable[[], Awaitable[bool]]:
    async def purge() -> bool:
        return await kv.purge(key)

    return purge
