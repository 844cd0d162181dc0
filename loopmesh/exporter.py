"""``loopmesh exporter``: the events stream as Prometheus metrics.

The exporter reads every event through one DURABLE pull consumer on each events stream
(one per partition, ``[nats] partitions``, all feeding the same metrics) and turns it
into counters and histograms (:class:`EventMetrics`). Because the consumers are
durable, a restarted exporter resumes where it acked: no event is missed or counted
twice by one exporter, and events of processes that died before they were scraped are
still counted. The counters restart from zero with the process, which Prometheus'
``rate()`` and ``increase()`` handle as a counter reset.

It also polls the tool pools' consumers (``pool-<name>`` on the tools stream) and
reports each pool's backlog as KEDA reads it: ``num_pending + num_ack_pending``; and
each tenant's turns consumer (``turns-...`` on the turns stream, one per tenant, its
tenant read from its filter subject: :func:`turns_tenant`), as turns waiting for a
worker (``num_pending``), that plus turns held (the backlog) and the backlog summed over
tenants, which KEDA scales the loop workers on (KEDA's ``nats-jetstream`` scaler reads
one consumer, not a sum).

It is its own command, not part of the gateway: gateways run as several replicas
behind a load balancer and would split one durable consumer's events between them,
while exactly one exporter owns the consumer; a mesh without a gateway (clients on
NATS) gets the same metrics. Metric names and labels: docs/OBSERVABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Annotated

import msgspec
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas.events import (
    AnyEvent,
    ContentDelta,
    Error,
    LLMRequest,
    LLMResponse,
    LoopEnd,
    LoopStart,
    MemoryPruned,
    Resumed,
    Retry,
    ThinkingDelta,
    ThinkingStart,
    ToolCallEvent,
    ToolErrorEvent,
    ToolResultEvent,
    ToolTimeout,
)
from schemas.subjects import BATCH_CONSUMER_PREFIX, TENANT_CONSUMER_PREFIX

from .aio import quietly
from .kv import open_kv
from .metrics import MetricsServer
from .provision import check_partitions
from .publisher import Publisher
from .settings import NatsSettings, Price
from .usage import Ledger

if TYPE_CHECKING:
    from nats.js.api import ConsumerInfo


log = logging.getLogger("loopmesh.exporter")

#: Latency buckets (seconds) that reach ten minutes: LLM calls and tools can be slow.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
#: Time to first chunk is shorter.
TTFC_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: Tokens per call (the GenAI conventions' advice, powers of four).
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
ITERATION_BUCKETS = (1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 100)
_OPEN_REQUESTS = 10_000  # LLM requests awaiting their first chunk, for time to first chunk
_DECODER = msgspec.json.Decoder(AnyEvent)


class ExporterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[exporter]``: ``loopmesh exporter``, the events as Prometheus metrics."""

    #: Where ``/metrics`` and ``/healthz`` listen (``0.0.0.0`` in a pod).
    metrics_host: str = "127.0.0.1"
    #: The port of ``/metrics`` and ``/healthz`` (``--metrics-port``).
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9466
    #: The durable consumer it reads the events with, on each events stream.
    durable: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")] = "metrics-exporter"
    #: Events fetched (and acked) at once.
    batch: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 256
    #: The tool pools' and the tenants' turns backlog is read this often.
    backlog_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0


class ExporterConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    exporter: ExporterSettings = ExporterSettings()
    prices: dict[str, Price] = {}  # per model, for the usage ledger's cost


