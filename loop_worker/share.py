"""Fair share: the loop worker pulls turns tenant by tenant.

Each tenant's turns are read through its own durable consumer on the turns stream
(``turns-<tenant>``, filter ``loopmesh.turns.<tenant>.>``; :func:`schemas.streams.tenant_consumer`),
which the workers make when they first see one of its turns. A place that frees on a
worker goes to the tenant with turns waiting that holds the fewest places there for its
weight (``[tenants]``). So a tenant alone gets every place (the dispatch is
work-conserving), and one tenant's flood takes no place that another tenant's turn asks
for: that turn waits for the next place to free, not behind the flood.

A worker learns which tenants have turns waiting from:

- the doorbell: a plain subscription to ``loopmesh.turns.>``. A JetStream publish is a
  NATS publish, so the worker sees every turn as it is published;
- the count every delivered turn carries of the turns after it in its consumer;
- a pull that expires with nothing: none was waiting then (but those rung since);
- a scan of the consumers and of the stream's subjects, at start and every
  ``rescan_s``: turns published while no worker listened, a doorbell missed on a
  reconnect.
- a look at the consumers every third of AckWait (:meth:`FairShare.look`): turns
  delivered to a worker that died come back once their AckWait has passed, and no
  doorbell rings for them.

Its counts err high, never low: a count too high costs a pull that waits on the server
(``fetch_timeout_s``) holding one place; a count too low would leave a turn unseen until
the next scan.

Pulls are raw ``CONSUMER.MSG.NEXT`` requests, ``batch`` places at a time, all answered on
one inbox; a delivered turn is handed to the worker with its tenant. Order within a
session, ``on_busy``, leases and acks are the worker's, unchanged: a tenant's consumer
delivers its turns in stream order, as the one shared consumer did.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

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

from .config import ServiceSettings

log = logging.getLogger("loopmesh.loop_worker.share")

Deliver = Callable[[Msg, str], None]
_RETRY_S = 0.5  # a tenant's consumer that could not be made is tried again after this
_LOST_S = 1.0  # a pull unanswered this long after it expired is given up


@dataclass(eq=False)
class Tenant:
    """What this worker knows of one tenant's turns."""

    name: str
    weight: float
    waiting: int = 0  # turns believed waiting in its consumer (errs high)
    asked: int = 0  # places asked for in pulls not yet answered
    held: int = 0  # its turns this worker holds
    rung: int = 0  # doorbells heard, ever
    consumer: bool = False  # its consumer is known to exist
    snooze_until: float = 0.0  # its consumer is at its fleet-wide cap until about then
    pulls: deque[str] = field(default_factory=deque)  # its pulls in flight, oldest first

    def load(self) -> float:
        return (self.held + self.asked) / self.weight


