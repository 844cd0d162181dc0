"""One turn in the durable loop worker, from delivery to ack, read top to bottom.

:class:`LoopWorker <loop_worker.service.LoopWorker>` pulls a delivery, wraps it in a
:class:`TurnRun` and runs :meth:`TurnRun.run` in its task group. Everything a turn does
is here, in the order it happens:

1. **admit** — the subject vouches for the body (and, on its first delivery, the
   egress policy for its webhook), else it is refused and termed;
   a turn delivered more than ``max_deliveries`` times is given up (poison), and one
   refused when it was published (its tenant past ``max_backlog``,
   :mod:`.backlog_guard`) is dead-lettered unrun;
2. **order** — no earlier turn of its session is left in the stream (the stream is a
   work queue: one still there has not finished);
3. **lease** — the session's lease, so one worker runs the session at a time (with
   no tenant limit the first order check and a first try for the lease go out
   together); then, when its agent has a ``max_active_turns``, one of the agent's
   slots, and when its tenant has one, one of the tenant's, each waited for without a
   running place (:mod:`.agent_slots`);
4. **start** — the turn's controls open and its snapshot preloads at once, from what
   this worker kept of the session when nobody held it since (:func:`warm`), else read;
5. **run** the engine;
6. **finish** — the last checkpoint, then the events, are stored;
7. **hand over** — the store forgets the session, keeping its last snapshot warm, then
   the turn is acked and the lease released: the release wakes a worker that waits
   with the session's next turn (:meth:`~loop_worker.lease.Leases.handover`), which
   finds it gone from the stream.

The failure paths end in :meth:`TurnRun.run` too: a turn handed back (:class:`HandBack`,
or cancelled at a stop) is nakked with what it emitted stored; a turn whose lease was
lost (:meth:`TurnRun.lose`) keeps nothing — no events, no checkpoint, no ack, no nak; a
checkpoint that lost its race under a lease still held keeps nothing either, but is
nakked at once (the worker started from a snapshot someone had moved on: the next
delivery reads it); any other failure naks it after a second. Only a crash leaves a
turn to AckWait.

The modules below this one are mechanisms and know nothing of this story:
:mod:`.lease` (a KV key with a TTL), :mod:`.store` (checkpoints and a cache of
snapshots), :mod:`.sink` (events), :mod:`.controls`, :mod:`.dispatch`.

Nothing here adds a round trip, task or timer per turn: the keepalive of every held
turn and the renewal of every lease run from one loop each in the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from loopmesh.aio import both
from loopmesh.backlog import unfinished
from loopmesh.errors import InvalidWebhook
from loopmesh.jetstream import answered, quietly, retry
from loopmesh.webhook import WebhookSettings, check_webhook
from schemas import DEFAULT_AGENT, Cancel, Turn, session_key
from schemas.admit import Refused, admit_turn

from . import refusals
from .agent_slots import TENANT, GaveUp
from .backlog_guard import BACKLOG_FULL
from .engine.errors import StaleSessionError
from .errors import LeaseLostError
from .lease import Lease
from .order import first_turn, gone
from .traces import turn_span

if TYPE_CHECKING:  # the owner's surface this story uses (see Owner)
    from typing import Protocol

    from loopmesh.jetstream import Publisher
    from schemas import Subjects
    from schemas.events import LoopEnd

    from .agent_slots import AgentSlots
    from .backlog_guard import BacklogGuard
    from .config import LoopWorkerConfig, ServiceSettings
    from .controls import Controls
    from .deadletter import DeadLetters
    from .dispatch import NatsToolDispatcher
    from .engine.engine import Engine
    from .lease import Leases
    from .share import FairShare
    from .sink import JetStreamEvents
    from .store import KVSessionStore
    from .tenant_room import TenantRoom

    class Owner(Protocol):
        """What a turn uses of the worker that runs it."""

        subjects: Subjects
        settings: ServiceSettings
        config: LoopWorkerConfig
        stats: dict[str, int]
        publisher: Publisher
        events: JetStreamEvents
        store: KVSessionStore
        leases: Leases
        controls: Controls
        tools: NatsToolDispatcher
        engine: Engine
        deadletters: DeadLetters
        backlog: BacklogGuard
        share: FairShare
        agent_slots: AgentSlots
        tenant_room: TenantRoom
        _held: dict[str, TurnRun]
        _by_seq: dict[int, TurnRun]
        _running: dict[str, TurnRun]
        _stopping: bool
        _slots: asyncio.Semaphore

        @property
        def capacity(self) -> int: ...

        async def _refuse(self, msg: Msg, refused: Refused, tenant: str) -> None: ...
        async def _wait_turn_order(self, held: TurnRun, turn: Turn) -> None: ...
        def _released(self, held: TurnRun) -> None: ...


log = logging.getLogger("loopmesh.loop_worker")

TURNS = Counter("loopmesh_loop_turns", "Turns finished by this worker", ["outcome"])
ACTIVE = Gauge("loopmesh_loop_turns_active", "Turns running in this worker")
HELD = Gauge("loopmesh_loop_turns_held", "Turns delivered to this worker and not yet acked")
REDELIVERIES = Counter(
    "loopmesh_loop_turn_redeliveries", "Turns delivered again (num_delivered > 1)"
)
DURATION = Histogram(
    "loopmesh_loop_turn_seconds",
    "Time from a turn's delivery to its ack",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)


class DoneElsewhere(Exception):
    """This delivery's turn is no longer in the stream: another delivery of it finished
    and acked it (it was delivered again while it ran, past AckWait). Running it again
    would run it twice, after its session's next turns if they went on meanwhile.

    The session's snapshot has the last word: a turn it lists as ended under a later
    turn (:meth:`~loop_worker.store.KVSessionStore.ended_before`) is done too, whatever
    a read of the stream said (a read can race the ack that removes the turn)."""

    def __init__(self) -> None:
        super().__init__("acked by another delivery")


class Rejected(Exception):
    """The turn was refused: an earlier turn of its session had not ended, and it
    asked ``on_busy = "reject"``."""


class HandBack(Exception):
    """A turn this worker will not run now; it goes back to the stream."""

    def __init__(self, delay: float | None = None) -> None:
        super().__init__("handed back")
        self.delay = delay


def warm(lease: Lease) -> bool:
    """Whether the turn may start from the snapshot this worker kept of its session
    instead of reading it.

    The store keeps a session's last snapshot and revision when a turn of it ends
    cleanly (:meth:`~loop_worker.store.KVSessionStore.forget`). They are still the
    stored ones if nobody wrote the session since, and nobody can have without holding
    its lease: :attr:`Lease.continued` says this worker took the lease over its own
    release (a write checked against the revision of the delete marker it left), so
    nobody held it in between. Were the kept snapshot stale after all, the first
    checkpoint's revision check fails and the turn ends as lost, like any lost race,
    and the next load reads.
    """
    return lease.continued


async def _check_webhook(turn: Turn, settings: WebhookSettings) -> None:
    """Refuse (code ``invalid_webhook``) a turn whose webhook URL the egress policy
    refuses: the gateway checks the turns it accepts, this checks those published to
    NATS directly, on their first delivery."""
    assert turn.webhook is not None
    try:
        await check_webhook(turn.webhook, settings)
    except InvalidWebhook as exc:
        raise Refused(
            "invalid_webhook", exc.message, tenant=turn.tenant, session=turn.session,
            turn_id=turn.id,
        ) from None  # fmt: skip


class TurnRun:
    """One delivered turn: its state while held, and :meth:`run`, its whole story."""

    __slots__ = (
        "_w", "acked", "done", "lease", "lost", "msg", "ordering", "seq", "slots", "task", "tenant",
        "turn",
    )  # fmt: skip

    def __init__(self, msg: Msg, owner: Owner, tenant: str = "") -> None:
        self.msg = msg
        self.tenant = tenant  # the consumer it came through (its subject's tenant token)
        self.ordering = False  # waiting for an earlier turn of its session: no place used
        self.turn: Turn | None = None
        self.seq = 0
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.lease: Lease | None = None
        self.slots: list[Lease] = []  # of its agent's and its tenant's max_active_turns
        self.lost: LeaseLostError | None = None  # set when its lease was lost and its task stopped
        self.acked = False
        self._w = owner

    @property
    def turn_id(self) -> str | None:
        return self.turn.id if self.turn is not None else None

    # -- the story ----------------------------------------------------------------------

    async def run(self) -> None:
        """Admit, run and ack the turn, or hand it back; never raises but a cancel
        that was not this worker's own (a stop past the drain deadline)."""
        w, msg = self._w, self.msg
        started = time.monotonic()
        outcome = "acked"
        try:
            try:  # 1. admit
                self.turn = turn = admit_turn(w.subjects, msg.subject, msg.data, _msg_id(msg))
                meta = msg.metadata
                if turn.webhook is not None and meta.num_delivered == 1:
                    await _check_webhook(turn, w.config.webhooks)
            except Refused as refused:
                await w._refuse(msg, refused, self.tenant)
                outcome = "refused"
                return
            self.seq = meta.sequence.stream
            w._by_seq[self.seq] = self
            if meta.num_delivered > 1:
                REDELIVERIES.inc()
            if meta.num_delivered > w.settings.max_deliveries:  # poison, on a consumer
                # without max_deliver (provisioned by hand): give up as its advisory would
                message = f"delivered {meta.num_delivered} times without finishing"
                await w.deadletters.refuse(msg, message)
                outcome = "gave_up"
                return
            if not await w.backlog.admit(turn):  # refused at publish: past max_backlog
                await w.deadletters.refuse(msg, BACKLOG_FULL, announce=False)
                await w.backlog.forget(turn)
                outcome = "refused"
                return
            await self._leased(turn, meta.num_delivered)
            if not self.acked:
                await self._ack(turn)
        except Rejected:
            outcome = "rejected"
        except DoneElsewhere:
            outcome = "done_elsewhere"
            log.warning("turn acked by another delivery; not run again turn=%s", self.turn_id)
        except HandBack as back:
            outcome = "handed_back"
            w.stats["handed_back"] += 1
            await self._nak(back.delay)
        except asyncio.CancelledError:
            if self.lost is not None:
                outcome = "lost"
                w.stats["lost"] += 1
                log.warning("another worker took over turn=%s: %s", self.turn_id, self.lost)
                return  # the task ends here: its cancel was this worker's own
            outcome = "handed_back"
            w.stats["handed_back"] += 1
            await self._nak()
            raise
        except StaleSessionError as exc:
            if self.lost is None:  # the lease was ours: what this worker had was stale
                outcome = "stale"
                w.stats["stale"] += 1
                log.warning("turn started from a stale snapshot turn=%s: %s; delivered "
                            "again at once", self.turn_id, exc)  # fmt: skip
                await self._nak()
            else:
                outcome = "lost"
                w.stats["lost"] += 1
                log.warning("another worker took over turn=%s: %s", self.turn_id, exc)
        except LeaseLostError as exc:
            outcome = "lost"
            w.stats["lost"] += 1
            log.warning("another worker took over turn=%s: %s", self.turn_id, exc)
        except Exception:
            outcome = "failed"
            log.exception("turn failed; handing it back turn=%s", self.turn_id)
            await self._nak(1.0)
        finally:
            self.done.set()
            w._held.pop(msg.reply, None)
            w._by_seq.pop(self.seq, None)
            HELD.set(len(w._held))
            TURNS.labels(outcome).inc()
            DURATION.observe(time.monotonic() - started)
            w._released(self)

    async def _leased(self, turn: Turn, delivery: int) -> None:
        """Order, tenant room and lease, then the engine; a finished turn is acked, then
        its lease released."""
        w = self._w
        early = await self._order_and_lease(turn, delivery)  # 2. order, 3. lease
        # with no tenant limit there is no room to wait for (and no call to make)
        tenant_limited = bool(w.settings.tenant_max_active)
        room = w.tenant_room.slot(turn.tenant) if tenant_limited else contextlib.nullcontext()
        async with room:
            lease = self.lease = early or await w.leases.acquire(turn.tenant, turn.session, turn.id)
            if early is None:  # the lease was waited for: the turn may be done meanwhile
                await self._still_queued(turn, lease)
            key = session_key(turn.tenant, turn.session)
            finished = False
            try:
                await self._take_slots(turn, lease)
                async with w._slots:
                    w._running[key] = self
                    ACTIVE.inc()
                    try:
                        headers, model = self.msg.headers, w.config.llm.model
                        with turn_span(turn, headers, model, delivery) as span:
                            end = await self._run_engine(turn, delivery, lease)
                            if span is not None and end is not None:
                                span.set_attribute("loopmesh.turn.end_reason", end.reason)
                        finished = True
                    finally:
                        ACTIVE.dec()
                        w._running.pop(key, None)
                        # keeps the last snapshot warm when it is known to be stored
                        w.store.forget(turn.tenant, turn.session)
            finally:  # 7. hand over
                try:
                    if self.lost is not None:
                        lease.released = True  # someone else's now: leave the key alone
                    elif finished:  # acked, then released: the release wakes the next turn
                        await lease.release(after=self._ack(turn), continuable=True)
                        self.acked = True
                    else:
                        await lease.release()
                finally:
                    for slot in self.slots:  # after the ack: the turn has ended
                        await slot.release()

    async def _take_slots(self, turn: Turn, lease: Lease) -> None:
        """One of the slots of the turn's agent's ``max_active_turns``, when it has one,
        then one of its tenant's, when it has one (:mod:`.agent_slots`: why in that
        order); each kept in :attr:`slots` once taken, to be renewed and released."""
        w = self._w
        if await w.agent_slots.any_capped():
            agent = turn.agent or await self._session_agent(turn, lease)
            cap = await w.agent_slots.cap(agent)
            if cap is not None:
                self.slots.append(await self._slot(turn, agent, cap))
        cap = w.share.limits(turn.tenant).max_active_turns  # configured: no read
        if cap:
            self.slots.append(await self._slot(turn, TENANT, cap))

    async def _slot(self, turn: Turn, agent: str, cap: int) -> Lease:
        """A slot of ``agent`` (:data:`~.agent_slots.TENANT`: of the turn's tenant),
        waited for like an earlier turn of the session: with no running place used. A
        full worker hands the turn back after ``order_wait_s``, a stopping one at once."""
        w = self._w
        slot = await w.agent_slots.try_take(turn, agent, cap)
        if slot is not None:
            return slot
        self.ordering = True  # its running place is free meanwhile
        w.share.wake()
        deadline = time.monotonic() + w.settings.order_wait_s

        def give_up() -> bool:
            full = len(w._held) >= w.capacity and time.monotonic() > deadline
            return full or w._stopping

        try:
            return await w.agent_slots.wait(turn, agent, cap, give_up=give_up)
        except GaveUp:
            raise HandBack(delay=1.0) from None
        finally:
            self.ordering = False

    async def _session_agent(self, turn: Turn, lease: Lease) -> str:
        """The agent of the turn's session, from its snapshot, preloaded for the engine
        now (a turn that names no agent runs as its session's, as the engine decides)."""
        w = self._w
        w.stats["warm"] += await w.store.preload(turn.tenant, turn.session, warm=warm(lease))
        return w.store.preloaded_agent(turn.tenant, turn.session) or DEFAULT_AGENT

    async def _order_and_lease(self, turn: Turn, delivery: int) -> Lease | None:
        """Wait for the turn's order; with no tenant limit to wait for, the first order
        check and a first try for the lease go out together (the lease is given back
        if an earlier turn is still in the stream). The lease, if it was taken."""
        w = self._w
        if w.settings.tenant_max_active:
            await self._when_busy(turn)
            await w._wait_turn_order(self, turn)
            return None
        first, lease = await both(
            first_turn(w.publisher, w.subjects, turn),
            w.leases.try_acquire(turn.tenant, turn.session, turn.id),
        )
        earlier = (first or self.seq) < self.seq
        if lease is not None and not gone(first, self.seq) and (earlier or delivery > 1):
            # the take may have waited for this worker's own hand-over of the turn
            # before, or of another delivery of this one (acked, then released): look
            # again before giving the lease back, or running a turn done meanwhile
            first = await first_turn(w.publisher, w.subjects, turn)
        if gone(first, self.seq):
            if lease is not None:
                await lease.release()
            raise DoneElsewhere
        if (first or self.seq) >= self.seq:
            return lease
        if lease is not None:  # unused: it vouches for nothing this worker kept
            await lease.release()
        await self._when_busy(turn)
        await w._wait_turn_order(self, turn)
        return None

    async def _when_busy(self, turn: Turn) -> None:
        """An earlier turn of the session is still in the stream: unless the turn
        enqueues (the default), find the earlier turns that have not ended, and refuse
        this one (:class:`Rejected`) or interrupt them (they stop at a safe point; a
        ``rollback`` also undoes what they changed of the session)."""
        w = self._w
        mode = turn.on_busy or w.config.loop.on_busy
        if mode == "enqueue":
            return
        earlier = await unfinished(
            w.publisher, w.subjects, turn.tenant, turn.session, before=self.seq
        )
        if not earlier:
            return
        names = ", ".join(t.turn_id for t in earlier)
        if mode == "reject":
            message = f"session {turn.tenant}.{turn.session} is busy with turn {names}"
            refused = Refused(
                "session_busy", message, tenant=turn.tenant, session=turn.session,
                turn_id=turn.id,
            )  # fmt: skip
            ref = str(self.seq)
            await refusals.report(
                w.publisher, w.subjects, refused, what="turn", ref=ref, reason="rejected"
            )
            await self._ack(turn)  # handled: refused (a term would be dead-lettered too)
            raise Rejected
        log.info("turn %s interrupts %s (%s) session=%s", turn.id, names, mode, turn.session)
        for queued in earlier:
            await w.controls.send(
                Cancel(
                    tenant=turn.tenant, session=turn.session, turn_id=queued.turn_id,
                    reason=f"interrupted by turn {turn.id}", mode=mode, by_turn=turn.id,
                )
            )  # fmt: skip

    async def _still_queued(self, turn: Turn, lease: Lease) -> None:
        """Raise :class:`DoneElsewhere` (giving the lease back) if the turn left the
        stream while this worker waited for the session's lease: the holder was running
        another delivery of it, and the session's next turn may have run since."""
        w = self._w
        if gone(await first_turn(w.publisher, w.subjects, turn), self.seq):
            await lease.release()
            raise DoneElsewhere

    async def _run_engine(self, turn: Turn, delivery: int, lease: Lease) -> LoopEnd | None:
        """Start (controls and snapshot at once), run the engine, store the last
        checkpoint and then the events; a turn handed back stores what it emitted.
        The turn's ``loop_end`` (None if it had none to give)."""
        w = self._w
        # 4. start
        w.events.begin(turn.msg_id, delivery=delivery)
        w.tools.resuming(turn.msg_id, delivery > 1)
        control, kept = await both(
            w.controls.open(turn),
            w.store.preload(turn.tenant, turn.session, warm=warm(lease)),
        )
        w.stats["warm"] += kept
        if w.store.preloaded_turn(turn.tenant, turn.session) == turn.id:
            # A run of this very turn left a checkpoint (the turn was published again
            # after it failed, say): its calls may have run, whatever the delivery count.
            w.tools.resuming(turn.msg_id)
        try:
            if w.store.ended_before(turn.tenant, turn.session, turn.id):
                await self._ack(turn)  # its snapshot says it ended: a later turn is on top
                self.acked = True
                raise DoneElsewhere
            end = await w.engine.run(turn, control)  # 5. run
            await w.store.flush(turn.tenant, turn.session)  # 6. finish
            if w.events.muted(turn.msg_id):  # a checkpoint lost its race (on_stale)
                raise StaleSessionError(session_key(turn.tenant, turn.session))
            if end is not None and delivery > 1:
                w.stats["resumed"] += 1
            w.stats["finished"] += 1
            await w.events.flush(turn.msg_id)
            return end
        except asyncio.CancelledError:  # handed back: store what was emitted so far
            if self.lost is None:
                await quietly(asyncio.wait_for(w.store.flush(turn.tenant, turn.session), 2.0))
                await quietly(asyncio.wait_for(w.events.flush(turn.msg_id), 2.0))
            raise
        finally:
            w.events.end(turn.msg_id)
            w.tools.resuming(turn.msg_id, False)
            await w.controls.close_turn(turn, control)

    async def _nak(self, delay: float | None = None) -> None:
        """Hand the turn back, to be delivered again after ``delay``; every worker hears
        of it (a redelivery is no publish: the workers would not see it coming)."""
        await quietly(self.msg.nak(delay=delay) if delay else self.msg.nak())
        await self._w.share.handed_back(self.tenant, self.msg.subject, delay or 0.0)

    async def _ack(self, turn: Turn) -> None:
        """``msg.ack_sync()``, with the reply on the publisher's inbox."""
        ack = functools.partial(answered, self._w.publisher, self.msg.reply, b"+ACK")
        await retry(ack, f"ack turn {turn.id}")

    # -- from outside the turn's task ---------------------------------------------------

    def lose(self, exc: LeaseLostError) -> None:
        """Another worker may run the turn now: drop its events and stop it, keeping
        nothing (no checkpoint, no ack, no nak)."""
        self.lost = exc
        if self.turn is not None:
            self._w.events.mute(self.turn.msg_id)
        if self.task is not None:
            self.task.cancel()


def _msg_id(msg: Msg) -> str | None:
    return msg.headers.get("Nats-Msg-Id") if msg.headers else None
