"""Fair share: the loop worker pulls turns tenant by tenant.

Each tenant's turns are read through its own durable consumers on the turns stream, one
per lane (:func:`schemas.streams.tenant_consumer`): ``turns-<tenant>`` takes its
interactive turns (``loopmesh.turns.<tenant>.*``), ``batch-<tenant>`` its batch ones
(``loopmesh.turns.<tenant>.*.>``: ``.batch`` after the session). The workers make each
when they first see one of its turns of that lane, narrowing a consumer of both lanes
(``loopmesh.turns.<tenant>.>``, as made before the lanes) to the interactive one first.

Who gets a free place is :mod:`loop_worker.lanes`' rule (:func:`~loop_worker.lanes.assign`):
interactive turns first, then the tenant holding the fewest places for its weight.

A worker learns which tenants have turns waiting from:

- the doorbell: a plain subscription to ``loopmesh.turns.>``. A JetStream publish is a
  NATS publish, so the worker sees every turn as it is published;
- the count every delivered turn carries of the turns after it in its consumer;
- a pull that expires with nothing: none was waiting then (but those rung since); for a
  tenant with a ``max_active_turns`` the pull may have expired at its consumer's cap
  with turns waiting, so its consumer's count is read instead;
- a scan of the consumers and of the stream's subjects, at start and every
  ``rescan_s``: turns published while no worker listened, a doorbell missed on a
  reconnect.
- a look at the consumers every third of AckWait (:meth:`FairShare.look`): turns
  delivered to a worker that died come back once their AckWait has passed, and no
  doorbell rings for them.

Its counts err high, never low: a count too high costs a pull that waits on the server
(``fetch_timeout_s``) holding one place; a count too low would leave a turn unseen until
the next scan.

Pulls are raw ``CONSUMER.MSG.NEXT`` requests (:mod:`loop_worker.pulls`), ``batch`` places
at a time, all answered on one inbox; a delivered turn is handed to the worker with its
tenant. Order within a
session, ``on_busy``, leases and acks are the worker's: a lane's consumer delivers its
turns in stream order, and a turn whose session has an earlier turn in the other lane
waits for it (:func:`loop_worker.order.first_turn` reads both).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerInfo
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from loopmesh.provision import ensure_consumer
from loopmesh.settings import TenantSettings
from schemas import Subjects
from schemas.streams import tenant_consumer
from schemas.subjects import PROBE_HEADER
from schemas.types import Priority

from .config import ServiceSettings
from .lanes import LANES, Lane, Tenant, assign
from .pulls import Deliver, Pulls

log = logging.getLogger("loopmesh.loop_worker.share")

_RETRY_S = 0.5  # a tenant's consumer that could not be made is tried again after this


class FairShare:
    """Pulls turns for one worker, fairly between tenants::

    share = FairShare(nc, subjects, settings, tenants, deliver=on_turn)
    await share.start()
    await share.run(free=lambda: places_free, stop=stop)   # until stop is set
    share.finished(tenant)   # when a delivered turn is done with (acked or handed back)
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: ServiceSettings,
        tenants: Mapping[str, TenantSettings],
        *,
        deliver: Deliver,
        heard: Callable[[str, Msg], None] | None = None,
    ) -> None:
        self.nc = nc
        self._heard = heard  # each turn heard published, with its tenant
        self.subjects = subjects
        self.settings = settings
        self._limits = tenants
        self.tenants: dict[str, Tenant] = {}
        self._by_consumer: dict[str, Lane] = {}
        self._making: dict[str, asyncio.Task[None]] = {}  # consumers being made, by tenant
        self._counting: dict[Lane, asyncio.Task[None]] = {}  # lanes being counted again
        self._changed = asyncio.Event()
        self._pulls = Pulls(
            nc, subjects, settings, lanes=self._by_consumer, limits=self.limits,
            recount=self._recount, deliver=deliver, changed=self._changed,
        )  # fmt: skip
        self._subs: list[Subscription] = []

    @property
    def _js(self) -> JetStreamContext:
        return self.nc.jetstream()

    def limits(self, tenant: str) -> TenantSettings:
        return self._limits.get(tenant) or self._limits.get("*") or TenantSettings()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for turns and for the pulls' answers, then scan what is waiting."""
        self._subs = [
            await self.nc.subscribe(self.subjects.published_turns, cb=self._on_bell),
            await self.nc.subscribe(self.subjects.all_handbacks, cb=self._on_handback),
            await self._pulls.listen(),
        ]
        await self.nc.flush()
        await self.scan()

    async def close(self) -> None:
        for task in [*self._making.values(), *self._counting.values()]:
            task.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    async def run(self, free: Callable[[], int], stop: asyncio.Event) -> None:
        """Ask for turns while places are free, until ``stop`` is set; then wait for the
        pulls in flight to be answered (a turn they bring is the worker's to hand back)."""
        clock = asyncio.get_running_loop()
        every = self.settings.ack_wait_s / 3
        rescan = clock.time() + self.settings.rescan_s
        look = clock.time() + every
        while not stop.is_set():
            self._changed.clear()
            self._make_consumers()
            places = free() - sum(t.asked for t in self.tenants.values())
            for tenant, batch in self.assign(places):
                await self._pulls.ask(tenant, batch)
            now = clock.time()
            if now >= min(rescan, look):
                full = now >= rescan
                if full:
                    rescan = now + self.settings.rescan_s
                look = now + every
                try:
                    await (self.scan() if full else self.look())
                except Exception as exc:
                    log.warning("scanning the turns stream failed error=%r", exc)
                continue
            await _first(self._changed, stop, timeout=min(rescan, look) - now)
        await self._pulls.answered()

    def wake(self) -> None:
        self._changed.set()

    def inherit(self, tenant: str, behind: bool) -> None:
        """An interactive turn of ``tenant`` held here waits (``behind``), or no longer
        waits, for an earlier batch turn of its session: meanwhile the tenant's batch
        lane is served with the interactive lanes (priority inheritance), so the batch
        turn is not left behind every interactive turn of the fleet, and this one with it."""
        t = self._tenant(tenant)
        t.inheriting += 1 if behind else -1
        self._changed.set()

    def finished(self, tenant: str, subject: str) -> None:
        """A turn of ``tenant`` this worker held, delivered on ``subject`` (its lane), is
        done with: its place is free."""
        t = self.tenants.get(tenant)
        lane = t.lanes[self.subjects.lane_of(subject)] if t is not None else None
        if lane is not None and lane.held > 0:
            lane.held -= 1
        self._changed.set()

    # -- who gets the free places -------------------------------------------------------

    def assign(self, places: int) -> list[tuple[Lane, int]]:
        """Share ``places`` between the tenants' lanes with turns waiting
        (:func:`~loop_worker.lanes.assign`): ``[(lane, places), ...]``."""
        return assign(self.tenants.values(), places, cap=self.settings.tenant_max_active)

    # -- consumers --------------------------------------------------------------------------

    def _make_consumers(self) -> None:
        """Make the consumer of each lane with turns waiting that has none known, each
        tenant in a task of its own: a slow one (a cluster placing it) holds up no other
        tenant; the scan finds those another worker made meanwhile."""
        for t in self.tenants.values():
            lacking = any(lane.waiting and not lane.consumer for lane in t.lanes.values())
            if lacking and t.name not in self._making:
                self._making[t.name] = asyncio.create_task(self._make(t))

    async def _make(self, t: Tenant) -> None:
        try:
            await self._ensure(t)
        except Exception as exc:  # (a cluster electing a leader): try again shortly
            log.warning("consumer for tenant %s not made error=%r", t.name, exc)
            await asyncio.sleep(_RETRY_S)
        finally:
            del self._making[t.name]
            self._changed.set()

    async def _ensure(self, t: Tenant) -> None:
        """Make (or update) the tenant's consumers of the lanes with turns waiting, the
        interactive one first whenever it is not known: it narrows a consumer of both
        lanes made before the lanes, which would overlap the batch one (a narrowed
        consumer keeps its turns, delivered or not). A tenant that sends no batch turns
        gets no batch consumer: on a cluster each is a raft group."""
        limits = self.limits(t.name)
        s = self.settings
        for priority, lane in t.lanes.items():
            if lane.consumer or not (lane.waiting or priority == "interactive"):
                continue
            await ensure_consumer(
                self._js,
                tenant_consumer(
                    self.subjects,
                    t.name,
                    ack_wait_s=s.ack_wait_s,
                    max_deliver=s.max_deliveries,
                    max_active=limits.max_active_turns,
                    inactive_s=s.tenant_idle_s,
                    priority=priority,
                ),
            )
            lane.consumer = True

    # -- what is waiting ----------------------------------------------------------------

    def _recount(self, lane: Lane) -> None:
        """Count ``lane``'s waiting turns again from its consumer: a count that erred
        high would otherwise stay high, its pulls expiring empty for ever, and with
        strict priority an interactive lane believed waiting keeps every batch lane
        from the places it asks for."""
        if lane not in self._counting:
            self._counting[lane] = asyncio.create_task(self._count(lane))

    async def _count(self, lane: Lane) -> None:
        consumer = self.subjects.tenant_consumer(lane.tenant.name, lane.priority)
        rung = lane.rung
        try:
            stream = self.subjects.turns_stream_of(lane.tenant.name)
            info = await self._js.consumer_info(stream, consumer)
        except Exception as exc:  # the next expired pull asks again
            log.debug("consumer %s not read error=%r", consumer, exc)
        else:  # those rung since may not be counted yet: err high
            lane.waiting = (info.num_pending or 0) + lane.rung - rung
            self._changed.set()
        finally:
            del self._counting[lane]

    async def _on_bell(self, msg: Msg) -> None:
        if msg.headers and PROBE_HEADER in msg.headers:
            return  # a check of the server's turn mappings: nothing is stored
        subject = self.subjects.stored_turn(msg.subject)
        tokens = subject.split(".")
        prefix_len = self.subjects.prefix.count(".") + 2
        if len(tokens) <= prefix_len:
            return  # not a subject the stream keeps (it has no tenant)
        self._ring(tokens[prefix_len], self.subjects.lane_of(subject))
        if self._heard is not None:
            self._heard(tokens[prefix_len], msg)

    def waiting(self, tenant: str) -> int:
        """The tenant's turns this worker counts waiting, both lanes (errs high)."""
        t = self.tenants.get(tenant)
        return sum(lane.waiting for lane in t.lanes.values()) if t is not None else 0

    async def handed_back(self, tenant: str, subject: str, delay: float = 0.0) -> None:
        """Tell every worker that a turn of ``tenant``, delivered on ``subject`` (its
        lane), was handed back, to be delivered again after ``delay`` seconds."""
        lane = self.subjects.lane_of(subject)
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.handback(tenant, lane), f"{delay:g}".encode())

    async def _on_handback(self, msg: Msg) -> None:
        head = self.subjects.handback("")
        tenant, _, lane = msg.subject[len(head) :].partition(".")
        try:
            delay = min(max(float(msg.data), 0.0), 3600.0)
        except ValueError:
            log.warning("hand-back notice with no delay subject=%s data=%r", msg.subject, msg.data)
            delay = 0.0
        priority: Priority = "batch" if lane else "interactive"
        asyncio.get_running_loop().call_later(delay, self._ring, tenant, priority)

    def _ring(self, tenant: str, priority: Priority) -> None:
        lane = self._tenant(tenant).lanes[priority]
        lane.rung += 1
        lane.waiting += 1
        self._changed.set()

    def _tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = Tenant(name, weight=self.limits(name).weight)
            for priority, lane in t.lanes.items():
                self._by_consumer[self.subjects.tenant_consumer(name, priority)] = lane
        return t

    async def look(self) -> None:
        """Look for turns due again, every third of AckWait: a tenant whose consumer has
        more turns delivered and unacked than this worker holds may have turns of a
        worker that died, redelivered once their AckWait has passed. No doorbell rings
        for a redelivery, so a pull goes to look, for as many as are held elsewhere (a
        listing of the consumers, and a pull per tenant with turns held elsewhere)."""
        async for lane, info in self._consumers():
            lane.waiting = max(lane.waiting, (info.num_ack_pending or 0) - lane.held)
        self._changed.set()

    async def _consumers(self) -> AsyncIterator[tuple[Lane, ConsumerInfo]]:
        """Each tenant's consumer of each lane, with its info. A consumer of both lanes
        (made before the lanes) counts as the interactive lane's, to be narrowed: it
        delivers the turns it holds meanwhile."""
        for stream in self.subjects.turns_streams:
            offset = 0
            while True:
                infos = await self._js.consumers_info(stream, offset=offset)
                for info in infos:
                    found = self.subjects.lane_of_filter(info.config.filter_subject or "")
                    if found is not None:
                        name, priority = found
                        lane = self._tenant(name).lanes[priority or "interactive"]
                        lane.consumer = priority is not None  # (None: narrowed at its next turn)
                        yield lane, info
                if len(infos) < 256:
                    break
                offset += len(infos)

    async def scan(self) -> None:
        """Count the turns waiting per tenant: in each tenant's consumer, and in the
        stream for tenants that have none yet. Counts only ever rise here."""
        with_consumer: set[tuple[str, Priority]] = set()
        async for lane, info in self._consumers():
            with_consumer.add((lane.tenant.name, lane.priority))
            # turns delivered and not acked may be due again (their worker died): no
            # count tells, so one pull goes to look
            unacked = 1 if info.num_ack_pending else 0
            lane.waiting = max(lane.waiting, info.num_pending or unacked)
        stored: dict[str, int] = {}
        for name in self.subjects.turns_streams:
            try:
                stream = await self._js.stream_info(name, subjects_filter=self.subjects.all_turns)
            except NotFoundError:
                continue
            stored.update(stream.state.subjects or {})
        counts: dict[tuple[str, Priority], int] = {}
        prefix_len = self.subjects.prefix.count(".") + 2
        for subject, n in stored.items():
            tokens = subject.split(".")
            if len(tokens) > prefix_len:
                key = (tokens[prefix_len], self.subjects.lane_of(subject))
                counts[key] = counts.get(key, 0) + n
        for (name, priority), n in counts.items():
            if (name, priority) not in with_consumer:
                lane = self._tenant(name).lanes[priority]
                lane.consumer = False
                lane.waiting = max(lane.waiting, n)
        tenants_waiting = {name for name, _ in counts}
        for name, t in list(self.tenants.items()):  # forget the tenants gone quiet
            pulls = any(lane.pulls for lane in t.lanes.values())
            busy = t.waiting or t.asked or t.held or t.inheriting or pulls
            idle = not busy and name not in self._making
            if idle and name not in tenants_waiting:
                del self.tenants[name]
                for priority in LANES:
                    self._by_consumer.pop(self.subjects.tenant_consumer(name, priority), None)
        self._changed.set()


async def _first(event: asyncio.Event, stop: asyncio.Event, *, timeout: float) -> None:
    """Wait for ``event`` or ``stop``, at most ``timeout`` seconds."""
    waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waits, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
