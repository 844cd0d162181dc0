"""The tool pre-filter: a large catalog narrowed to the ``top_k`` tools most relevant to
a request, so that the model chooses among a few (``[loop.prefilter]``).

::

    prefilter = Prefilter.from_settings(settings.prefilter, cache=cache)
    tools = await prefilter.select_tools("what time is it in Tokyo", catalog)

Ranking, in order of preference:

- ``embeddings``: cosine similarity between the request and each tool's text (its
  name, description and parameter names), embedded by an OpenAI-compatible
  ``/v1/embeddings`` endpoint. A tool's vector is cached under the hash of the model
  and that text (:func:`cache_key`) in an :class:`EmbeddingCache` (the loop worker
  shares one in a KV bucket), so a catalog is embedded once per model, not once per
  turn or worker. The request itself is embedded on every call.
- ``bm25``: Okapi BM25 (``rank-bm25``) over the same texts, when no endpoint is set,
  or when the endpoint fails (the :class:`Selection`'s ``note`` says why).
- ``all``: the catalog is no larger than ``top_k``: every tool, unranked.

The loop's own tools (server ``loop``: ``task_completion``, ``ask_question``,
``converse``, ``update_plan``) are never ranked and always offered.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from schemas import ToolSpec
from schemas.events import ToolSelection

from .prompt import BUILTIN_SERVER
from .settings import PrefilterSettings

Method = Literal["embeddings", "bm25", "all"]


class Embedder(Protocol):
    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in order. Raises on any failure."""
        ...


class EmbeddingCache(Protocol):
    """Tool vectors by :func:`cache_key`. Both methods may fail silently (a cache)."""

    async def get(self, keys: Sequence[str]) -> dict[str, list[float]]:
        """The vectors of the keys it holds."""
        ...

    async def put(self, items: Mapping[str, list[float]]) -> None: ...


