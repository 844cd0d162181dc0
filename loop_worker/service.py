"""The durable loop worker: turns from JetStream, run by the engine, acked when stored.

One :class:`LoopWorker` pulls turns from the turns stream's durable consumer and runs
many sessions at once (``max_active_turns``). For each delivered turn it:

1. waits until the turn is its session's oldest message in the stream (the stream is
   a work queue, so earlier turns of the session still there have not finished), then
   for room under the tenant's limit, then for the session lease;
2. opens the turn's controls (live messages, plus what was recorded while no worker
   ran it) and runs the engine, which resumes from the checkpoint when the turn was
   started before; one loop renews the leases of every running turn meanwhile;
3. flushes the turn's events, releases the lease and acks the turn.

While a turn is held, in-progress acks go out every third of AckWait. A worker that
dies leaves its turns unacked: they are redelivered after AckWait and resumed from
their checkpoints by another worker. A worker that loses a lease (it stalled for
longer than the TTL and someone else took over) mutes and stops its copy of the turn.
On stop it pulls no more, lets running turns finish within ``drain_timeout_s``, and
hands the rest back (cancelled at an await, checkpoint kept, nak).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from prometheus_client import Counter, Gauge, Histogram

from loopmesh.aio import both, raise_if_cancelled
from loopmesh.jetstream import Publisher, answered, quietly, retry, worker_name
from loopmesh.provision import ensure_bucket, ensure_consumer
from schemas import (
    ConsumerDef,
    KVDef,
    Subjects,
    ToolCallRequest,
    Turn,
    session_key,
)
from schemas.admit import Refused, admit_turn
from schemas.events import Error, LoopEnd

from . import refusals
from .config import LoopWorkerConfig, ServiceSettings
from .controls import Controls
from .dispatch import NatsToolDispatcher
from .engine.approvals import Approvals
from .engine.engine import Engine
from .engine.errors import StaleSessionError
from .engine.protocols import LLM
from .errors import LeaseLostError
from .lease import Lease, Leases
from .sink import JetStreamEvents
from .store import KVSessionStore

log = logging.getLogger("loopmesh.loop_worker")

TURNS = Counter("loopmesh_loop_turns", "Turns finished by this worker", ["outcome"])
ACTIVE = Gauge("loopmesh_loop_turns_active", "Turns running in this worker")
HELD = Gauge("loopmesh_loop_turns_held", "Turns delivered to this worker and not yet acked")
DURATION = Histogram(
    "loopmesh_loop_turn_seconds",
    "Time from a turn's delivery to its ack",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)


class HandBack(Exception):
    """A turn this worker will not run now; it goes back to the stream."""

    def __init__(self, delay: float | None = None) -> None:
        super().__init__("handed back")
        self.delay = delay


@dataclass(slots=True)
class _Held:
    msg: Msg
    turn: Turn | None = None
    seq: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    lease: Lease | None = None
    lost: LeaseLostError | None = None  # set when its lease was lost and its task stopped
    acked: bool = False


class LoopWorker:
    """Runs turns from the turns stream until ``stop`` is set::

    async with OpenAILLM(config.llm) as llm:
        await LoopWorker(nc, config, llm=llm).run(stop)
    """

    def __init__(
        self, nc: Client, config: LoopWorkerConfig, *, llm: LLM, name: str | None = None
    ) -> None:
        self.nc = nc
        self.config = config
        self.settings: ServiceSettings = config.loop_worker
        self.name = name or self.settings.name or worker_name()
        self.subjects = Subjects(config.nats.prefix)
        self.llm = llm
        self.ready = asyncio.Event()
        self.stats = {"finished": 0, "resumed": 0, "handed_back": 0, "lost": 0, "warm": 0}

        js = nc.jetstream()
        self._js = js
        self.publisher = publisher = Publisher(nc)  # every ack and KV read, on one inbox
        self.events = JetStreamEvents(nc, self.subjects, publisher=publisher)
        self.store = KVSessionStore(
            nc, self.subjects, on_stale=self._on_stale, pipelined=True, publisher=publisher
        )
        self.leases = Leases(nc, self.subjects, owner=self.name, publisher=publisher)
        self.controls = Controls(nc, self.subjects, publisher=publisher)
        self.tools = NatsToolDispatcher(
            nc,
            self.subjects,
            catalog_load_timeout_s=self.settings.catalog_load_timeout_s,
            on_catalog=Approvals(config.loop.approval_tools).report,
            grace_s=self.settings.tool_grace_s,
            default_timeout_s=config.loop.tool_timeout_s,
            effects_first=False,
            publisher=publisher,
            before_publish=lambda r: self.store.commit(r.tenant, r.session),
            unlapsed=self._unlapsed,
        )
        self.engine = Engine(
            settings=config.loop,
            llm=llm,
            tools=self.tools,
            events=self.events,
            store=self.store,
            model=config.llm.model,
            fallback_message=config.llm.fallback_message,
            worker=self.name,
        )
        self._held: dict[str, _Held] = {}  # by the delivery's reply subject
        self._by_seq: dict[int, _Held] = {}
        self._running: dict[str, _Held] = {}  # session key → the turn running it
        self._slots = asyncio.Semaphore(self.settings.max_active_turns)
        self._tenants: dict[str, int] = {}
        self._tenant_room = asyncio.Condition()
        self._room = asyncio.Event()
        self._stopping = False
        self.ack_wait_s = self.settings.ack_wait_s

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then finish or hand back in-flight turns."""
        await self._prepare()
        try:
            sub = await retry(
                lambda: self._js.pull_subscribe_bind(
                    self.subjects.turns_consumer, self.subjects.turns_stream
                ),
                "bind the turns consumer",
            )
        except BaseException:
            await self.tools.close()  # its catalog watch ends with the worker
            raise
        try:
            async with asyncio.TaskGroup() as tg:
                keepalive = tg.create_task(self._keepalive(), name="in-progress")
                renewer = tg.create_task(self._renew_leases(), name="leases")
                committer = tg.create_task(self.store.run(), name="checkpoints")
                puller = tg.create_task(self._pull(sub, tg, stop), name="pull")
                self.ready.set()
                log.info(
                    "loop worker ready name=%s max_active=%d ack_wait=%ss lease_ttl=%ss",
                    self.name, self.settings.max_active_turns, self.ack_wait_s,
                    self.leases.ttl_s,
                )  # fmt: skip
                await stop.wait()
                self._stopping = True
                await puller
                await self._finish_in_flight()
                keepalive.cancel()
                renewer.cancel()
                committer.cancel()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            await self.tools.close()
            await self.controls.close()
            await self.publisher.close()
            log.info("loop worker stopped name=%s stats=%s", self.name, self.stats)

    async def _prepare(self) -> None:
        s, subjects = self.settings, self.subjects
        if s.provision:
            await ensure_consumer(
                self._js,
                ConsumerDef(
                    stream=subjects.turns_stream,
                    durable=subjects.turns_consumer,
                    ack_wait_s=s.ack_wait_s,
                    description="loop workers share this consumer",
                ),
            )
            await ensure_bucket(
                self._js,
                KVDef(
                    bucket=subjects.leases_bucket,
                    ttl_s=s.lease_ttl_s,
                    replicas=self.config.nats.replicas,
                    description="one loop worker per session",
                ),
            )
        info = await retry(
            lambda: self._js.consumer_info(subjects.turns_stream, subjects.turns_consumer),
            "turns consumer info",
        )
        self.ack_wait_s = float(info.config.ack_wait or s.ack_wait_s)
        await self.publisher.start()
        await self.store.start()
        await self.leases.start()
        await self.controls.start()
        await self.tools.start()

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

    async def _pull(
        self, sub: JetStreamContext.PullSubscription, tg: asyncio.TaskGroup, stop: asyncio.Event
    ) -> None:
        while not self._stopping and not stop.is_set():
            free = self.capacity - len(self._held)
            if free <= 0:
                self._room.clear()
                stopped = asyncio.ensure_future(stop.wait())
                room = asyncio.ensure_future(self._room.wait())
                await asyncio.wait({stopped, room}, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                room.cancel()
                continue
            try:
                msgs = await sub.fetch(min(free, 64), timeout=self.settings.fetch_timeout_s)
            except TimeoutError:
                continue
            except Exception as exc:
                log.warning("pulling turns failed error=%r", exc)
                await _wait_or(stop, 0.5)
                continue
            for msg in msgs:
                if self._stopping:
                    await quietly(msg.nak())
                    continue
                held = _Held(msg)
                self._held[msg.reply] = held
                HELD.set(len(self._held))
                held.task = tg.create_task(self._handle(held))

    async def _keepalive(self) -> None:
        period = self.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for held in list(self._held.values()):
                await quietly(held.msg.in_progress())
            raise_if_cancelled()

    async def _renew_leases(self) -> None:
        """Renew the lease of every running turn once a third of its TTL has passed;
        a turn whose lease cannot be renewed is muted and stopped (:meth:`_lose`)."""
        while True:
            await asyncio.sleep(self.leases.ttl_s / 6)
            now = time.monotonic()
            due = [h for h in self._held.values() if h.lease is not None and h.lease.due(now)]
            if due:
                await asyncio.gather(*(self._renew(held) for held in due))
            raise_if_cancelled()

    async def _renew(self, held: _Held) -> None:
        lease = held.lease
        assert lease is not None
        try:
            await lease.renew()
        except LeaseLostError as exc:
            if not lease.released:
                self._lose(held, exc)
        except Exception as exc:  # not a lost lease: the next round tries again
            log.warning("lease not renewed key=%s error=%r", lease.key, exc)

    def _lose(self, held: _Held, exc: LeaseLostError) -> None:
        """Another worker may run the turn now: drop its events and stop it, keeping
        nothing (no checkpoint, no ack, no nak)."""
        held.lost = exc
        if held.turn is not None:
            self.events.mute(held.turn.msg_id)
        if held.task is not None:
            held.task.cancel()

    def _unlapsed(self, request: ToolCallRequest) -> bool:
        """Whether the lease of the request's session is surely still this worker's: only
        then may its calls be marked ``first_attempt``. A worker frozen past its lease and
        the duplicate window would otherwise publish, as a first attempt, a call that
        the worker which took over may already have run."""
        held = self._running.get(session_key(request.tenant, request.session))
        return held is not None and held.lease is not None and held.lease.unlapsed()

    # -- one turn -----------------------------------------------------------------------

    async def _handle(self, held: _Held) -> None:
        msg = held.msg
        started = time.monotonic()
        outcome = "acked"
        try:
            try:
                held.turn = turn = admit_turn(self.subjects, msg.subject, msg.data, _msg_id(msg))
            except Refused as refused:
                await self._refuse(msg, refused)
                outcome = "refused"
                return
            meta = msg.metadata
            held.seq = meta.sequence.stream
            self._by_seq[held.seq] = held
            if meta.num_delivered > self.settings.max_deliveries:
                await self._give_up(turn, meta.num_delivered)
                await self._ack(msg, turn)
                outcome = "gave_up"
                return
            await self._run(held, turn, meta.num_delivered)
            if not held.acked:
                await self._ack(msg, turn)
        except HandBack as back:
            outcome = "handed_back"
            self.stats["handed_back"] += 1
            await quietly(msg.nak(delay=back.delay))
        except asyncio.CancelledError:
            if held.lost is not None:
                outcome = "lost"
                self.stats["lost"] += 1
                log.warning("another worker took over turn=%s: %s", turn_id(held), held.lost)
                return  # the task ends here: its cancel was this worker's own
            outcome = "handed_back"
            self.stats["handed_back"] += 1
            await quietly(msg.nak())
            raise
        except (LeaseLostError, StaleSessionError) as exc:
            outcome = "lost"
            self.stats["lost"] += 1
            log.warning("another worker took over turn=%s: %s", turn_id(held), exc)
        except Exception:
            outcome = "failed"
            log.exception("turn failed; handing it back turn=%s", turn_id(held))
            await quietly(msg.nak(delay=1.0))
        finally:
            held.done.set()
            self._held.pop(msg.reply, None)
            self._by_seq.pop(held.seq, None)
            HELD.set(len(self._held))
            TURNS.labels(outcome).inc()
            DURATION.observe(time.monotonic() - started)
            self._room.set()

    async def _refuse(self, msg: Msg, refused: Refused) -> None:
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
                return
            log.error("refusal not reported; dropping the turn error=%r", exc)
        await quietly(msg.term())

    async def _ack(self, msg: Msg, turn: Turn) -> None:
        """``msg.ack_sync()``, with the reply on the publisher's inbox."""
        await retry(lambda: answered(self.publisher, msg.reply, b"+ACK"), f"ack turn {turn.id}")

    async def _run(self, held: _Held, turn: Turn, delivery: int) -> None:
        """Order, tenant room and lease, then the engine; the lease is released after,
        and a finished turn acked with it (both round trips at once)."""
        early = await self._order_and_lease(held, turn)
        async with self._tenant_slot(turn.tenant):
            lease = held.lease = early or await self.leases.acquire(
                turn.tenant, turn.session, turn.id
            )
            key = session_key(turn.tenant, turn.session)
            finished = False
            try:
                async with self._slots:
                    self._running[key] = held
                    ACTIVE.inc()
                    try:
                        await self._run_engine(held, turn, delivery)
                        finished = True
                    finally:
                        ACTIVE.dec()
                        self._running.pop(key, None)
                        self.store.forget(turn.tenant, turn.session)
            finally:
                if held.lost is not None:
                    lease.released = True  # someone else's now: leave the key alone
                elif finished:  # the release and the turn's ack go out together
                    await both(lease.release(), self._ack(held.msg, turn))
                    held.acked = True
                else:
                    await lease.release()

    async def _run_engine(self, held: _Held, turn: Turn, delivery: int) -> None:
        self.events.begin(turn.msg_id, delivery=delivery)
        self.tools.resuming(turn.msg_id, delivery > 1)
        warm = held.lease is not None and held.lease.continued
        control, warm = await both(
            self.controls.open(turn), self.store.preload(turn.tenant, turn.session, warm=warm)
        )
        self.stats["warm"] += warm
        if self.store.preloaded_turn(turn.tenant, turn.session) == turn.id:
            # A run of this very turn left a checkpoint (the turn was published again
            # after it failed, say): its calls may have run, whatever the delivery count.
            self.tools.resuming(turn.msg_id)
        try:
            end = await self.engine.run(turn, control)
            await self.store.flush(turn.tenant, turn.session)
            if self.events.muted(turn.msg_id):
                raise StaleSessionError(session_key(turn.tenant, turn.session))
            if end is not None and delivery > 1:
                self.stats["resumed"] += 1
            self.stats["finished"] += 1
            await self.events.flush(turn.msg_id)
        except asyncio.CancelledError:  # handed back: store what was emitted so far
            if held.lost is None:
                await quietly(asyncio.wait_for(self.store.flush(turn.tenant, turn.session), 2.0))
                await quietly(asyncio.wait_for(self.events.flush(turn.msg_id), 2.0))
            raise
        finally:
            self.events.end(turn.msg_id)
            self.tools.resuming(turn.msg_id, False)
            await self.controls.close_turn(turn, control)

    async def _order_and_lease(self, held: _Held, turn: Turn) -> Lease | None:
        """Wait for the turn's order; with no tenant limit to wait for, the first order
        check and a first try for the lease go out together (the lease is given back
        if an earlier turn is still in the stream). The lease, if it was taken."""
        if self.settings.tenant_max_active:
            await self._wait_turn_order(held, turn)
            return None
        first, lease = await both(
            self._first_turn(turn), self.leases.try_acquire(turn.tenant, turn.session, turn.id)
        )
        if first is None or (first or held.seq) >= held.seq:
            return lease
        if lease is not None:
            await lease.release()
        await self._wait_turn_order(held, turn)
        return None

    async def _first_turn(self, turn: Turn) -> int | None:
        subject = self.subjects.turn(turn.tenant, turn.session)
        return await retry(
            lambda: self.publisher.first_seq(self.subjects.turns_stream, subject),
            f"first turn of {subject}",
        )

    async def _wait_turn_order(self, held: _Held, turn: Turn) -> None:
        """Return once no earlier turn of the session is left in the stream."""
        deadline = time.monotonic() + self.settings.order_wait_s
        delay = 0.02
        while True:
            first = await self._first_turn(turn)
            if first is None:
                return
            first_seq = first or held.seq
            if first_seq >= held.seq:
                return
            earlier = self._by_seq.get(first_seq)
            if earlier is not None:  # it runs here: wait for it
                await earlier.done.wait()
                continue
            if time.monotonic() > deadline:
                raise HandBack(delay=1.0)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    @contextlib.asynccontextmanager
    async def _tenant_slot(self, tenant: str) -> AsyncIterator[None]:
        limit = self.settings.tenant_max_active
        if not limit:
            yield
            return
        async with self._tenant_room:
            await self._tenant_room.wait_for(lambda: self._tenants.get(tenant, 0) < limit)
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        try:
            yield
        finally:
            async with self._tenant_room:
                self._tenants[tenant] -= 1
                if not self._tenants[tenant]:
                    del self._tenants[tenant]
                self._tenant_room.notify_all()

    async def _give_up(self, turn: Turn, deliveries: int) -> None:
        message = f"the turn was delivered {deliveries} times without finishing; giving up"
        log.error("%s turn=%s", message, turn.id)
        t = turn
        self.events.begin(turn.msg_id, delivery=deliveries)
        await self.events.emit(
            Error(tenant=t.tenant, session=t.session, turn_id=t.id, code="redelivered",
                  message=message, fatal=True)
        )  # fmt: skip
        await self.events.emit(
            LoopEnd(tenant=t.tenant, session=t.session, turn_id=t.id, reason="error",
                    error=message)
        )  # fmt: skip
        await self.events.flush(turn.msg_id)
        self.events.end(turn.msg_id)

    def _on_stale(self, key: str) -> None:
        """A checkpoint lost its race: someone else runs the session now."""
        held = self._running.get(key)
        if held is not None and held.turn is not None:
            self.events.mute(held.turn.msg_id)


def _msg_id(msg: Msg) -> str | None:
    return msg.headers.get("Nats-Msg-Id") if msg.headers else None


def turn_id(held: _Held) -> str | None:
    return held.turn.id if held.turn is not None else None


async def _wait_or(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