class EventMetrics:
    """Counters and histograms fed one event at a time (:meth:`observe`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.events = Counter("loopmesh_events", "Events stored, by type", ["type"], registry=r)
        self.turns = Counter(
            "loopmesh_turns", "Turns ended, by loop_end reason and tenant",
            ["outcome", "tenant"], registry=r,
        )  # fmt: skip
        self.turns_started = Counter(
            "loopmesh_turns_started", "Turns started (loop_start), by tenant", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.resumes = Counter(
            "loopmesh_turn_resumes",
            "Turns resumed from a checkpoint by another delivery (loop_start resumed)",
            registry=r,
        )
        self.unpaused = Counter("loopmesh_turn_unpaused", "Paused turns resumed", registry=r)
        self.iterations = Histogram(
            "loopmesh_turn_iterations", "Iterations per ended turn",
            buckets=ITERATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.llm_duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "GenAI operation duration (one LLM call)",
            ["gen_ai_operation_name", "gen_ai_request_model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttfc = Histogram(
            "gen_ai_client_operation_time_to_first_chunk_seconds",
            "Time from an LLM request to its first streamed chunk",
            ["gen_ai_operation_name", "gen_ai_request_model"],
            buckets=TTFC_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Histogram(
            "gen_ai_client_token_usage", "Tokens per LLM call, input and output",
            ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_token_type"],
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "loopmesh_retries", "Retries, by what was retried and the model",
            ["what", "gen_ai_request_model"], registry=r,
        )  # fmt: skip
        self.tool_calls = Counter(
            "loopmesh_tool_calls", "Tool calls requested, by tool and server",
            ["gen_ai_tool_name", "server"], registry=r,
        )  # fmt: skip
        self.tool_duration = Histogram(
            "gen_ai_execute_tool_duration_seconds", "Tool call duration (tool_result)",
            ["gen_ai_tool_name", "server"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tool_errors = Counter(
            "loopmesh_tool_errors", "Tool calls that failed, by tool, server and error code",
            ["gen_ai_tool_name", "server", "code"], registry=r,
        )  # fmt: skip
        self.tool_timeouts = Counter(
            "loopmesh_tool_timeouts", "Tool calls that timed out", ["gen_ai_tool_name", "server"],
            registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "loopmesh_errors", "error events, by code and whether fatal", ["code", "fatal"],
            registry=r,
        )  # fmt: skip
        self.pruned = Counter(
            "loopmesh_memory_pruned_messages", "Messages pruned from turns' memory", registry=r
        )
        self._open: OrderedDict[tuple[str, str, str, int], tuple[float, str]] = OrderedDict()

    def observe(self, event: AnyEvent) -> None:
        self.events.labels(event.type).inc()
        turn = (event.tenant, event.session, event.turn_id)
        match event:
            case LoopStart():
                self.turns_started.labels(event.tenant).inc()
                if event.resumed:
                    self.resumes.inc()
            case LoopEnd():
                self.turns.labels(event.reason, event.tenant).inc()
                self.iterations.observe(event.iterations)
            case LLMRequest():
                self._opened((*turn, event.iteration), event.ts, event.model)
            case ContentDelta() | ThinkingStart() | ThinkingDelta():
                self._first_chunk((*turn, event.iteration), event.ts)
            case LLMResponse():
                self._first_chunk((*turn, event.iteration), event.ts)
                self.llm_duration.labels("chat", event.model).observe(event.latency_ms / 1000)
                if event.usage is not None:
                    tokens = self.tokens.labels
                    tokens("chat", event.model, "input").observe(event.usage.prompt_tokens)
                    tokens("chat", event.model, "output").observe(event.usage.completion_tokens)
            case Retry():
                self.retries.labels(event.what, event.model).inc()
            case ToolCallEvent():
                self.tool_calls.labels(event.tool, event.server).inc()
            case ToolResultEvent():
                self.tool_duration.labels(event.tool, event.server).observe(
                    event.duration_ms / 1000
                )
            case ToolErrorEvent():
                self.tool_errors.labels(event.tool, event.server, event.code).inc()
            case ToolTimeout():
                self.tool_timeouts.labels(event.tool, event.server).inc()
            case Error():
                self.errors.labels(event.code, str(event.fatal).lower()).inc()
            case MemoryPruned():
                self.pruned.inc(event.removed)
            case Resumed():
                self.unpaused.inc()
            case _:
                pass

    def _opened(self, key: tuple[str, str, str, int], ts: float, model: str) -> None:
        if len(self._open) >= _OPEN_REQUESTS:
            self._open.popitem(last=False)
        self._open[key] = (ts, model)

    def _first_chunk(self, key: tuple[str, str, str, int], ts: float) -> None:
        opened = self._open.pop(key, None)
        if opened is None or not opened[0] or not ts:
            return
        self.ttfc.labels("chat", opened[1]).observe(max(0.0, ts - opened[0]))


class Exporter:
    """Consumes the events stream durably into :class:`EventMetrics` and polls the pools'
    and the tenants' turns backlog until ``stop`` is set."""

    def __init__(
        self,
        nc: Client,
        nats: NatsSettings,
        settings: ExporterSettings,
        registry: CollectorRegistry,
        prices: Mapping[str, Price] | None = None,
    ) -> None:
        self.nc = nc
        self.prices: Mapping[str, Price] = prices or {}
        self.ledger: Ledger | None = None  # the usage ledger, once the bucket is open
        self._agents: OrderedDict[tuple[str, str, str], str] = OrderedDict()  # by turn
        self.js = nc.jetstream()
        self.subjects = nats.subjects
        self.settings = settings
        self.metrics = EventMetrics(registry)
        self.backlog = Gauge(
            "loopmesh_tool_pool_backlog",
            "Tool calls waiting for or held by a pool's workers (num_pending + num_ack_pending)",
            ["pool"], registry=registry,
        )  # fmt: skip
        self.turns_waiting = Gauge(
            "loopmesh_turns_waiting",
            "Turns no loop worker holds yet, by tenant (num_pending of its turns consumer)",
            ["tenant"], registry=registry,
        )  # fmt: skip
        self.turns_backlog = Gauge(
            "loopmesh_turns_backlog",
            "Turns waiting for or held by loop workers, by tenant (num_pending + num_ack_pending)",
            ["tenant"], registry=registry,
        )  # fmt: skip
        self.turns_backlog_total = Gauge(
            "loopmesh_turns_backlog_total",
            "Turns waiting for or held by loop workers, all tenants (what KEDA scales on)",
            registry=registry,
        )
        self._tenants: set[str] = set()  # those with series, to drop when their consumer goes
        self.consumed = 0
        self.undecodable = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Consume every partition's events stream and poll the backlog until ``stop``;
        :class:`ProvisionError` first if the server's events streams are for another
        partition count (its consumers would miss or double-count partitions)."""
        await check_partitions(self.js, self.subjects)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._consume(stop))
            tg.create_task(self._poll_backlog(stop))

    async def _consume(self, stop: asyncio.Event) -> None:
        """One durable consumer per events stream (``[nats] partitions``), all feeding
        the same metrics and ledger."""
        publisher = Publisher(self.nc)
        try:
            kv = await open_kv(self.js, publisher, self.subjects.usage_bucket)
            self.ledger = ledger = Ledger(kv, self.prices)
            counting = asyncio.Lock()  # a batch is counted, flushed and acked as one
            async with asyncio.TaskGroup() as tg:
                for k in range(self.subjects.partitions):
                    tg.create_task(self._consume_partition(k, ledger, counting, stop))
        finally:
            await publisher.close()

    async def _consume_partition(
        self, partition: int, ledger: Ledger, counting: asyncio.Lock, stop: asyncio.Event
    ) -> None:
        sub = await self.js.pull_subscribe(
            self.subjects.partition_events(partition),
            durable=self.settings.durable,
            stream=self.subjects.partition_stream(partition),
            config=ConsumerConfig(
                ack_policy=AckPolicy.ALL,
                deliver_policy=DeliverPolicy.ALL,
                description="loopmesh exporter: events into metrics",
            ),
        )
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.settings.batch, timeout=1.0)
                except (NatsTimeoutError, TimeoutError):  # nats-py raises either when idle
                    continue
                # Under the lock: another partition's flush must not write this batch's
                # usage after this batch is acked (a crash between would lose it).
                async with counting:
                    for msg in msgs:
                        try:
                            event = _DECODER.decode(msg.data)
                        except (msgspec.ValidationError, msgspec.DecodeError):
                            self.undecodable += 1
                            log.warning("undecodable event subject=%s", msg.subject)
                            continue
                        self.metrics.observe(event)
                        self._count(partition, msg.metadata.sequence.stream, event, ledger)
                    self.consumed += len(msgs)
                    if msgs:
                        await ledger.flush()  # then the ack: a usage counted is never lost
                        await msgs[-1].ack()  # AckPolicy.ALL: acks the batch
        finally:  # the subscriptions end here: a drain would wait for them
            await quietly(sub.unsubscribe())

    def _count(self, partition: int, seq: int, event: AnyEvent, ledger: Ledger) -> None:
        """Feed the usage ledger: an LLM call's usage, under its turn's agent."""
        turn = (event.tenant, event.session, event.turn_id)
        match event:
            case LoopStart():
                self._agents[turn] = event.agent or "default"
                if len(self._agents) > _OPEN_REQUESTS:
                    self._agents.popitem(last=False)
            case LLMResponse():
                agent = self._agents.get(turn, "default")
                ledger.count(seq, event, agent, partition=partition)
            case _:
                pass

    async def _poll_backlog(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._poll_pools()
            await self._poll_turns()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.backlog_interval_s)

    async def _poll_pools(self) -> None:
        prefix = self.subjects.pool_consumer("x")[:-1]
        for info in await self._consumers(self.subjects.tools_stream):
            name = info.name or ""
            if name.startswith(prefix):
                lag = (info.num_pending or 0) + (info.num_ack_pending or 0)
                self.backlog.labels(name[len(prefix) :]).set(lag)

    async def _poll_turns(self) -> None:
        """Each tenant's turns backlog and their total; a tenant whose consumer is gone
        loses its series."""
        waiting: dict[str, int] = {}
        backlog: dict[str, int] = {}
        for info in [
            info for stream in self.subjects.turns_streams for info in await self._consumers(stream)
        ]:
            if not (info.name or "").startswith((TENANT_CONSUMER_PREFIX, BATCH_CONSUMER_PREFIX)):
                continue
            tenant = self.subjects.tenant_of_filter(info.config.filter_subject or "")
            if tenant is None:
                continue
            pending = info.num_pending or 0
            waiting[tenant] = waiting.get(tenant, 0) + pending
            backlog[tenant] = backlog.get(tenant, 0) + pending + (info.num_ack_pending or 0)
        for tenant in self._tenants - set(backlog):
            self.turns_waiting.remove(tenant)
            self.turns_backlog.remove(tenant)
        for tenant, lag in backlog.items():
            self.turns_waiting.labels(tenant).set(waiting[tenant])
            self.turns_backlog.labels(tenant).set(lag)
        self._tenants = set(backlog)
        self.turns_backlog_total.set(sum(backlog.values()))

    async def _consumers(self, stream: str) -> list[ConsumerInfo]:
        """Every consumer of ``stream`` (the server lists them a page at a time); none
        while the stream does not exist."""
        found: list[ConsumerInfo] = []
        try:
            while page := await self.js.consumers_info(stream, offset=len(found)):
                found += page
        except NotFoundError:
            return []
        return found


HELP = """Turn the events stream into Prometheus metrics at /metrics.