class InMemoryEmbeddingCache:
    """A bounded LRU in one process (tests, the in-process engine)."""

    def __init__(self, size: int = 16_384) -> None:
        self.size = size
        self._items: OrderedDict[str, list[float]] = OrderedDict()

    async def get(self, keys: Sequence[str]) -> dict[str, list[float]]:
        found = {}
        for key in keys:
            if (vector := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                found[key] = vector
        return found

    async def put(self, items: Mapping[str, list[float]]) -> None:
        self._items.update(items)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


class OpenAIEmbeddings:
    """:class:`Embedder` over ``POST {base_url}/embeddings`` with the ``openai`` client."""

    def __init__(self, settings: PrefilterSettings, *, client: Any = None) -> None:
        import openai

        self.model = settings.embeddings_model
        self._owns = client is None
        self._client = client or openai.AsyncOpenAI(
            base_url=settings.embeddings_base_url,
            api_key=settings.embeddings_api_key or "not-needed",
            max_retries=1,
            timeout=settings.timeout_s,
        )

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        response = await self._client.embeddings.create(model=self.model, input=list(texts))
        data = sorted(response.data, key=lambda d: d.index)
        if len(data) != len(texts):
            raise ValueError(f"asked for {len(texts)} embeddings, got {len(data)}")
        return [list(d.embedding) for d in data]

    async def aclose(self) -> None:
        if self._owns:
            self._owns = False
            await self._client.close()


@dataclass(frozen=True)
class Selection:
    """What :meth:`Prefilter.select` chose: ``tools`` (the loop's own first, then the
    ranked ones, best first), how, their ``scores`` (by ``server.tool``), among how
    many ``candidates``, and a ``note`` when it fell back to BM25."""

    tools: tuple[ToolSpec, ...]
    method: Method
    top_k: int
    candidates: int
    scores: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def report(self) -> ToolSelection:
        """How the tools were chosen, as the ``llm_request`` event says it."""
        return ToolSelection(
            method=self.method,
            top_k=self.top_k,
            candidates=self.candidates,
            scores=self.scores,
            note=self.note,
        )


def tool_text(spec: ToolSpec) -> str:
    """The text a tool is ranked by: name, title, description and parameter names."""
    params = spec.input_schema.get("properties")
    names = ", ".join(params) if isinstance(params, dict) else ""
    parts = [spec.name.replace("_", " "), spec.title or "", " ".join(spec.description.split())]
    text = ". ".join(p for p in parts if p)
    return f"{text}. Parameters: {names}" if names else text


def cache_key(model: str, text: str) -> str:
    """The cache key of ``text`` embedded by ``model`` (a valid NATS KV key)."""
    m = hashlib.blake2s(model.encode(), digest_size=8).hexdigest()
    t = hashlib.blake2s(text.encode(), digest_size=16).hexdigest()
    return f"{m}.{t}"


def _name(spec: ToolSpec) -> str:
    return f"{spec.server}.{spec.name}"


class Prefilter:
    def __init__(
        self,
        settings: PrefilterSettings,
        *,
        embedder: Embedder | None = None,
        cache: EmbeddingCache | None = None,
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.cache: EmbeddingCache = cache if cache is not None else InMemoryEmbeddingCache()

    @classmethod
    def from_settings(
        cls, settings: PrefilterSettings, *, cache: EmbeddingCache | None = None
    ) -> Prefilter:
        """An embeddings client when ``embeddings_base_url`` is set, else BM25 only."""
        embedder = OpenAIEmbeddings(settings) if settings.embeddings_base_url else None
        return cls(settings, embedder=embedder, cache=cache)

    async def aclose(self) -> None:
        close = getattr(self.embedder, "aclose", None)
        if close is not None:
            await close()

    async def select_tools(self, text: str, tools: Sequence[ToolSpec]) -> Sequence[ToolSpec]:
        """The tools to offer for ``text`` (a request, or one plan step)."""
        return (await self.select(text, tools)).tools

    async def __call__(self, text: str, tools: Sequence[ToolSpec]) -> Sequence[ToolSpec]:
        """A pre-filter is a :class:`~loop_worker.engine.protocols.ToolSelector` (the
        orchestrator's, per step; it reports the :meth:`select` behind its choice)."""
        return await self.select_tools(text, tools)

    async def select(self, query_text: str, tools: Sequence[ToolSpec]) -> Selection:
        k = self.settings.top_k
        own = [t for t in tools if t.server == BUILTIN_SERVER]
        candidates = [t for t in tools if t.server != BUILTIN_SERVER]
        if len(candidates) <= k:
            return Selection(tuple(tools), "all", k, len(candidates))
        query = query_text[: self.settings.query_max_chars]
        texts = [tool_text(t) for t in candidates]
        method: Method = "bm25"
        note = ""
        scores: list[float] | None = None
        if self.embedder is not None:
            try:
                scores = await self._similarities(query, texts)
                method = "embeddings"
            except Exception as exc:
                note = f"embeddings failed, ranked by BM25: {type(exc).__name__}: {exc}"[:500]
        if scores is None:
            scores = bm25_scores(query, texts)
        order = sorted(range(len(candidates)), key=lambda i: -scores[i])[:k]
        chosen = [candidates[i] for i in order]
        return Selection(
            tools=(*own, *chosen),
            method=method,
            top_k=k,
            candidates=len(candidates),
            scores={_name(candidates[i]): round(scores[i], 4) for i in order},
            note=note,
        )

    async def _similarities(self, query: str, texts: list[str]) -> list[float]:
        assert self.embedder is not None
        model = self.settings.embeddings_model
        keys = [cache_key(model, t) for t in texts]
        try:
            vectors = await self.cache.get(keys)
        except Exception:
            vectors = {}
        missing = list(dict.fromkeys(k for k in keys if k not in vectors))
        wanted = [query, *(texts[keys.index(k)] for k in missing)]
        fresh = await self.embedder.embed(wanted)
        if len(fresh) != len(wanted) or any(len(v) != len(fresh[0]) for v in fresh):
            raise ValueError("the endpoint returned vectors of unequal sizes")
        computed = dict(zip(missing, fresh[1:], strict=True))
        if computed:
            try:
                await self.cache.put(computed)
            except Exception:
                pass  # a cache: the next call computes them again
        vectors.update(computed)
        q = fresh[0]
        return [cosine(q, vectors[k]) for k in keys]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} dimensions (a changed model?)")
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


# -- the lexical fallback ------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z][a-z]*|[A-Z]+(?![a-z])|\d+")
_STOP = frozenset(
    re.findall(
        r"\w+",
        "a an and are as at be by can do does for from get give how i in is it me my of on or "
        "please show tell the this to what when where which who will with you your",
    )
)


def words(text: str) -> list[str]:
    """Lower-case words (``snake_case`` and ``camelCase`` split), stop words out, a
    plural ``s`` off."""
    out = []
    for w in _WORD.findall(text):
        w = w.lower()
        if w in _STOP:
            continue
        out.append(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)
    return out


def bm25_scores(query: str, texts: Sequence[str]) -> list[float]:
    """Okapi BM25 of ``query`` against each text."""
    from rank_bm25 import BM25Okapi

    corpus = [words(t) or ["_"] for t in texts]
    terms = words(query)
    if not terms:
        return [0.0] * len(texts)
    return [float(s) for s in BM25Okapi(corpus).get_scores(terms)]
