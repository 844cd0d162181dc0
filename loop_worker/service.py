"""The durable loop worker: turns from JetStream, run by the engine, acked when stored.

One :class:`LoopWorker` pulls turns from the tenants' consumers on the turns stream, fairly
between tenants (:mod:`.share`), and runs many sessions at once (``max_active_turns``). For
each delivered turn it:

1. waits until the turn is its session's oldest message in the stream (the stream is
   a work queue, so earlier turns of the session still there have not finished), held
   with in-progress acks so that waiting costs no delivery, then for room under the
   tenant's limit, then for the session lease;
2. opens the turn's controls (live messages, plus what was recorded while no worker
   ran it) and runs the engine, which resumes from the checkpoint when the turn was
   started before; one loop renews the leases of every running turn meanwhile;
3. flushes the turn's events, releases the lease and acks the turn.

That story, one turn from delivery to ack, reads top to bottom in :mod:`.turn`; this
module owns what all turns share: the in-progress acks, the lease renewals, order, room,
and the turns it refuses or gives up.

While a turn is held, in-progress acks go out every third of AckWait. A worker that
dies leaves its turns unacked: they are redelivered after AckWait and resumed from
their checkpoints by another worker. A worker that loses a lease (it stalled for
longer than the TTL and someone else took over) mutes and stops its copy of the turn.
On stop it pulls no more, lets running turns finish within ``drain_timeout_s``, and
hands the rest back (cancelled at an await, checkpoint kept, nak).

A turn that cannot run is not retried forever: one that does not decode is refused
(dead-lettered and terminated), and one that fails ``max_deliveries`` times is left by
the consumer's ``max_deliver`` and dead-lettered on the server's advisory
(:mod:`.deadletter`); either way its session gets an ``error`` event and a ``loop_end``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import Histogram

from loopmesh.aio import raise_if_cancelled
from loopmesh.jetstream import KV, Publisher, quietly, retry, worker_name
from loopmesh.provision import has_msg_ttl
from loopmesh.scheduler import Scheduler
from schemas import SessionSnapshot, ToolCallRequest, Turn, session_key, turn_msg_id
from schemas.admit import Refused

from . import refusals
from .agent_calls import NatsAgentCalls
from .agent_slots import AgentSlots
from .agents import AgentBook
from .agents import Report as AgentReport
from .backlog_guard import BacklogGuard
from .config import LoopWorkerConfig, ServiceSettings
from .controls import Controls
from .deadletter import DeadLetters
from .dispatch import NatsToolDispatcher
from .embeddings import KVEmbeddingCache
from .engine.approvals import Approvals
from .engine.engine import Engine
from .engine.errors import StaleSessionError
from .engine.prefilter import Prefilter
from .engine.protocols import LLM
from .errors import LeaseLostError
from .fence import Fence
from .lease import Lease, Leases
from .limiter import SharedLimiter
from .memory import NatsMemories
from .order import first_turns, gone
from .provisioning import provision
from .share import FairShare
from .sink import JetStreamEvents
from .store import KVSessionStore
from .tenant_room import TenantRoom
from .traces import traced_llm
from .turn import HELD, DoneElsewhere, HandBack, TurnRun
from .usage import LedgerUsage

__all__ = ["HandBack", "LoopWorker"]  # HandBack: raised by the order wait, caught in .turn

log = logging.getLogger("loopmesh.loop_worker")

WAIT = Histogram(
    "loopmesh_loop_turn_wait_seconds",
    "Time from a turn's publish to its delivery to a loop worker, by tenant",
    ["tenant"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)


class LoopWorker:
    """Runs turns from the turns stream until ``stop`` is set::

    limiter = SharedLimiter.for_worker(nc, config)  # [llm.limits], and 429 pauses
    async with OpenAILLM(config.llm, limiter=limiter) as llm:
        await LoopWorker(nc, config, llm=llm, limiter=limiter).run(stop)
    """

    def __init__(
        self,
        nc: Client,
        config: LoopWorkerConfig,
        *,
        llm: LLM,
        name: str | None = None,
        limiter: SharedLimiter | None = None,
    ) -> None:
        """``limiter``: the one ``llm`` waits on (:meth:`SharedLimiter.for_worker`); the
        worker runs it. Required when ``[llm.limits]`` sets models: a worker whose calls
        would pass the fleet's limits unseen is refused."""
        if limiter is None and config.llm.limits.models:
            raise ValueError(
                "[llm.limits] sets limits, and the loop worker was given no limiter: build "
                "one with SharedLimiter.for_worker and give it to the LLM and the worker"
            )
        self.nc = nc
        self.config = config
        self.settings: ServiceSettings = config.loop_worker
        self.name = name or self.settings.name or worker_name()
        self.subjects = config.nats.subjects
        self.llm = llm
        self.limiter = limiter
        self.ready = asyncio.Event()
        self.stats = {
            "finished": 0, "resumed": 0, "handed_back": 0, "lost": 0, "stale": 0, "warm": 0
        }  # fmt: skip

        js = nc.jetstream()
        self._js = js
        self.publisher = publisher = Publisher(nc)  # every ack and KV read, on one inbox
        self._running: dict[str, TurnRun] = {}  # session key → the turn running it
        self.leases = Leases(nc, self.subjects, owner=self.name, publisher=publisher)
        self.fence = Fence(nc, self.leases, self._running)
        self.events = JetStreamEvents(
            nc, self.subjects, publisher=publisher, flush_ms=config.loop.stream_flush_ms,
            writable=self.fence.writable,
        )  # fmt: skip
        self.store = KVSessionStore(
            nc, self.subjects, on_stale=self._on_stale, pipelined=True, publisher=publisher,
            before_commit=self._events_stored,
        )  # fmt: skip
        self.controls = Controls(nc, self.subjects, publisher=publisher)
        self.agent_calls = NatsAgentCalls(nc, self.subjects, publisher, self.controls)
        self.deadletters = DeadLetters(nc, self.subjects, publisher=publisher)
        self._approvals, self._report = Approvals(config.loop.approval_tools), AgentReport()
        self.agents = AgentBook(
            nc,
            self.subjects.agents_bucket,
            load_timeout_s=self.settings.catalog_load_timeout_s,
            on_change=self._unmatched,
        )
        self.agent_slots = AgentSlots(self.leases, self.agents, publisher, self.subjects)
        self.tools = NatsToolDispatcher(
            nc,
            self.subjects,
            catalog_load_timeout_s=self.settings.catalog_load_timeout_s,
            on_catalog=self._unmatched,
            grace_s=self.settings.tool_grace_s,
            default_timeout_s=config.loop.tool_timeout_s,
            effects_first=False,
            publisher=publisher,
            before_publish=lambda r: self.store.commit(r.tenant, r.session),
            unlapsed=self._unlapsed,
            writable=self.fence.writable,
        )
        budget = config.loop.budget  # the daily ceilings read the usage ledger
        daily = bool(budget.tenant_daily_tokens or budget.tenant_daily_cost)
        ledger = KV(publisher, self.subjects.usage_bucket)
        every = self.settings.usage_read_every_s
        self._usage = LedgerUsage(ledger, fresh_s=every) if daily else None
        prefilter = config.loop.prefilter
        self.prefilter = (
            Prefilter.from_settings(
                prefilter,
                cache=KVEmbeddingCache(publisher, self.subjects.embeddings_bucket),
            )
            if prefilter.enabled
            else None
        )
        self.memories = NatsMemories(nc, self.subjects.memory_bucket, config.loop.memory)
        self.engine = Engine(
            settings=config.loop,
            llm=traced_llm(llm, config.llm.model),  # chat spans, while tracing is on
            tools=self.tools,
            events=self.events,
            store=self.store,
            model=config.llm.model,
            fallback_message=config.llm.fallback_message,
            worker=self.name,
            prefilter=self.prefilter,
            prices=config.prices,
            usage=self._usage,
            agent_calls=self.agent_calls,
            agents=self.agents,
            memories=self.memories,
        )
        self._held: dict[str, TurnRun] = {}  # by the delivery's reply subject
        self._by_seq: dict[int, TurnRun] = {}
        self._slots = asyncio.Semaphore(self.settings.max_active_turns)
        self.tenant_room = TenantRoom(self.settings.tenant_max_active)
        self._tg: asyncio.TaskGroup | None = None
        self.backlog = BacklogGuard(  # [tenants] max_backlog, for turns published on NATS
            nc, self.subjects, publisher, limits=lambda t: self.share.limits(t),
            counted=lambda t: self.share.waiting(t),
        )  # fmt: skip
        self.share = FairShare(
            nc, self.subjects, self.settings, config.tenants, deliver=self._take,
            heard=self.backlog.heard,
        )  # fmt: skip
        self._stopping = False
        self.ack_wait_s = self.settings.ack_wait_s
        self.scheduler = (
            Scheduler(nc, self.subjects, config.scheduler, name=self.name, publisher=publisher)
            if config.scheduler.enabled
            else None
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then finish or hand back in-flight turns."""
        await self._prepare()
        try:
            await retry(self.share.start, "listen for turns")
        except BaseException:
            await self.agents.close()  # the watches end with the worker
            await self.tools.close()
            raise
        try:
            async with asyncio.TaskGroup() as tg:
                keepalive = tg.create_task(self._keepalive(), name="in-progress")
                renewer = tg.create_task(self._renew_leases(), name="leases")
                fence = tg.create_task(self.fence.run(), name="fence")
                committer = tg.create_task(self.store.run(), name="checkpoints")
                deltas = tg.create_task(self.events.run(), name="deltas")
                listening = asyncio.Event()
                buryer = tg.create_task(self.deadletters.run(listening), name="dead letters")
                limits = tg.create_task(self._limits(), name="limits")
                await listening.wait()
                self._tg = tg
                puller = tg.create_task(self.share.run(self._free, stop), name="pull")
                if self.scheduler is not None:
                    self.scheduler.start()  # its own task: closed below
                self.ready.set()
                log.info(
                    "loop worker ready name=%s max_active=%d ack_wait=%ss lease_ttl=%ss "
                    "event_acks=%s",
                    self.name, self.settings.max_active_turns, self.ack_wait_s,
                    self.leases.ttl_s, "each" if self.events.acks_each else "barriers",
                )  # fmt: skip
                await stop.wait()
                self._stopping = True
                if self.scheduler is not None:
                    await self.scheduler.close()
                await puller
                await self._finish_in_flight()
                keepalive.cancel()
                renewer.cancel()
                fence.cancel()
                committer.cancel()
                deltas.cancel()
                buryer.cancel()
                limits.cancel()
        finally:
            if self.limiter is not None:  # a leader leaves its state to the next
                await self.limiter.close()
            await self.share.close()
            await self.backlog.close()
            if self.scheduler is not None:
                await self.scheduler.close()
            await self.agents.close()
            await self.memories.aclose()
            await self.tools.close()
            await self.controls.close()
            await self.publisher.close()
            if self.prefilter is not None:
                await self.prefilter.aclose()
            log.info("loop worker stopped name=%s stats=%s", self.name, self.stats)

    async def _limits(self) -> None:
        if self.limiter is not None:
            await self.limiter.run()

    async def _prepare(self) -> None:
        s, subjects = self.settings, self.subjects
        if s.provision:
            embeddings = self.prefilter is not None and self.prefilter.embedder is not None
            provisioned = await provision(
                self._js, subjects, s, self.config.nats.replicas, has_msg_ttl(self.nc),
                limits=self.limiter is not None, embeddings=embeddings,
            )  # fmt: skip
            for action in provisioned:  # a change is never silent
                level = logging.WARNING if action.startswith("updated") else logging.INFO
                log.log(level, "%s", action)
        await self.publisher.start()
        await self.events.start()
        await self.store.start()
        await self.leases.start()
        await self.controls.start()
        await self.backlog.start()
        await self.tools.start()
        if self.limiter is not None:
            await self.limiter.start()
        self.agents.start()  # turns wait for its first load (AgentBook.agent)

    async def _finish_in_flight(self) -> None:
        tasks = [h.task for h in self._held.values() if h.task is not None]
        if not tasks:
            return
        log.info(
            "finishing %d in-flight turns (deadline %ss)", len(tasks), self.settings.drain_timeout_s
        )
        _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()  # the turn is handed back at its next await
        if pending:
            await asyncio.wait(pending)

    # -- pulling ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.settings.max_active_turns + self.settings.max_waiting_turns

    def _free(self) -> int:
        """Places to pull turns into: a running place free, and room to hold the turn
        (a turn waiting for an earlier turn of its session holds no running place)."""
        held = len(self._held)
        ordering = sum(1 for h in self._held.values() if h.ordering)
        return min(self.capacity - held, self.settings.max_active_turns - (held - ordering))

    def _take(self, msg: Msg, tenant: str) -> None:
        """A turn pulled from ``tenant``'s consumer: hold it and run it."""
        assert self._tg is not None  # pulls run inside the worker's task group
        if self._stopping:  # answered after the stop: hand it back
            self._tg.create_task(quietly(msg.nak()))
            self._tg.create_task(self.share.handed_back(tenant, msg.subject))
            self.share.finished(tenant, msg.subject)
            return
        with contextlib.suppress(Exception):
            WAIT.labels(tenant).observe(max(time.time() - msg.metadata.timestamp.timestamp(), 0.0))
        held = TurnRun(msg, self, tenant)
        self._held[msg.reply] = held
        HELD.set(len(self._held))
        held.task = self._tg.create_task(held.run())

    def _released(self, held: TurnRun) -> None:
        """A held turn is done with (acked, handed back or given up): its place is free."""
        self.share.finished(held.tenant, held.msg.subject)

    async def _keepalive(self) -> None:
        period = self.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for held in list(self._held.values()):
                await quietly(held.msg.in_progress())
            raise_if_cancelled()

    async def _renew_leases(self) -> None:
        """Renew the lease of every running turn, and its slots, once a third of
        its TTL has passed; a turn whose lease cannot be renewed is muted and stopped
        (:meth:`TurnRun.lose`)."""
        while True:
            await asyncio.sleep(self.leases.ttl_s / 6)
            now = time.monotonic()
            due = [
                (held, lease)
                for held in self._held.values()
                for lease in (held.lease, *held.slots)
                if lease is not None and lease.due(now)
            ]
            if due:
                await asyncio.gather(*(self._renew(held, lease) for held, lease in due))
            raise_if_cancelled()

    async def _renew(self, held: TurnRun, lease: Lease) -> None:
        try:
            await lease.renew()
        except LeaseLostError as exc:
            if lease in held.slots:  # it lapsed (the worker stalled): the turn runs on
                log.warning("slot lost; the turn runs on turn=%s: %s", held.turn_id, exc)
                await lease.release()  # (if another took it, the key is left alone)
            elif not lease.released:
                held.lose(exc)
        except Exception as exc:  # not a lost lease: the next round tries again
            log.warning("lease not renewed key=%s error=%r", lease.key, exc)

    def _unlapsed(self, request: ToolCallRequest) -> bool:
        """Whether the lease of the request's session is surely still this worker's: only
        then may its calls be marked ``first_attempt``. A worker frozen past its lease and
        the duplicate window would otherwise publish, as a first attempt, a call that
        the worker which took over may already have run."""
        held = self._running.get(session_key(request.tenant, request.session))
        return held is not None and held.lease is not None and held.lease.unlapsed()

    # -- what a turn asks of its worker (the turn itself: :mod:`.turn`) ----------------

    async def _refuse(self, msg: Msg, refused: Refused, tenant: str) -> None:
        """Tell the publisher's session why (:mod:`.refusals`), then term the turn; if
        the events cannot be stored now, the turn comes back to be refused again."""
        meta = msg.metadata
        try:
            await refusals.report(
                self.publisher, self.subjects, refused, what="turn", ref=str(meta.sequence.stream)
            )
        except Exception as exc:
            if meta.num_delivered < self.settings.max_deliveries:
                log.warning("refusal not reported; retrying later error=%r", exc)
                await quietly(msg.nak(delay=1.0))
                await self.share.handed_back(tenant, msg.subject, 1.0)
                return
            log.error("refusal not reported; dropping the turn error=%r", exc)
        await self.deadletters.refuse(msg, f"{refused.code}: {refused.message}", announce=False)

    async def _wait_turn_order(self, held: TurnRun, turn: Turn) -> None:
        """Return once no earlier turn of the session is left in the stream.

        The wait is woken by the session's hand-over: an earlier turn's worker acks it,
        then releases its lease, and the release wakes this one
        (:meth:`~loop_worker.lease.Leases.handover`). An earlier turn held here is
        waited for directly. The turn is held meanwhile (in-progress acks), not handed
        back: every hand-back is a delivery, and deliveries are the poison limit
        (``max_deliver``), so a long first turn would otherwise kill its session's next
        one. Only when this worker is full (every place taken by held turns) and the
        earlier turn runs elsewhere is a turn that waited ``order_wait_s`` handed back,
        to make room."""
        deadline = time.monotonic() + self.settings.order_wait_s
        held.ordering = True  # its running place is free meanwhile
        self.share.wake()
        try:
            await self._order_wait(held, turn, deadline)
        finally:
            held.ordering = False

    async def _order_wait(self, held: TurnRun, turn: Turn, deadline: float) -> None:
        """An interactive turn behind a batch turn of its session lends its rank to its
        tenant's batch lane meanwhile (:meth:`FairShare.inherit`): the batch turn would
        otherwise wait for every interactive turn of the fleet, and this one with it."""
        lending = False
        try:
            async with self.leases.handover(turn.tenant, turn.session) as wait:
                while True:
                    wait.mark()
                    own, other = await first_turns(self.publisher, self.subjects, turn)
                    if gone(own, held.seq):
                        raise DoneElsewhere
                    first_seq = min(own or held.seq, other or held.seq)
                    if first_seq >= held.seq:
                        return
                    behind_batch = turn.priority != "batch" and (other or held.seq) < held.seq
                    if behind_batch != lending:
                        lending = behind_batch
                        self.share.inherit(held.tenant, lending)
                    earlier = self._by_seq.get(first_seq)
                    if earlier is not None:  # it runs here: wait for it
                        await earlier.done.wait()
                        continue
                    if time.monotonic() > deadline and len(self._held) >= self.capacity:
                        raise HandBack(delay=1.0)
                    await wait.next()
        finally:
            if lending:
                self.share.inherit(held.tenant, False)

    def _unmatched(self, changed: object = None) -> None:
        """Report the names of ``[loop] approval_tools`` and of the agents that match
        nothing, once the catalog (and, for the agents' names, the agents) are loaded;
        called when either changes."""
        catalog = self.tools.catalog
        if not catalog.is_loaded:
            return
        if changed is catalog.items():
            self._approvals.report(catalog.specs())
        if self.agents.is_loaded:
            self._report(self.agents.items(), catalog.specs())

    async def _events_stored(self, snapshot: SessionSnapshot) -> None:
        """On a cluster a checkpoint does not vouch for the events emitted before it
        (another stream, another leader): a worker that died right after it would leave
        them lost, since the next one resumes past them. So they are stored first.

        Nor is a checkpoint of a turn whose events are muted (its lease was lost, or a
        checkpoint lost its race) committed: the events it stands for were dropped, and
        a worker resuming from it would skip them. The lease may have lapsed with no
        one writing the session yet, so the revision check alone would let it through;
        one that lapsed by this worker's clock loses the turn here (:mod:`.fence`)."""
        if not snapshot.turn_id:
            return
        key = turn_msg_id(snapshot.tenant, snapshot.session, snapshot.turn_id)
        session = session_key(snapshot.tenant, snapshot.session)
        held = self._running.get(session)
        if held is not None and self.fence.lapsed(held):  # by this worker's clock
            self.fence.lose(held)
            raise StaleSessionError(session)
        if self.events.acks_each:  # all but the loop_end, which follows the checkpoint
            await self.events.flush(key, end=False)
        if self.events.muted(key) or (held is not None and held.lost is not None):
            raise StaleSessionError(session)

    def _on_stale(self, key: str) -> None:
        """A checkpoint lost its race: someone else runs the session now."""
        held = self._running.get(key)
        if held is not None and held.turn is not None:
            self.events.mute(held.turn.msg_id)


async def _wait_or(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
