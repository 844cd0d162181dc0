"""The usage ledger: what each tenant's LLM calls used, per UTC day, agent and model,
counted from the events.

Every ``llm_response`` event carries the call's ``usage``. The exporter, which reads
every event once through its durable consumer, adds them up (:class:`Ledger`) and writes
each tenant's day to the usage bucket under ``<tenant>.<YYYY-MM-DD>`` (a
:class:`UsageDay`), every ``flush_s``, with a revision check; the day's ``seq`` is the
last events-stream sequence it counts, so an event delivered again after the exporter
restarted (it acks after it writes) is not counted twice. ``GET /v1/usage`` reads the
days (:func:`read_days`), and the loop workers read today's to check a tenant's daily
budget (``[loop.budget]``). Cost is from ``[prices]``, at the time of counting.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
from nats.js.client import JetStreamContext

from schemas import Subjects
from schemas.events import LLMResponse

from .kv import KV, kv_values
from .retry import retry
from .settings import Price


class UsageLine(msgspec.Struct, kw_only=True):
    agent: str
    model: str
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, read from the provider's prompt cache
    cost: float = 0.0
    unpriced_calls: int = 0  # calls of a model with no price: their cost is not in ``cost``


class UsageDay(msgspec.Struct, kw_only=True):
    tenant: str
    day: str  # YYYY-MM-DD, UTC
    seq: int = 0  # the last events-stream sequence counted (partition 0's)
    lines: list[UsageLine] = []
    # With [nats] partitions > 1: the last sequence counted in partition k's stream, by
    # str(k), for k > 0 (each stream numbers its events from 1).
    partition_seqs: dict[str, int] = {}

    def counted_to(self, partition: int) -> int:
        """The last sequence of ``partition``'s events stream this day counted."""
        return self.seq if partition == 0 else self.partition_seqs.get(str(partition), 0)

    def count_to(self, partition: int, seq: int) -> None:
        if partition == 0:
            self.seq = max(self.seq, seq)
        else:
            key = str(partition)
            self.partition_seqs[key] = max(self.partition_seqs.get(key, 0), seq)

    @property
    def tokens(self) -> int:
        return sum(line.prompt_tokens + line.completion_tokens for line in self.lines)

    @property
    def cost(self) -> float:
        return sum(line.cost for line in self.lines)

    @property
    def cached_tokens(self) -> int:
        return sum(line.cached_tokens for line in self.lines)


_decode_day = msgspec.json.Decoder(UsageDay).decode


def day_of(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d")


def day_key(tenant: str, day: str) -> str:
    return f"{tenant}.{day}"


@dataclass
class _Pending:
    """What was counted for one tenant's day since the last write, event by event."""

    # partition, seq, event, agent
    counted: list[tuple[int, int, LLMResponse, str]] = field(default_factory=list)


class Ledger:
    """Adds up ``llm_response`` events and writes them to the usage bucket (the
    exporter's side)."""

    def __init__(self, kv: KV, prices: Mapping[str, Price]) -> None:
        self._kv = kv
        self._prices = prices
        self._pending: dict[str, _Pending] = {}

    def count(
        self, seq: int, event: LLMResponse, agent: str = "default", *, partition: int = 0
    ) -> None:
        """Count ``event`` (at sequence ``seq`` of ``partition``'s events stream) at its
        next :meth:`flush`."""
        if event.usage is None:
            return
        key = day_key(event.tenant, day_of(event.ts))
        counted = self._pending.setdefault(key, _Pending()).counted
        counted.append((partition, seq, event, agent))

    async def flush(self) -> None:
        """Write what was counted; each day is read, added to and written with a
        revision check (a lost race reads and adds again)."""
        pending, self._pending = self._pending, {}
        for key, counted in pending.items():
            await retry(lambda k=key, c=counted: self._write(k, c), f"usage {key}")  # type: ignore[misc]

    async def _write(self, key: str, pending: _Pending) -> None:
        tenant, _, day = key.partition(".")
        while True:
            entry = await self._kv.entry(key)
            if entry is not None and entry.value:
                stored = _decode_day(entry.value)
            else:
                stored = UsageDay(tenant=tenant, day=day)
            self._add(stored, pending)
            try:
                revision = entry.revision if entry is not None else 0
                await self._kv.update(key, msgspec.json.encode(stored), revision)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another writer wrote the day first: read it again

    def _add(self, stored: UsageDay, pending: _Pending) -> None:
        lines = {(line.agent, line.model): line for line in stored.lines}
        for partition, seq, event, agent in pending.counted:
            if seq <= stored.counted_to(partition):
                continue  # counted before a restart
            usage = event.usage
            assert usage is not None
            line = lines.get((agent, event.model))
            if line is None:
                line = lines[(agent, event.model)] = UsageLine(agent=agent, model=event.model)
            line.calls += 1
            line.prompt_tokens += usage.prompt_tokens
            line.completion_tokens += usage.completion_tokens
            line.cached_tokens += usage.cached_tokens
            price = self._prices.get(event.model)
            if price is None:
                line.unpriced_calls += 1
            else:
                line.cost += price.of(
                    usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
                )
            stored.count_to(partition, seq)
        stored.lines = sorted(lines.values(), key=lambda line: (line.agent, line.model))


async def read_days(js: JetStreamContext, subjects: Subjects, tenant: str) -> list[UsageDay]:
    """Every day of ``tenant``'s usage the bucket keeps, oldest first."""
    values = await kv_values(js, subjects.usage_bucket, f"{tenant}.*")
    days = [_decode_day(v) for v in values.values()]
    return sorted(days, key=lambda d: d.day)


async def read_day(kv: KV, tenant: str, day: str) -> UsageDay | None:
    entry = await kv.entry(day_key(tenant, day))
    if entry is None or not entry.value:
        return None
    return _decode_day(entry.value)
