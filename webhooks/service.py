"""The webhooks service: turns' events POSTed to their webhooks, from a durable consumer.

It reads the events stream through one durable pull consumer (``webhooks``, filtered on
the event types a webhook may ask for, :data:`schemas.webhook.WEBHOOK_EVENTS`), and for
each event:

1. a ``loop_start`` says which webhook its turn has, or that it has none
   (:mod:`.targets`): stored in the webhooks bucket in the order the stream holds the
   events, before any later event of the turn is looked up; one that cannot be stored
   is handed back, and stored when it comes again;
2. a later event looks its turn up: in memory, else in the bucket. A turn the bucket
   does not know yet (its ``loop_start`` is being stored by another replica, or held by
   a process that died) is waited for, up to the consumer's AckWait and
   :data:`LOOKUP_MARGIN_S`; a turn still unknown then has no ``loop_start`` (it was
   refused before it started) and no webhook;
3. an event whose turn has no webhook, or one that does not ask for its type, is acked;
4. one to deliver waits for a place (``per_receiver`` tries at once to one receiver,
   ``concurrency`` in all), then is tried once (:mod:`.delivery`): signed, POSTed,
   within ``timeout_s``;
5. delivered (a 2xx answer): acked, and the ack confirmed by the server, so that no
   restart delivers it again; failed: handed back to JetStream with a delay that
   doubles each try (``backoff_s`` … ``backoff_max_s``), so a receiver that is down
   holds no place while it waits;
6. failed ``max_attempts`` times (or refused: a URL the egress policy refuses, a tenant
   with no secret): dead-lettered — a record in the dead-letter stream
   (:func:`loopmesh.deadletter.record`) and an ``error`` event (code ``webhook_failed``)
   on the turn's session — then acked. A dead letter that cannot be written is tried
   again until it is; the receiver is never tried past ``max_attempts``.

A try is a delivery of the consumer (``num_delivered``): the count survives a restart.
Events held while their receiver is busy, or while their turn is looked up, are kept
alive with in-progress acks, so a slow receiver costs its own events time, not the
others'. Nothing orders the deliveries to one receiver: a retried event arrives after
later ones, and a receiver orders by the sequence in ``webhook-id`` when it cares.

At a stop, the tries in flight get ``drain_timeout_s`` to finish (their outcome is
then acked or handed back as above); events not yet tried are handed back at once. A
process killed between a receiver's 2xx and the ack leaves the event to be delivered
again: that window is the one duplicate a receiver may see, and ``webhook-id`` (when
the stream stored the event, and its sequence: unique across streams made again and
across deployments) is how it drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge, Histogram

from loopmesh.aio import quietly, raise_if_cancelled
from loopmesh.deadletter import record
from loopmesh.egress import Resolver, resolve
from loopmesh.jetstream import Publisher, acked, retry
from loopmesh.kv import open_kv
from loopmesh.provision import check_partitions
from loopmesh.webhook import WebhookSettings
from schemas import Subjects, Webhook, encode, turn_msg_id
from schemas.codec import DecodeError
from schemas.events import Error, Event, LoopStart, decode_event
from schemas.streams import WEBHOOKS_ACK_WAIT_S

from .delivery import Deliverer, Try
from .targets import Targets

log = logging.getLogger("loopmesh.webhooks")

#: The code of the ``error`` event that says a delivery was given up on (never itself
#: delivered: a receiver that fails would otherwise be sent its own failures).
ERROR_CODE = "webhook_failed"

DELIVERED = Counter(
    "loopmesh_webhook_deliveries", "Events delivered to their webhook (a 2xx answer)", ["type"]
)
FAILED = Counter(
    "loopmesh_webhook_failures",
    "Delivery tries that failed: status, timeout, connect, unresolvable, refused, no_secret",
    ["failure"],
)
DEAD = Counter(
    "loopmesh_webhook_dead_letters", "Deliveries given up on (dead-lettered)", ["failure"]
)
TRY_SECONDS = Histogram(
    "loopmesh_webhook_try_seconds",
    "One delivery try: the URL's check, the POST and the receiver's answer",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
IN_FLIGHT = Gauge("loopmesh_webhook_in_flight", "Delivery tries in flight")
WAITING = Gauge("loopmesh_webhook_waiting", "Events waiting for their receiver's turn")

_FETCH = 256
#: A turn whose ``loop_start`` is not recorded is waited for this long past the
#: consumer's AckWait (the longest a ``loop_start`` held by a dead process stays away).
LOOKUP_MARGIN_S = 10.0


@dataclass(slots=True, eq=False)
class _Held:
    msg: Msg
    task: asyncio.Task[None] | None = None
    trying: bool = False


@dataclass(slots=True, eq=False)
class _Receiver:
    slots: asyncio.Semaphore
    users: int = 0


@dataclass(slots=True)
class Stats:
    delivered: int = 0
    failed: int = 0
    dead_lettered: int = 0
    skipped: int = 0  # events with nothing to deliver
    by_type: dict[str, int] = field(default_factory=dict)


class WebhookService:
    """Delivers events to webhooks until ``stop`` is set (:meth:`run`)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: WebhookSettings,
        *,
        resolver: Resolver = resolve,
        transport: httpx.AsyncBaseTransport | None = None,
        unsigned_level: int = logging.WARNING,
    ) -> None:
        self.nc = nc
        #: How loudly to say at start that no secret is set (``loopmesh up``: quietly, a
        #: development mesh often has no webhook at all).
        self.unsigned_level = unsigned_level
        self.subjects = subjects
        self.settings = settings
        self.publisher = Publisher(nc)
        self.stats = Stats()
        self._resolver = resolver
        self._transport = transport
        self._held: dict[tuple[str, int], _Held] = {}  # by stream and sequence
        self._room = asyncio.Event()
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._receivers: dict[str, _Receiver] = {}
        self._deliverer: Deliverer | None = None
        self._targets: Targets | None = None
        self._lookup_s = WEBHOOKS_ACK_WAIT_S + LOOKUP_MARGIN_S

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Pull from the webhooks consumer of every events stream (one per partition,
        ``[nats] partitions``) into one set of held deliveries."""
        js = self.nc.jetstream()
        await check_partitions(js, self.subjects)  # else a partition would go unread
        durable = self.subjects.webhooks_consumer
        self._targets = Targets(await open_kv(js, self.publisher, self.subjects.webhooks_bucket))
        ack_wait, subs = 0.0, []
        try:
            for stream in self.subjects.events_streams:
                info = await retry(
                    lambda at=stream: js.consumer_info(at, durable),  # type: ignore[misc]
                    f"consumer {durable} of {stream}",
                )
                ack_wait = max(ack_wait, info.config.ack_wait or WEBHOOKS_ACK_WAIT_S)
                subs.append(await js.pull_subscribe_bind(durable, stream))
            self._lookup_s = ack_wait + LOOKUP_MARGIN_S
            if self.settings.secret is None and not self.settings.tenant_secrets:
                log.log(
                    self.unsigned_level,
                    "no webhook secret is set ([webhooks] secret, LOOPMESH_WEBHOOKS__SECRET): "
                    "every delivery is refused and dead-lettered",
                )
            async with (
                Deliverer(
                    self.settings, resolver=self._resolver, transport=self._transport
                ) as self._deliverer,
                asyncio.TaskGroup() as tg,
            ):
                keepalive = tg.create_task(self._keepalive(ack_wait))
                log.info(
                    "webhooks ready: consumer %s of %s",
                    durable, ", ".join(self.subjects.events_streams),
                )  # fmt: skip
                if ready is not None:
                    ready.set()
                await asyncio.wait([tg.create_task(self._pull(sub, tg, stop)) for sub in subs])
                await self._drain()
                keepalive.cancel()
        finally:
            for sub in subs:
                await quietly(sub.unsubscribe())

    # -- pulling ------------------------------------------------------------------------

    async def _pull(
        self, sub: JetStreamContext.PullSubscription, tg: asyncio.TaskGroup, stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            room = self.settings.max_held - len(self._held)
            if room <= 0:
                self._room.clear()
                await _first_of(stop.wait(), self._room.wait())
                continue
            try:
                msgs = await sub.fetch(min(room, _FETCH), timeout=1.0)
            except TimeoutError:  # nats-py raises its own, a TimeoutError, when idle
                continue
            except nats.errors.Error as exc:  # a leader change, a node restarting
                log.warning("fetching events failed error=%r", exc)
                await _first_of(stop.wait(), asyncio.sleep(0.5))
                continue
            for msg in msgs:
                await self._take(msg, tg)

    async def _take(self, msg: Msg, tg: asyncio.TaskGroup) -> None:
        """Note a ``loop_start``'s webhook (in stream order), then deliver in a task."""
        assert self._targets is not None
        try:
            event = decode_event(msg.data)
        except DecodeError:
            log.error("not an event on %s: %r", msg.subject, msg.data[:200])
            await quietly(msg.term())
            return
        if isinstance(event, LoopStart):
            try:
                await self._targets.record(event)
            except Exception as exc:
                log.warning("webhook of turn %s not stored error=%r", event.turn_id, exc)
                await quietly(msg.nak(delay=1.0))
                return
        held = self._held[_key(msg)] = _Held(msg)
        held.task = tg.create_task(self._deliver(held, event))

    async def _keepalive(self, ack_wait: float) -> None:
        """In-progress acks for every held event, so none is redelivered while held."""
        while True:
            await asyncio.sleep(ack_wait / 3)
            for held in list(self._held.values()):
                await quietly(held.msg.in_progress())
            raise_if_cancelled()

    async def _drain(self) -> None:
        """Hand back the events not tried yet; give the tries in flight their time."""
        for held in list(self._held.values()):
            if not held.trying and held.task is not None:
                held.task.cancel()
        trying = [h.task for h in self._held.values() if h.trying and h.task is not None]
        if trying:
            _, late = await asyncio.wait(trying, timeout=self.settings.drain_timeout_s)
            for task in late:
                task.cancel()

    # -- one event ----------------------------------------------------------------------

    async def _deliver(self, held: _Held, event: Event) -> None:
        msg = held.msg
        meta = msg.metadata
        seq, attempt = meta.sequence.stream, meta.num_delivered
        assert self._targets is not None and self._deliverer is not None
        try:
            webhook = None if _ours(event) else await self._target(event)
            if webhook is None or event.type not in webhook.events:
                self.stats.skipped += 1
                await self._ack(msg)
                return
            if attempt > self.settings.max_attempts:  # only its dead letter failed
                reason = "every try failed (the last one's reason went with its process)"
                tries = self.settings.max_attempts
                await self._give_up(msg, event, webhook, tries, "exhausted", reason)
                return
            secret = self.settings.secret_for(event.tenant)
            if secret is None:
                reason = (
                    f"no webhook secret for tenant {event.tenant}: set [webhooks] secret or "
                    f"[webhooks.tenant_secrets] {event.tenant}; nothing was sent"
                )
                FAILED.labels("no_secret").inc()
                await self._give_up(msg, event, webhook, attempt, "no_secret", reason)
                return
            async with self._receiver(webhook.url), self._slots:
                held.trying = True
                IN_FLIGHT.inc()
                try:
                    result = await self._deliverer.send(
                        webhook, self._delivery_id(msg), msg.data, secret
                    )
                finally:
                    IN_FLIGHT.dec()
            await self._settle(msg, event, webhook, attempt, result)
        except asyncio.CancelledError:
            await quietly(msg.nak())  # a stop: delivered again by the next service
            raise
        except Exception:
            log.exception("delivery of event %d not settled; handed back", seq)
            await quietly(msg.nak(delay=self.settings.backoff_s))
        finally:
            self._held.pop(_key(msg), None)
            self._room.set()

    async def _target(self, event: Event) -> Webhook | None:
        """The webhook of the event's turn, waiting while its ``loop_start`` is being
        recorded elsewhere (:mod:`.targets`); ``None`` once the wait is over."""
        assert self._targets is not None
        found = await self._targets.wait(event, self._lookup_s)
        if isinstance(found, Webhook) or found is None:
            return found
        log.info("turn %s has no loop_start recorded after %.0f s: no webhook",
                 event.turn_id, self._lookup_s)  # fmt: skip
        return None

    async def _settle(
        self, msg: Msg, event: Event, webhook: Webhook, attempt: int, result: Try
    ) -> None:
        TRY_SECONDS.observe(result.seconds)
        seq = msg.metadata.sequence.stream
        if result.delivered:
            await self._ack(msg)
            DELIVERED.labels(event.type).inc()
            self.stats.delivered += 1
            self.stats.by_type[event.type] = self.stats.by_type.get(event.type, 0) + 1
            log.info("delivered event %d (%s) try %d status=%s", seq, event.type, attempt,
                     result.status)  # fmt: skip
            return
        failure = result.failure or "status"
        FAILED.labels(failure).inc()
        self.stats.failed += 1
        if result.final or attempt >= self.settings.max_attempts:
            await self._give_up(msg, event, webhook, attempt, failure, result.reason)
            return
        delay = self.backoff(attempt)
        log.warning("event %d (%s) try %d of %d failed: %s; again in %.1f s", seq, event.type,
                    attempt, self.settings.max_attempts, result.reason, delay)  # fmt: skip
        await quietly(msg.nak(delay=delay))

    def _delivery_id(self, msg: Msg) -> str:
        """The delivery's ``webhook-id``, the same on every try and from every replica:
        when the events stream stored the event (Unix microseconds) and its sequence
        there, ``<stored>-<sequence>``, or ``<stored>-<partition>-<sequence>`` with
        partitions. A stream made again, or another deployment's, numbers its events
        from 1 again: the time keeps their ids apart."""
        meta = msg.metadata
        stored = round(meta.timestamp.timestamp() * 1_000_000)
        if self.subjects.partitions == 1:
            return f"{stored}-{meta.sequence.stream}"
        partition = self.subjects.events_streams.index(meta.stream)
        return f"{stored}-{partition}-{meta.sequence.stream}"

    def backoff(self, attempt: int) -> float:
        """The wait after try ``attempt`` failed: ``backoff_s`` doubled each try, up to
        ``backoff_max_s``, give or take a fifth (receivers that come back are not hit by
        every retry at once)."""
        s = self.settings
        base = min(s.backoff_s * 2 ** min(attempt - 1, 62), s.backoff_max_s)
        return min(base * random.uniform(0.8, 1.2), s.backoff_max_s)

    async def _give_up(
        self, msg: Msg, event: Event, webhook: Webhook, attempt: int, failure: str, reason: str
    ) -> None:
        """Dead-letter the event, trying again (``backoff_s`` doubling, up to
        ``backoff_max_s``) until the dead letter is written; the receiver is not tried
        again. At a stop the event is handed back, and the next process, finding its
        tries spent, only dead-letters it."""
        failed = 0
        while True:
            try:
                message = await self._dead_letter(msg, event, webhook, attempt, reason)
                break
            except Exception as exc:
                raise_if_cancelled()
                failed += 1
                delay = self.backoff(failed)
                log.warning(
                    "event %d (%s) not settled: its dead letter failed error=%r; again in %.1f s",
                    msg.metadata.sequence.stream, event.type, exc, delay,
                )  # fmt: skip
                await asyncio.sleep(delay)
        DEAD.labels(failure).inc()
        self.stats.dead_lettered += 1
        log.error("%s", message)
        await self._ack(msg)

    async def _dead_letter(
        self, msg: Msg, event: Event, webhook: Webhook, attempt: int, reason: str
    ) -> str:
        """Its record and an ``error`` event on its session (each deduplicated, so
        written again harmlessly); what they say."""
        seq = msg.metadata.sequence.stream
        tries = f"{attempt} {'try' if attempt == 1 else 'tries'}"
        message = (
            f"the webhook delivery of event {seq} ({event.type}) to {webhook.url} was "
            f"given up after {tries}: {reason}"
        )
        await record(
            self.publisher, self.subjects, stream=msg.metadata.stream, seq=seq,
            subject=msg.subject, data=msg.data, deliveries=attempt, reason=message,
            headers={"Loopmesh-Webhook-Url": webhook.url},
        )  # fmt: skip
        error = Error(
            tenant=event.tenant, session=event.session, turn_id=event.turn_id,
            iteration=event.iteration, ts=time.time(), code=ERROR_CODE, message=message,
        )  # fmt: skip
        subject = self.subjects.event(event.tenant, event.session, error.type)
        msg_id = f"{turn_msg_id(event.tenant, event.session, event.turn_id)}:webhook:{seq}"
        payload = encode(error)
        await retry(
            lambda: acked(self.publisher, subject, payload, {"Nats-Msg-Id": msg_id}),
            f"publish {msg_id}",
        )
        return message

    async def _ack(self, msg: Msg) -> None:
        """Ack, and wait for the server to confirm it: a delivery is final only then."""
        await retry(lambda: msg.ack_sync(timeout=5.0), "ack an event")

    @contextlib.asynccontextmanager
    async def _receiver(self, url: str) -> AsyncIterator[None]:
        """One of ``per_receiver`` places at the URL's origin (scheme, host and port)."""
        origin = _origin(url)
        receiver = self._receivers.get(origin)
        if receiver is None:
            receiver = self._receivers[origin] = _Receiver(
                asyncio.Semaphore(self.settings.per_receiver)
            )
        receiver.users += 1
        waiting = receiver.slots.locked()
        if waiting:
            WAITING.inc()
        try:
            async with receiver.slots:
                if waiting:
                    WAITING.dec()
                    waiting = False
                yield
        finally:
            if waiting:
                WAITING.dec()
            receiver.users -= 1
            if not receiver.users:
                self._receivers.pop(origin, None)


def _ours(event: Event) -> bool:
    """An ``error`` event this service published about a failed delivery."""
    return isinstance(event, Error) and event.code == ERROR_CODE


def _origin(url: str) -> str:
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.scheme}://{parsed.host.lower()}:{port}"


def _key(msg: Msg) -> tuple[str, int]:
    """A held event's key: sequences repeat across the events streams (partitions)."""
    return msg.metadata.stream, msg.metadata.sequence.stream


async def _first_of(*aws: object) -> None:
    """Wait for the first of ``aws`` (coroutines) to finish; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