@dataclass(eq=False)
class _Pull:
    tenant: Tenant
    left: int
    rung_at_send: int
    got: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


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
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.settings = settings
        self._limits = tenants
        self._deliver = deliver
        self.tenants: dict[str, Tenant] = {}
        self._pulls: dict[str, _Pull] = {}
        self._by_consumer: dict[str, Tenant] = {}
        self._making: dict[str, asyncio.Task[None]] = {}  # consumers being made, by tenant
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._inbox = ""
        self._subs: list[Subscription] = []
        self._stream = subjects.turns_stream

    @property
    def _js(self) -> JetStreamContext:
        return self.nc.jetstream()

    def limits(self, tenant: str) -> TenantSettings:
        return self._limits.get(tenant) or self._limits.get("*") or TenantSettings()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for turns and for the pulls' answers, then scan what is waiting."""
        self._inbox = self.nc.new_inbox()
        self._subs = [
            await self.nc.subscribe(self.subjects.all_turns, cb=self._on_bell),
            await self.nc.subscribe(self.subjects.all_handbacks, cb=self._on_handback),
            await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply),
        ]
        await self.nc.flush()
        await self.scan()

    async def close(self) -> None:
        for task in list(self._making.values()):
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
                await self._ask(tenant, batch)
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
        pending = [p.done.wait() for p in self._pulls.values()]
        if pending:  # a pull expires by itself within fetch_timeout_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.fetch_timeout_s + 1.0):
                    await asyncio.gather(*pending)

    def wake(self) -> None:
        self._changed.set()

    def finished(self, tenant: str) -> None:
        """A turn of ``tenant`` this worker held is done with: its place is free."""
        t = self.tenants.get(tenant)
        if t is not None and t.held > 0:
            t.held -= 1
        self._changed.set()

    # -- who gets the free places -------------------------------------------------------

    def assign(self, places: int) -> list[tuple[Tenant, int]]:
        """Share ``places`` between the tenants with turns waiting, one at a time to the
        one holding the fewest for its weight: ``[(tenant, places), ...]``."""
        if places <= 0:
            return []
        heap = [(t.load(), t.name, t) for t in self.tenants.values() if self._wanting(t) > 0]
        heapq.heapify(heap)
        given: dict[str, int] = {}
        while places > 0 and heap:
            _, name, t = heapq.heappop(heap)
            given[name] = given.get(name, 0) + 1
            places -= 1
            if self._wanting(t) - given[name] > 0:
                load = (t.held + t.asked + given[name]) / t.weight
                heapq.heappush(heap, (load, name, t))
        return [(self.tenants[name], n) for name, n in given.items()]

    def _wanting(self, t: Tenant) -> int:
        """Places ``t`` could use now: its waiting turns not yet asked for, under this
        worker's per-tenant cap."""
        if not t.consumer or (
            t.snooze_until and asyncio.get_running_loop().time() < t.snooze_until
        ):
            return 0
        want = t.waiting - t.asked
        cap = self.settings.tenant_max_active
        if cap:
            want = min(want, cap - t.held - t.asked)
        return want

    # -- pulls --------------------------------------------------------------------------

    async def _ask(self, t: Tenant, batch: int) -> None:
        pull_id = str(next(self._ids))
        self._pulls[pull_id] = _Pull(t, batch, t.rung)
        t.pulls.append(pull_id)
        t.asked += batch
        expires = int(self.settings.fetch_timeout_s * 1e9)
        body = json.dumps({"batch": batch, "expires": expires}).encode()
        api = f"$JS.API.CONSUMER.MSG.NEXT.{self._stream}.{self.subjects.tenant_consumer(t.name)}"
        try:
            await self.nc.publish(api, body, reply=f"{self._inbox}.{pull_id}")
        except Exception as exc:
            log.warning("pull for tenant %s not sent error=%r", t.name, exc)
            self._end(pull_id)
            return
        # A pull the server never answers (sent while the consumer was being placed on a
        # cluster, or lost in a reconnect) would hold its places for ever: given up
        # once it should long have expired.
        lost_s = self.settings.fetch_timeout_s + _LOST_S
        asyncio.get_running_loop().call_later(lost_s, self._end, pull_id)

    def _make_consumers(self) -> None:
        """Make the consumer of each tenant with turns waiting that has none known, each
        in a task of its own: a slow one (a cluster placing it) holds up no other tenant;
        the scan finds one another worker made meanwhile."""
        for t in self.tenants.values():
            if t.waiting and not t.consumer and t.name not in self._making:
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
        limits = self.limits(t.name)
        s = self.settings
        await ensure_consumer(
            self._js,
            tenant_consumer(
                self.subjects,
                t.name,
                ack_wait_s=s.ack_wait_s,
                max_deliver=s.max_deliveries,
                max_active=limits.max_active_turns,
                inactive_s=s.tenant_idle_s,
            ),
        )
        t.consumer = True

    async def _on_reply(self, msg: Msg) -> None:
        status = JetStreamContext.is_status_msg(msg)
        if not status:
            await self._on_turn(msg)
            return
        # a status comes on the pull's own reply subject (a turn, on its stored subject)
        pull_id = msg.subject.rpartition(".")[2]
        pull = self._pulls.get(pull_id)
        if status == "100" or pull is None:  # a heartbeat, or a pull already ended
            return
        t = pull.tenant
        if status in ("404", "408"):  # nothing (more) to take before the pull expired
            if not pull.got and not self.limits(t.name).max_active_turns:
                # (a capped tenant's pull may expire with turns waiting: counted still)
                t.waiting = t.rung - pull.rung_at_send  # those rung since may be coming
        elif status == "503":  # no such consumer (an idle one is removed): make it again
            t.consumer = False
        else:  # 409: the consumer is at its fleet-wide cap (max_ack_pending), or changed
            reason = (msg.headers or {}).get("Description", "")
            log.debug("pull for tenant %s ended status=%s %s", t.name, status, reason)
            loop, pause = asyncio.get_running_loop(), self.settings.fetch_timeout_s
            t.snooze_until = loop.time() + pause  # ask again after a pause, not at once
            loop.call_later(pause, self._changed.set)
        self._end(pull_id)

    async def _on_turn(self, msg: Msg) -> None:
        """A turn delivered: it answers its tenant's oldest pull (the server fills a
        consumer's pulls in the order they came)."""
        try:
            t = self._by_consumer[msg.metadata.consumer]
            pull_id = t.pulls[0]
        except (KeyError, IndexError, ValueError):  # no pull of ours asks for it now
            with contextlib.suppress(Exception):
                await msg.nak()
            return
        pull = self._pulls[pull_id]
        pull.left -= 1
        pull.got += 1
        t.asked -= 1
        t.held += 1
        t.waiting = max(t.waiting - 1, msg.metadata.num_pending)
        if pull.left <= 0:
            self._end(pull_id, answered=True)
        self._deliver(msg, t.name)

    def _end(self, pull_id: str, *, answered: bool = False) -> None:
        pull = self._pulls.pop(pull_id, None)
        if pull is None:
            return
        pull.tenant.pulls.remove(pull_id)
        if not answered:
            pull.tenant.asked -= pull.left
        pull.done.set()
        self._changed.set()

    # -- what is waiting ----------------------------------------------------------------

    async def _on_bell(self, msg: Msg) -> None:
        tokens = msg.subject.split(".")
        prefix_len = self.subjects.prefix.count(".") + 2
        if len(tokens) <= prefix_len:
            return  # not a subject the stream keeps (it has no tenant)
        self._ring(tokens[prefix_len])

    async def handed_back(self, tenant: str, delay: float = 0.0) -> None:
        """Tell every worker that a turn of ``tenant`` was handed back, to be delivered
        again after ``delay`` seconds."""
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.handback(tenant), f"{delay:g}".encode())

    async def _on_handback(self, msg: Msg) -> None:
        tenant = msg.subject.rpartition(".")[2]
        try:
            delay = min(max(float(msg.data), 0.0), 3600.0)
        except ValueError:
            log.warning("hand-back notice with no delay subject=%s data=%r", msg.subject, msg.data)
            delay = 0.0
        asyncio.get_running_loop().call_later(delay, self._ring, tenant)

    def _ring(self, tenant: str) -> None:
        t = self._tenant(tenant)
        t.rung += 1
        t.waiting += 1
        self._changed.set()

    def _tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = Tenant(name, weight=self.limits(name).weight)
            self._by_consumer[self.subjects.tenant_consumer(name)] = t
        return t

    async def look(self) -> None:
        """Look for turns due again, every third of AckWait: a tenant whose consumer has
        more turns delivered and unacked than this worker holds may have turns of a
        worker that died, redelivered once their AckWait has passed. No doorbell rings
        for a redelivery, so a pull goes to look, for as many as are held elsewhere (a
        listing of the consumers, and a pull per tenant with turns held elsewhere)."""
        async for t, info in self._consumers():
            t.waiting = max(t.waiting, (info.num_ack_pending or 0) - t.held)
        self._changed.set()

    async def _consumers(self) -> AsyncIterator[tuple[Tenant, ConsumerInfo]]:
        """Each tenant's consumer (known to exist from now on), with its info."""
        offset = 0
        while True:
            infos = await self._js.consumers_info(self._stream, offset=offset)
            for info in infos:
                name = self.subjects.tenant_of_filter(info.config.filter_subject or "")
                if name is not None:
                    t = self._tenant(name)
                    t.consumer = True
                    yield t, info
            if len(infos) < 256:
                break
            offset += len(infos)

    async def scan(self) -> None:
        """Count the turns waiting per tenant: in each tenant's consumer, and in the
        stream for tenants that have none yet. Counts only ever rise here."""
        with_consumer: set[str] = set()
        async for t, info in self._consumers():
            with_consumer.add(t.name)
            # turns delivered and not acked may be due again (their worker died): no
            # count tells, so one pull goes to look
            unacked = 1 if info.num_ack_pending else 0
            t.waiting = max(t.waiting, info.num_pending or unacked)
        try:
            stream = await self._js.stream_info(
                self._stream, subjects_filter=self.subjects.all_turns
            )
        except NotFoundError:
            return
        counts: dict[str, int] = {}
        prefix_len = self.subjects.prefix.count(".") + 2
        for subject, n in (stream.state.subjects or {}).items():
            tokens = subject.split(".")
            if len(tokens) > prefix_len:
                counts[tokens[prefix_len]] = counts.get(tokens[prefix_len], 0) + n
        for name, n in counts.items():
            if name not in with_consumer:
                t = self._tenant(name)
                t.consumer = False
                t.waiting = max(t.waiting, n)
        for name, t in list(self.tenants.items()):  # forget the tenants gone quiet
            idle = not (t.waiting or t.asked or t.held or t.pulls or name in self._making)
            if idle and name not in counts:
                del self.tenants[name]
                self._by_consumer.pop(self.subjects.tenant_consumer(name), None)
        self._changed.set()


async def _first(event: asyncio.Event, stop: asyncio.Event, *, timeout: float) -> None:
    """Wait for ``event`` or ``stop``, at most ``timeout`` seconds."""
    waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waits, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
