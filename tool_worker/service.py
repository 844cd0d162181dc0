"""The pool service: pull tool-call requests, run each call once, record, reply, ack.

One :class:`ToolWorker` serves one pool. It pulls from the pool's durable consumer only
for the capacity it has free (so a backlog stays in the stream, where KEDA sees it),
keeping pull requests outstanding so that an idle worker gets a new call pushed at
once. For each request:

1. decode the request (a request that cannot be decoded is terminated, never
   redelivered, and answered with ``invalid_request`` when its ``reply_to`` can be
   recovered; so is one whose call id is not :func:`schemas.call_id` of its tenant,
   session, turn and iteration, with ``invalid_call_id``: the call id keys the effect
   record, so another turn's would read or overwrite that turn's result) and look up
   the call's effect record — except on the first delivery of
   a request marked ``first_attempt``, which cannot have one (a turn's first run asks
   for each call once, and the stream keeps one copy per call id);
2. if there is an effect record, that is the result;
3. otherwise (on a cluster, once this delivery has claimed the call, a claim renewed
   while the call runs: :mod:`tool_worker.claims`) validate the arguments against the
   tool's JSON Schema, run the tool under its timeout (with in-progress acks while it
   runs; the tool sees the call's id as its idempotency key,
   :mod:`tool_worker.context`) and publish the result to the effects bucket — cut to
   fit in one NATS message if it is larger, with a ``payload_truncated`` event
   (:mod:`loopmesh.payload`);
4. core-publish the result to ``reply_to`` and publish the ``tool_result`` /
   ``tool_error`` / ``tool_timeout`` event while the effect is being stored. The
   event is published to the stream's subject without asking for JetStream's
   acknowledgement (``confirm_events=True`` asks, and logs failures): the engine that
   awaited the call publishes the same event under the same ``Nats-Msg-Id``, and
   JetStream keeps one, so this copy only makes it visible sooner;
5. ack once the effect is stored.

A worker that dies before step 3 finishes leaves the request unacked: it is redelivered
after AckWait. So is a call whose in-progress acks did not get through for longer than
AckWait (the cluster stalled): a worker that gets a call it is still running does not
run it again, it acks the redelivery once the first run is acked (calls in flight are
kept by call id). Delivered to another worker on a cluster, it is left to this one
while this one renews the call's claim; once the claim has gone unrenewed for AckWait,
the call runs again there: at least once for a call in flight at a crash or a stall
past AckWait (docs/ARCHITECTURE.md).

On stop it stops pulling, naks what is delivered afterwards, lets in-flight calls finish
within a deadline and naks the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from loopmesh import tracing
from loopmesh.aio import raise_if_cancelled
from loopmesh.jetstream import Publisher, quietly, worker_name
from loopmesh.payload import fit, limit_of
from loopmesh.provision import ensure_consumer
from schemas import (
    DecodeError,
    InvalidIdError,
    Subjects,
    ToolCallRequest,
    ToolResult,
    WireError,
    check_call_id,
    decode,
    encode,
    is_token,
    pool_consumer,
)

from . import traces
from .call_events import CallEvents
from .catalog import Catalog
from .claims import Claims
from .effects import Effects
from .execute import CallRunner
from .mcp import McpServer
from .registry import Registry

log = logging.getLogger("tool_worker")

_STATUS = "Status"
_PENDING = "Nats-Pending-Messages"


class ToolWorker:
    """Serves ``registry``'s tools to the requests of one pool.

    ::

        worker = ToolWorker(nc, registry, pool="default")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run(stop))
    """

    def __init__(
        self,
        nc: Client,
        registry: Registry,
        *,
        pool: str = "default",
        subjects: Subjects | None = None,
        concurrency: int = 64,
        ack_wait_s: float = 30.0,
        pull_expires_s: float = 15.0,
        drain_timeout_s: float = 20.0,
        mcp: Sequence[McpServer] = (),
        mcp_start_timeout_s: float = 30.0,
        catalog: bool = True,
        pinned: bool = False,
        event_max_chars: int = 32_768,
        store_timeout_s: float = 10.0,
        confirm_events: bool = False,
        name: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.nc = nc
        self.registry = registry
        self.pool = pool
        self.subjects = subjects = subjects or Subjects()
        self.concurrency = concurrency
        self.ack_wait_s = ack_wait_s
        self.pull_expires_s = pull_expires_s
        self.drain_timeout_s = drain_timeout_s
        self.mcp = {server.name: server for server in mcp}
        self.mcp_start_timeout_s = mcp_start_timeout_s
        self.catalog = catalog
        self.pinned = pinned
        self.event_max_chars = event_max_chars
        self.store_timeout_s = store_timeout_s
        self.confirm_events = confirm_events
        self.name = name or worker_name()
        self.ready = asyncio.Event()
        self.stats = {
            "calls": 0, "recorded": 0, "rejected": 0, "naked": 0, "joined": 0, "left": 0,
        }  # fmt: skip

        self._js = nc.jetstream()
        self._consumer = pool_consumer(subjects, pool, ack_wait_s=ack_wait_s)
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{self._consumer.stream}.{self._consumer.durable}"
        self._deliver = nc.new_inbox()
        self._threshold = max(1, concurrency // 16)
        self._outstanding = 0  # messages asked for and not yet delivered
        self._running: dict[str, tuple[Msg, float, asyncio.Task[None]]] = {}
        # by call id: whether the first run of a call running here ended acked
        self._calls: dict[str, asyncio.Future[bool]] = {}
        self._last_activity = 0.0
        self._stopping = False
        self._busy = 0  # delivered calls whose result is not known yet
        self._capacity = asyncio.Event()  # set when a pull may be due
        self._tg: asyncio.TaskGroup | None = None
        self._effects: Effects | None = None
        self._claims: Claims | None = None
        self._publisher = Publisher(nc)
        #: Runs one call: ``await worker.execute(request)`` (never raises for a tool's failure).
        self.execute = CallRunner(registry, self.mcp, pool=pool, name=self.name)
        self._events = CallEvents(
            nc, subjects, self._publisher, max_chars=event_max_chars, confirm=confirm_events
        )
        self._naks: set[asyncio.Future[None]] = set()  # deliveries handed back on stop

    # -- lifecycle ------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then finish in-flight calls and return."""
        await ensure_consumer(self._js, self._consumer)
        await self._publisher.start()
        self._effects = await Effects.open(self.nc, self._publisher, self.subjects)
        self._claims = await Claims.open(
            self.nc, self._publisher, self.subjects, self.name, ack_wait_s=self.ack_wait_s
        )
        sub = await self.nc.subscribe(self._deliver, cb=self._on_delivery)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                servers = [tg.create_task(s.run(), name=f"mcp-{n}") for n, s in self.mcp.items()]
                await self._wait_for_mcp()
                background = [tg.create_task(self._keepalive(), name="keepalive")]
                if self.catalog:
                    catalog = await Catalog.open(
                        self._js, self.subjects, self.registry, self.pool, pinned=self.pinned
                    )
                    await catalog.publish_first()  # in the catalog before it says it is ready
                    background.append(tg.create_task(catalog.run(), name="catalog"))
                background.append(tg.create_task(self._puller(), name="puller"))
                self.ready.set()
                log.info(
                    "serving pool=%s tools=%d concurrency=%d worker=%s",
                    self.pool, len(self.registry), self.concurrency, self.name,
                )  # fmt: skip
                await stop.wait()
                self._stopping = True
                # No more deliveries: the server drops pull requests nobody listens to,
                # and what was already delivered is naked by _on_delivery.
                await sub.drain()
                await self._finish_in_flight()
                for server in self.mcp.values():
                    server.close()
                if servers:
                    await asyncio.wait(servers, timeout=10.0)
                for task in background:
                    task.cancel()
        finally:
            self._tg = None
            if not self._stopping:  # failed before draining the subscription
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await self._events_flushed(5.0)
            await self._publisher.close()
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=5)  # acks and naks are on the wire

    async def _wait_for_mcp(self) -> None:
        if not self.mcp:
            return
        waits = [s.wait_ready(self.mcp_start_timeout_s) for s in self.mcp.values()]
        for server, ok in zip(self.mcp.values(), await asyncio.gather(*waits), strict=True):
            if not ok:
                log.warning("MCP server %s not ready; serving without its tools", server.name)

    async def _finish_in_flight(self) -> None:
        tasks = [task for _, _, task in self._running.values()]
        if not tasks:
            return
        log.info("finishing %d in-flight calls (deadline %ss)", len(tasks), self.drain_timeout_s)
        _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout_s)
        for task in pending:
            task.cancel()  # the task naks its message
        if pending:
            await asyncio.wait(pending)

    async def _events_flushed(self, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._publisher.wait_idle()
        except TimeoutError:
            log.warning("%d events unconfirmed at exit", self._publisher.pending)

    # -- pulling --------------------------------------------------------------------

    async def _puller(self) -> None:
        """Pull whenever capacity may have freed; completions in one loop iteration
        share one pull request."""
        while True:
            await self._pull()
            raise_if_cancelled()
            await self._capacity.wait()
            self._capacity.clear()

    async def _pull(self) -> None:
        """Ask for as many messages as there is free capacity (in batches of at least
        ``_threshold``, unless idle)."""
        if self._stopping:
            return
        busy = self._busy + self._outstanding
        want = self.concurrency - busy
        if want <= 0 or (want < self._threshold and busy):
            return
        self._outstanding += want
        request = b'{"batch":%d,"expires":%d}' % (want, int(self.pull_expires_s * 1e9))
        self._last_activity = time.monotonic()
        await self.nc.publish(self._next, request, reply=self._deliver)

    async def _on_delivery(self, msg: Msg) -> None:
        """A delivery (or a pull request's end): the call's task starts at once."""
        self._last_activity = time.monotonic()
        status = msg.headers.get(_STATUS) if msg.headers else None
        if status is not None:
            if status == "100":
                return  # idle heartbeat
            pending = msg.headers.get(_PENDING) if msg.headers else None
            if pending is not None:
                self._outstanding = max(0, self._outstanding - int(pending))
            else:
                self._outstanding = 0
            if status not in ("404", "408"):
                description = msg.headers.get("Description", "") if msg.headers else ""
                log.warning("pull request ended: %s %s", status, description)
            self._capacity.set()
            return
        self._outstanding = max(0, self._outstanding - 1)
        if self._stopping or self._tg is None:
            task = asyncio.ensure_future(quietly(msg.nak()))
            self._naks.add(task)
            task.add_done_callback(self._naks.discard)
            self.stats["naked"] += 1
            return
        task = self._tg.create_task(self._handle(msg))
        self._running[msg.reply] = (msg, time.monotonic(), task)
        self._busy += 1

    async def _keepalive(self) -> None:
        """In-progress acks for long calls; re-pull if pull requests were lost."""
        period = min(self.ack_wait_s / 3, self.pull_expires_s / 2)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for msg, started, _ in list(self._running.values()):
                if now - started >= period:
                    await msg.in_progress()
            if self._claims is not None:  # the calls that run here are still claimed
                await self._claims.renew(older_than=period)
            raise_if_cancelled()
            if self._outstanding and now - self._last_activity > self.pull_expires_s + 5:
                silent = now - self._last_activity
                log.warning("no answer to pull requests for %.0fs; pulling again", silent)
                self._outstanding = 0
                self._capacity.set()

    # -- one call -------------------------------------------------------------------

    async def _handle(self, msg: Msg) -> None:
        freed = False

        def free() -> None:
            """The call no longer needs a slot (its result is known): pull the next."""
            nonlocal freed
            if not freed:
                freed = True
                self._busy -= 1
                self._capacity.set()

        try:
            await self._process(msg, free)
        except asyncio.CancelledError:
            await quietly(msg.nak())
            self.stats["naked"] += 1
            raise
        except Exception:
            log.exception("call failed before it was recorded; handing it back")
            await quietly(msg.nak(delay=1.0))
            self.stats["naked"] += 1
        finally:
            free()
            self._running.pop(msg.reply, None)

    async def _process(self, msg: Msg, free: Callable[[], None]) -> None:
        try:
            request = decode(msg.data, ToolCallRequest)
        except DecodeError as exc:
            await self._reject(msg, str(exc))
            return
        if not msg.subject.endswith(f".{request.server}.{request.tool}"):
            await self._reject(
                msg,
                f"request for {request.server}.{request.tool} was published on {msg.subject}",
            )
            return
        try:  # the call id keys the effect record: another turn's must not reach it
            check_call_id(
                request.call_id, request.tenant, request.session, request.turn_id, request.iteration
            )
        except InvalidIdError as exc:
            await self._reject(msg, str(exc), code="invalid_call_id")
            return
        running = self._calls.get(request.call_id)
        if running is not None:  # delivered again while it runs here: no second run
            await self._join(msg, request, running, free)
            return
        first = self._calls[request.call_id] = asyncio.get_running_loop().create_future()
        acked = False
        try:
            acked = await self._run(msg, request, free)
        finally:
            del self._calls[request.call_id]
            if self._claims is not None:
                self._claims.end(request.call_id)
            first.set_result(acked)

    async def _join(
        self,
        msg: Msg,
        request: ToolCallRequest,
        running: asyncio.Future[bool],
        free: Callable[[], None],
    ) -> None:
        """A call delivered again while this worker still runs it: a redelivery (the
        cluster stalled past the consumer's AckWait, so in-progress acks did not get
        through), or a new message of the same call (a resumed turn asking again) that
        came after the first run replied but before it was acked. It waits for the first
        run (whose in-progress acks also cover a redelivery: they name the stream
        sequence; a new message that waits past AckWait is delivered again and joins
        again), then is answered from the record that run stored, to its own
        ``reply_to`` (a requester that has the result already drops the copy), and
        acked. A first run that was handed back has nakked a redelivery already; a new
        message is redelivered after AckWait."""
        self.stats["joined"] += 1
        log.warning(
            "call delivered again (%d) while it runs here; not run twice call_id=%s",
            msg.metadata.num_delivered, request.call_id,
        )  # fmt: skip
        free()
        if not await asyncio.shield(running):
            return
        assert self._effects is not None
        recorded = await self._effects.get(request.call_id)
        if recorded is not None and request.reply_to:
            await self.nc.publish(request.reply_to, recorded[1])
        await msg.ack()

    async def _run(self, msg: Msg, request: ToolCallRequest, free: Callable[[], None]) -> bool:
        """Answer the call from its record, or run it and record it; True once acked."""
        assert self._effects is not None
        recorded = None
        if not (request.first_attempt and msg.metadata.num_delivered == 1):
            recorded = await self._effects.get(request.call_id)
        if recorded is not None:
            result, payload = recorded
            self.stats["recorded"] += 1
            stored = None
        else:
            assert self._claims is not None
            meta = msg.metadata
            seq, delivery = meta.sequence.stream, meta.num_delivered
            if not await self._claims.take(request.call_id, seq=seq, delivery=delivery):
                self.stats["left"] += 1
                log.warning(
                    "call claimed by another delivery (%d); left to it call_id=%s",
                    delivery, request.call_id,
                )  # fmt: skip
                return False
            with traces.tool_span(request, msg.headers, self.pool) as span:  # off: a no-op
                result = await self.execute(request, attempt=msg.metadata.num_delivered)
                tracing.tool_result(span, result)
            # Too large for one message: cut, and recorded cut, so a repeat sees the same.
            fitted = fit(result, limit_of(self.nc))
            result, payload = fitted.value, fitted.data
            if fitted.cut:
                await self._events.cut(request, fitted)
            stored = await self._effects.put(request.call_id, payload)
            self.stats["calls"] += 1
        free()
        # The reply goes out while the store confirms the effect; the request is acked
        # only once it has. A requester may see a result whose record then failed to
        # store: the call is redelivered and its tool may run again (as when a worker
        # dies between running a tool and recording it).
        if request.reply_to:
            await self.nc.publish(request.reply_to, payload)
        timeout = request.timeout_s or self.execute.timeout_of(request)
        await self._events.outcome(request, result, timeout)
        if stored is not None:
            await self._effects.stored(
                request.call_id, payload, stored, timeout=self.store_timeout_s
            )
        await msg.ack()
        return True

    async def _reject(self, msg: Msg, reason: str, code: str = "invalid_request") -> None:
        """Terminate a request that can never succeed; answer it if we can tell whom."""
        log.warning("rejecting request on %s: %s", msg.subject, reason)
        self.stats["rejected"] += 1
        await msg.term()
        try:
            raw = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            raw = None
        if not isinstance(raw, dict):
            return
        reply_to, call_id = raw.get("reply_to"), raw.get("call_id")
        if not isinstance(call_id, str) or not is_token(call_id):
            call_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        if isinstance(reply_to, str) and reply_to and " " not in reply_to:
            result = ToolResult(
                call_id=call_id,
                status="error",
                error=WireError(code=code, message=reason),
                worker=self.name,
                finished_at=time.time(),
            )
            await self.nc.publish(reply_to, encode(result))
