"""The loop worker's side of the memory store (``[loop.memory]``): the engine's
:class:`~loop_worker.engine.protocols.Memories` over the memory KV bucket.

Search runs in process. The first search of a namespace (one user's, one agent's
memories) reads it whole from the bucket and then follows its changes (an ordered
consumer on its keys, from the bucket's last sequence as of before the read), so every
loop worker sees a memory another saved, and one the gateway deleted goes at once. Each
namespace is a matrix of unit vectors; a search is one product with the query's vector.
The :data:`SPACES` namespaces used last stay loaded. A memory stored without a vector
(added through the HTTP API), or with another model's, is embedded when it is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DeliverPolicy

from loopmesh.kv import kv_entries
from loopmesh.memory import MemoryStore, decode_memory
from schemas.memory import Memory, namespace_keys

from .engine.prefilter import Embedder, OpenAIEmbeddings
from .engine.settings import MemorySettings, PrefilterSettings

log = logging.getLogger("loopmesh.memory")

# A search is one matrix-vector product: BLAS threads would only spin beside the event
# loop (numpy is imported at the first search, after this).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

#: Namespaces a worker keeps loaded (the ones used last).
SPACES = 256

Space = tuple[str, str, str]  # tenant, kind, name


class MiniLMEmbeddings:
    """:class:`Embedder` on the bundled MiniLM, in a thread (it holds the GIL little)."""

    model = "all-minilm-l6-v2"

    def __init__(self) -> None:
        from loopmesh.minilm import missing

        if (why := missing()) is not None:
            raise RuntimeError(
                f"[loop.memory] has no embeddings: {why}; set embeddings_base_url or "
                "install the memory extra"
            )
        self._model: Any = None
        self._lock = asyncio.Lock()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        from loopmesh.minilm import MiniLM

        async with self._lock:
            if self._model is None:
                self._model = await asyncio.to_thread(MiniLM.load)
            return await asyncio.to_thread(self._model.embed, list(texts))


class _Namespace:
    """One namespace, loaded: its memories and their unit vectors, kept current."""

    def __init__(self) -> None:
        try:
            import numpy as np
        except ImportError:
            raise RuntimeError(
                "[loop.memory] searches with numpy: install the memory extra"
            ) from None
        self.np = np
        self.memories: dict[str, Memory] = {}
        self.vectors: dict[str, Any] = {}
        self.revisions: dict[str, int] = {}
        self._matrix: tuple[list[str], Any] | None = None
        self.follow: Any = None  # the subscription that keeps it current
        self.reconnects = 0

    def apply(self, id: str, revision: int, memory: Memory | None, vector: Any) -> None:
        if revision < self.revisions.get(id, 0):
            return  # an older write than one already applied
        self.revisions[id] = revision
        self._matrix = None
        if memory is None:
            self.memories.pop(id, None)
            self.vectors.pop(id, None)
        else:
            self.memories[id] = memory
            self.vectors[id] = vector

    def forget(self, id: str) -> None:
        self._matrix = None
        self.memories.pop(id, None)
        self.vectors.pop(id, None)

    def nearest(self, query: Any, k: int) -> list[tuple[float, Memory]]:
        if not self.memories:
            return []
        if self._matrix is None:
            ids = list(self.vectors)
            self._matrix = (ids, self.np.vstack([self.vectors[i] for i in ids]))
        ids, matrix = self._matrix
        scores = matrix @ query
        top = self.np.argpartition(-scores, k)[:k] if k < len(ids) else range(len(ids))
        return [(float(scores[i]), self.memories[ids[i]]) for i in top]


class NatsMemories:
    def __init__(
        self,
        nc: Client,
        bucket: str,
        settings: MemorySettings,
        *,
        embedder: Embedder | None = None,
        model: str | None = None,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self.bucket = bucket
        self.settings = settings
        self.store = MemoryStore(self._js, bucket)
        self._embedder = embedder
        self._model = model
        self._spaces: OrderedDict[Space, _Namespace] = OrderedDict()
        self._loading: dict[Space, asyncio.Task[_Namespace]] = {}

    # -- embeddings -------------------------------------------------------------------

    def _embedding(self) -> tuple[Embedder, str]:
        if self._embedder is None:
            s = self.settings
            if s.embeddings_base_url:
                self._embedder = OpenAIEmbeddings(
                    PrefilterSettings(
                        embeddings_base_url=s.embeddings_base_url,
                        embeddings_model=s.embeddings_model,
                        embeddings_api_key=s.embeddings_api_key,
                        timeout_s=s.timeout_s,
                    )
                )
                self._model = s.embeddings_model
            else:
                self._embedder = MiniLMEmbeddings()
                self._model = MiniLMEmbeddings.model
        return self._embedder, self._model or ""

    async def _vectors(self, texts: Sequence[str]) -> list[Any]:
        import numpy as np

        embedder, _ = self._embedding()
        out = []
        for row in await embedder.embed(texts):
            v = np.asarray(row, dtype=np.float32)
            norm = float(np.linalg.norm(v))
            out.append(v / norm if norm > 0 else v)
        return out

    # -- the engine's Memories --------------------------------------------------------

    async def save(self, memory: Memory) -> Memory:
        space = await self._space((memory.tenant, memory.kind, memory.name))
        cap = self.settings.max_per_namespace
        if memory.id not in space.memories and len(space.memories) >= cap:
            raise ValueError(
                f"the {memory.kind} {memory.name}'s memory is full ({cap} memories, "
                "[loop.memory] max_per_namespace): forget some first"
            )
        [vector] = await self._vectors([memory.text])
        _, model = self._embedding()
        stored = msgspec.structs.replace(memory, model=model, vector=vector.tobytes())
        revision = await self.store.put(stored)
        space.apply(memory.id, revision, stored, vector)
        return stored

    async def search(
        self, tenant: str, spaces: Sequence[tuple[str, str]], query: str, k: int
    ) -> list[tuple[float, Memory]]:
        loaded = [await self._space((tenant, kind, name)) for kind, name in spaces]
        if k <= 0 or not any(s.memories for s in loaded):
            return []
        [q] = await self._vectors([query])
        found = [hit for space in loaded for hit in space.nearest(q, k)]
        return sorted(found, key=lambda hit: -hit[0])[:k]

    async def forget(self, tenant: str, spaces: Sequence[tuple[str, str]], id: str) -> bool:
        for kind, name in spaces:
            if await self.store.delete(tenant, kind, name, id):
                space = self._spaces.get((tenant, kind, name))
                if space is not None:  # at once here; the others as they follow
                    space.forget(id)
                return True
        return False

    # -- namespaces ---------------------------------------------------------------------

    async def _space(self, key: Space) -> _Namespace:
        space = self._spaces.get(key)
        if space is not None and space.reconnects == self._nc.stats["reconnects"]:
            self._spaces.move_to_end(key)
            return space
        if space is not None:  # the client reconnected: its follow may have missed writes
            await self._drop(key)
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.ensure_future(self._load(key))
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        space = await asyncio.shield(task)
        self._spaces[key] = space
        while len(self._spaces) > SPACES:
            await self._drop(next(iter(self._spaces)))
        return space

    async def _load(self, key: Space) -> _Namespace:
        tenant, kind, name = key
        space = _Namespace()
        space.reconnects = self._nc.stats["reconnects"]
        kv = await self._js.key_value(self.bucket)
        last = (await kv.status()).stream_info.state.last_seq
        pattern = namespace_keys(tenant, kind, name)
        entries = await kv_entries(self._js, self.bucket, pattern)
        memories = [
            (entry.revision, m)
            for entry in entries.values()
            if (m := decode_memory(entry.value or b"")) is not None
        ]
        vectors = await self._stored_vectors([m for _, m in memories])
        for (revision, memory), vector in zip(memories, vectors, strict=True):
            space.apply(memory.id, revision, memory, vector)

        async def changed(msg: Any) -> None:
            revision = msg.metadata.sequence.stream
            id = msg.subject.rsplit(".", 1)[-1]
            headers = msg.headers or {}
            if headers.get("KV-Operation") or headers.get("Nats-Marker-Reason"):
                space.apply(id, revision, None, None)
                return
            memory = decode_memory(msg.data)
            if memory is None:
                return
            try:
                [vector] = await self._stored_vectors([memory])
            except Exception as exc:  # an embeddings endpoint down: left out until reloaded
                log.warning("memory not embedded id=%s error=%r", id, exc)
                return
            space.apply(id, revision, memory, vector)

        space.follow = await self._js.subscribe(
            f"$KV.{self.bucket}.{pattern}",
            stream=f"KV_{self.bucket}",
            cb=changed,
            ordered_consumer=True,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last + 1
            ),
        )
        return space

    async def _stored_vectors(self, memories: Sequence[Memory]) -> list[Any]:
        """Each memory's unit vector: its stored one when it is this model's, else embedded."""
        import numpy as np

        _, model = self._embedding()
        out: list[Any] = [None] * len(memories)
        missing = []
        for i, m in enumerate(memories):
            if m.vector and m.model == model:
                out[i] = np.frombuffer(m.vector, dtype=np.float32)
            else:
                missing.append(i)
        for start in range(0, len(missing), 64):
            batch = missing[start : start + 64]
            vectors = await self._vectors([memories[i].text for i in batch])
            for i, v in zip(batch, vectors, strict=True):
                out[i] = v
        return out

    async def _drop(self, key: Space) -> None:
        space = self._spaces.pop(key, None)
        if space is not None and space.follow is not None:
            with contextlib.suppress(Exception):
                await space.follow.unsubscribe()

    async def aclose(self) -> None:
        for key in list(self._spaces):
            await self._drop(key)
        aclose = getattr(self._embedder, "aclose", None)
        if aclose is not None:
            await aclose()