Reads every event through a durable consumer (resuming where it stopped) and polls the
tool pools' and the tenants' turns backlog. Run one per mesh. SIGTERM stops it."""


def configure(parser: argparse.ArgumentParser) -> None:
    from .cli import add_metrics_options

    add_metrics_options(parser)


async def serve(config: ExporterConfig, stop: asyncio.Event) -> None:
    """Connect and export until ``stop`` is set (the command, and tests)."""
    from .nats import connect

    settings = config.exporter
    nc = await connect(config.nats, name="exporter")
    try:
        registry = CollectorRegistry()
        exporter = Exporter(nc, config.nats, settings, registry, config.prices)
        async with MetricsServer(
            settings.metrics_host,
            settings.metrics_port,
            registry=registry,
            healthy=lambda: nc.is_connected,
        ) as server:
            print(f"exporter  metrics at {server.url}/metrics", flush=True)
            await exporter.run(stop)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The exporter as a service of ``loopmesh up``: its metrics (on a free port, which
    it prints: a machine may run a separate exporter on the usual one), and the usage
    ledger that ``GET /v1/usage`` and the daily budgets read."""

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        from .cli import config_from_args

        config = config_from_args(ExporterConfig, args)
        config = msgspec.structs.replace(
            config,
            nats=msgspec.structs.replace(config.nats, url=nats_url),
            exporter=msgspec.structs.replace(config.exporter, metrics_port=0),
        )
        await serve(config, stop)

    return service


async def main(args: argparse.Namespace) -> int:
    from .cli import config_from_args, metrics_changes
    from .settings import replace
    from .shutdown import shutdown_on_signals

    config = config_from_args(ExporterConfig, args)
    settings = replace(config.exporter, "the command line", **metrics_changes(args))
    async with shutdown_on_signals() as stop:
        await serve(msgspec.structs.replace(config, exporter=settings), stop)
    return 0
