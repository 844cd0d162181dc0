"""API keys, tenants, and the per-key limits (request rate, long-lived calls open).

A key is looked up by its SHA-256, so the configuration holds no usable secret. In
no-auth mode every request is the one principal ``local`` of tenant ``local``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import RateLimited, Unauthorized
from .settings import LOCAL_TENANT, GatewaySettings


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: the tenant a key maps to, and the key's name (for limits and logs)."""

    tenant: str
    key: str  # the key's name, or a short hash prefix when it has none


def key_hash(key: str) -> str:
    """The lowercase hex SHA-256 of an API key, as ``[gateway] api_keys`` stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


class Keys:
    """Maps ``Authorization: Bearer <key>`` to a :class:`Principal`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.no_auth = settings.no_auth
        self._by_hash = {
            k.sha256: Principal(k.tenant, k.name or f"key-{k.sha256[:8]}")
            for k in settings.api_keys
        }

    def principal(self, authorization: str | None) -> Principal:
        if self.no_auth:
            return Principal(LOCAL_TENANT, LOCAL_TENANT)
        if not authorization:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: use `Bearer <key>`")
        found = self._by_hash.get(key_hash(key.strip()))
        if found is None:
            raise Unauthorized("unknown API key")
        return found


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass
class RateLimiter:
    """A token bucket per key: ``rate`` requests a second, bursts of ``burst``."""

    rate: float
    burst: int
    clock: object = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, key: str) -> None:
        """Spend one token of ``key``'s bucket, or raise :class:`RateLimited`."""
        now: float = self.clock()  # type: ignore[operator]
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / self.rate
            raise RateLimited(
                f"rate limit of {self.rate:g} requests/s (burst {self.burst}) exceeded for "
                f"this key; retry in {wait:.2f}s",
                retry_after=max(1, math.ceil(wait)),
            )
        bucket.tokens -= 1.0


class StreamSlots:
    """Counts each key's long-lived calls against a cap (``[gateway]
    max_streams_per_key``): whatever holds a feed or a consumer until a turn ends or the
    client goes (an SSE event stream, an A2A stream, subscription or blocking send, an
    MCP tool call) takes a slot for as long as it is open."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[str, int] = {}

    def acquire(self, key: str) -> None:
        """Take a slot of ``key``; :class:`RateLimited` (429) when all are taken."""
        n = self._open.get(key, 0)
        if n >= self.cap:
            raise RateLimited(
                f"this key has {n} streams and calls open (event streams, A2A streams and "
                f"sends, MCP tool calls), the most allowed ([gateway] max_streams_per_key "
                f"= {self.cap}); close one first",
                retry_after=1,
            )
        self._open[key] = n + 1

    @contextlib.contextmanager
    def held(self, key: str) -> Iterator[None]:
        """A slot of ``key`` for the ``with`` block."""
        self.acquire(key)
        try:
            yield
        finally:
            self.release(key)

    def release(self, key: str) -> None:
        n = self._open.get(key, 0) - 1
        if n <= 0:
            self._open.pop(key, None)
        else:
            self._open[key] = n

    def total(self) -> int:
        return sum(self._open.values())
