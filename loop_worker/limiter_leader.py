"""The fleet's rate-limit leader: one loop worker holds every model's windows and queues.

Every loop worker with ``[llm.limits] models`` campaigns (:meth:`LimiterLeader.run`);
the one that holds the key ``leader`` of the limits bucket serves. It renews the key
with a revision check every ``tick``; a candidate that sees the key's revision unchanged
for ``ttl_s`` (by its own clock: no clocks are compared) takes it over with a revision
check, so one of several candidates wins. The leader grants only within two thirds of
``ttl_s`` from when it *sent* its last write of the key that stands (a candidate saw
that write later, so it waits longer): a late reply cannot stretch the lease. A write
whose reply does not come is read back, and stands if it committed. A leader whose lease
lapsed grants nothing and steps down; one that finds the key taken steps down at once.
One that stepped down while the key still holds its own last write takes it back at
once (nobody took it since): a lapse costs no candidate's TTL.
On stop it leaves its state and deletes the key: the next leader takes over within a
tick. The key's revision when a leader took it is its :attr:`~LimiterLeader.term`,
carried by each grant with the leader's name and clock (docs/ARCHITECTURE.md, "Fleet-wide
LLM rate limits", says why that is enough).

While it leads it subscribes to ``<prefix>.limits.ask`` and ``.settle`` and keeps a
:class:`~loop_worker.engine.ratebook.RateBook`. An ask is answered at once when it may
go; else it is held, and answered when granted or after its ``wait_s`` (it still waits:
the worker asks again under the same id and keeps its place; an ask not asked again
within :data:`GRACE_S` gives its place up, for its worker is gone). Every ``tick`` the
leader leaves what it counted (:class:`~schemas.limits.LimiterState`, in whole
seconds) under ``state``, which the next leader starts from: a crash loses at most a
tick of grants; a provider's 429 covers the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyWrongLastSequenceError
from prometheus_client import Gauge

from loopmesh.aio import quietly, raise_if_cancelled
from loopmesh.jetstream import KV
from schemas import Subjects, decode, encode
from schemas.limits import (
    LeaderRecord,
    LimitAnswer,
    LimitAsk,
    LimiterState,
    LimitSettle,
    WindowState,
)

from .engine.ratebook import Ask, RateBook
from .engine.settings import LimitSettings

log = logging.getLogger("loopmesh.loop_worker.limiter")

LEADING = Gauge("loopmesh_llm_limiter_leader", "1 while this worker is the rate-limit leader")
WAITING = Gauge(
    "loopmesh_llm_limit_waiting",
    "LLM requests waiting for the rate limits at the leader",
    ["gen_ai_request_model"],
)

LEADER_KEY = "leader"
STATE_KEY = "state"
#: An ask answered "still waiting" keeps its place this long for its worker to ask again.
GRACE_S = 2.0
#: A leader's state older than this is not read (its windows are over).
STATE_MAX_AGE_S = 3600.0


@dataclass(slots=True)
class _Held:
    """An ask the leader has not answered yet (``reply``), or answered "still waiting"
    and expects again (``reply`` empty, until ``drop_at``)."""

    reply: str
    poll_until: float
    drop_at: float = math.inf


class LimiterLeader:
    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: LimitSettings,
        *,
        owner: str,
        kv: KV,
        ttl_s: float,
        pauses: Callable[[], dict[str, float]],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.settings = settings
        self.owner = owner
        self.ttl_s = ttl_s
        self.tick = min(ttl_s / 3, 1.0)
        self._pauses = pauses  # model -> monotonic end, as this worker knows them
        self.book: RateBook | None = None  # while leading
        self.changed = asyncio.Event()  # set when leading starts or stops
        self._kv = kv
        self._revision = 0  # of the leader key, while leading
        self.term = 0  # the key's revision when this leader took it (0: not leading)
        self._state_revision: int | None = None
        self._renewed = 0.0  # when the last write of the key that stands was *sent*
        self._written = b""  # that write
        self._subs: list[Subscription] = []
        self._held: dict[str, _Held] = {}
        self._deadlines: list[tuple[float, str]] = []  # (poll_until or drop_at, ident)
        self._wake = asyncio.Event()
        self._sleeping_until = -math.inf  # when the pump means to wake (-inf: awake)
        self._closed = False

    @property
    def leading(self) -> bool:
        return self.book is not None

    # -- the campaign ---------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign, and serve while leading, until cancelled or closed."""
        async with asyncio.TaskGroup() as tg:
            pump = tg.create_task(self._pump(), name="limits pump")
            await self._campaign()
            pump.cancel()

    async def _campaign(self) -> None:
        seen: int | None = None
        seen_at = 0.0
        while not self._closed:
            try:
                if self.leading:
                    await self._renew()
                else:
                    entry = await self._kv.entry(LEADER_KEY)
                    revision = entry.revision if entry is not None else 0
                    if revision != seen:
                        seen, seen_at = revision, time.monotonic()
                    free = entry is None or entry.value is None
                    # its own last write still there: nobody took the key since
                    mine = entry is not None and entry.value == self._written
                    if free or mine or time.monotonic() - seen_at >= self.ttl_s:
                        await self._take(revision)
            except Exception as exc:
                log.warning("rate-limit leadership round failed error=%r", exc)
                if self.leading and self._lapsed():
                    await self._step_down("its key could not be renewed")
            raise_if_cancelled()
            await asyncio.sleep(self.tick)

    async def _write(self, last: int) -> int:
        """Write this worker's record over revision ``last`` of the key; its revision.

        The lease runs from when the write was *sent*: a candidate can only have seen
        it after that, so however late the reply comes, this leader stops answering
        before any candidate may take over. A reply is awaited a third of the TTL
        (later it is of no use); one that does not come may be of a write that
        committed, so the key is read back, and a write found there stands. Raises
        ``KeyWrongLastSequenceError`` when the key was not at ``last``."""
        body = encode(LeaderRecord(owner=self.owner, at=time.time()))
        sent = time.monotonic()
        try:
            revision = await self._kv.update(LEADER_KEY, body, last, timeout=self.ttl_s / 3)
        except TimeoutError:  # nats.errors.TimeoutError is one
            entry = await self._kv.entry(LEADER_KEY, timeout=self.ttl_s / 3)
            if entry is None or entry.value != body:
                if entry is not None and entry.revision != last:
                    raise KeyWrongLastSequenceError(description="taken meanwhile") from None
                raise  # not written: the next round writes again
            revision = entry.revision  # it committed; its reply was lost
            log.info("rate-limit leader key written, its reply lost revision=%d", revision)
        self._renewed, self._written = sent, body
        return revision

    async def _take(self, revision: int) -> None:
        try:
            self._revision = await self._write(revision)
        except KeyWrongLastSequenceError:
            return  # another candidate took it first
        self.term = self._revision
        await self._lead()

    async def _renew(self) -> None:
        try:
            self._revision = await self._write(self._revision)
        except KeyWrongLastSequenceError:
            await self._step_down("another worker holds the key")
            return
        await self._save()

    async def _lead(self) -> None:
        book = RateBook(self.settings)
        entry = await self._kv.entry(STATE_KEY)
        self._state_revision = entry.revision if entry is not None else 0
        if entry is not None and entry.value:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                state = decode(entry.value, LimiterState)
                age = time.time() - state.at
                if 0 <= age < STATE_MAX_AGE_S:
                    book.load(
                        (w.model, w.tenant, w.kind, [(s - age, n) for s, n in w.expiring])
                        for w in state.windows
                    )
        for model, until in self._pauses().items():
            book.pause(model, until)
        self.book = book
        self._subs = [
            await self.nc.subscribe(self.subjects.limits_ask, cb=self._on_ask),
            await self.nc.subscribe(self.subjects.limits_settle, cb=self._on_settle),
        ]
        LEADING.set(1)
        self.changed.set()
        log.info("rate-limit leader now owner=%s term=%d models=%s", self.owner, self.term,
                 list(self.settings.models))  # fmt: skip

    async def _step_down(self, why: str) -> None:
        if self.book is None:
            return
        self.book = None
        term, self.term = self.term, 0
        subs, self._subs = self._subs, []
        for sub in subs:
            await quietly(sub.unsubscribe())
        held, self._held = self._held, {}
        self._deadlines.clear()
        for h in held.values():  # ask again now: the next leader answers
            if h.reply:
                await quietly(self.nc.publish(h.reply, encode(LimitAnswer())))
        for model in self.settings.models:
            WAITING.labels(model).set(0)
        LEADING.set(0)
        self.changed.set()
        log.warning("rate-limit leader no more owner=%s term=%d: %s", self.owner, term, why)

    async def close(self) -> None:
        """Stand no more; a leader leaves its state and the key to the next. Idempotent."""
        self._closed = True
        if not self.leading:
            return
        with contextlib.suppress(Exception):
            await self._save()
            await self._kv.delete(LEADER_KEY, self._revision)
        await self._step_down("stopped")

    async def _save(self) -> None:
        book = self.book
        if book is None:
            return
        windows = [
            WindowState(model=model, tenant=tenant, kind=kind, expiring=expiring)  # type: ignore[arg-type]
            for model, tenant, kind, expiring in book.dump()
        ]
        state = encode(LimiterState(at=time.time(), owner=self.owner, windows=windows))
        try:
            last = self._state_revision or 0
            self._state_revision = await self._kv.update(STATE_KEY, state, last)
        except KeyWrongLastSequenceError:
            entry = await self._kv.entry(STATE_KEY)  # a former leader's, written late
            self._state_revision = entry.revision if entry is not None else 0

    # -- serving --------------------------------------------------------------------------

    def pause(self, model: str, until: float) -> None:
        """A pause heard on the wire (``until`` on the monotonic clock)."""
        if self.book is not None:
            self.book.pause(model, until)
            self._wake.set()

    def _nudge(self) -> None:
        """Wake the pump if something is due before it means to wake."""
        book = self.book
        if book is None:
            return
        due = [t for t in (book.next_wake(), self._next_deadline()) if t is not None]
        if due and min(due) < self._sleeping_until:
            self._wake.set()

    def _lapsed(self) -> bool:
        """Whether this leader's lease has lapsed: its last write of the key that stands
        was sent more than two thirds of the TTL ago (a candidate may take over a third
        later). Then it grants nothing."""
        return time.monotonic() - self._renewed > self.ttl_s * 2 / 3

    def _grant(self) -> bytes | None:
        """A grant's answer (who grants, in which term, when), or ``None`` while this
        leader's lease has lapsed: then it grants nothing, and the pump steps it down."""
        if self._lapsed():
            self._wake.set()
            return None
        return encode(LimitAnswer(granted=True, leader=self.owner, term=self.term, at=time.time()))

    async def _on_ask(self, msg: Msg) -> None:
        book = self.book
        if book is None or not msg.reply:
            return  # its worker asks again: the leader, once there is one, answers
        if self._lapsed():
            self._wake.set()  # the pump steps this leader down
            return
        try:
            ask = decode(msg.data, LimitAsk)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self.nc.publish(msg.reply, encode(LimitAnswer(error=f"a bad ask: {exc}")))
            return
        granted = []
        if book.state(ask.id) is None:
            granted = book.ask(ask.id, ask.model, ask.tenant, ask.tokens, ask.hold_s)
        found = book.state(ask.id)
        answer = self._grant() if found is not None and found.granted is not None else None
        if answer is not None:  # granted now, or asked again
            self._held.pop(ask.id, None)
            await self.nc.publish(msg.reply, answer)
        else:
            until = time.monotonic() + min(ask.wait_s, self.ttl_s)
            self._held[ask.id] = _Held(msg.reply, until)
            heapq.heappush(self._deadlines, (until, ask.id))
        await self._deliver(granted)  # the others it let go
        self._nudge()

    async def _on_settle(self, msg: Msg) -> None:
        book = self.book
        if book is None:
            return
        try:
            settle = decode(msg.data, LimitSettle)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("a bad settle ignored error=%s", exc)
            return
        self._held.pop(settle.id, None)
        await self._deliver(book.settle(settle.id, settle.tokens, sent=settle.sent))
        self._nudge()

    async def _deliver(self, granted: list[Ask]) -> None:
        for ask in granted:
            held = self._held.get(ask.ident)
            if held is not None and held.reply and (answer := self._grant()) is not None:
                del self._held[ask.ident]
                # lost: its worker asks again after its timeout, and is answered then
                await quietly(self.nc.publish(held.reply, answer))
            # else its worker asks again soon and is answered then (or gives it up)

    async def _pump(self) -> None:
        """Grant what the clock frees, answer the asks that waited their ``wait_s``, and
        give up the places of asks not asked again."""
        while True:
            book = self.book
            if book is None:
                self.changed.clear()
                await self.changed.wait()
                continue
            try:
                if self._lapsed():  # a stalled leader: the campaign steps it down
                    await self._step_down("its key was not renewed in time")
                    continue
                await self._deliver(book.pump())
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, ident = heapq.heappop(self._deadlines)
                    await self._expire(book, ident, now)
                for model in self.settings.models:
                    WAITING.labels(model).set(book.waiting(model))
            except Exception:  # a bug here must not take the loop worker down with it
                log.exception("rate-limit pump failed; going on")
            wakes = [t for t in (book.next_wake(), self._next_deadline()) if t is not None]
            self._sleeping_until = min(wakes) if wakes else math.inf
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(wakes) - time.monotonic() if wakes else None):
                    await self._wake.wait()
            self._sleeping_until = -math.inf  # awake: nothing needs to wake it
            raise_if_cancelled()

    async def _expire(self, book: RateBook, ident: str, now: float) -> None:
        held = self._held.get(ident)
        if held is None:
            return
        if held.reply and held.poll_until <= now:  # it waited its wait_s: ask again
            waiting = book.waiting(a.model) if (a := book.state(ident)) is not None else 0
            await quietly(self.nc.publish(held.reply, encode(LimitAnswer(waiting=waiting))))
            held.reply, held.drop_at = "", now + GRACE_S
            heapq.heappush(self._deadlines, (held.drop_at, ident))
        elif not held.reply and held.drop_at <= now:  # its worker is gone
            del self._held[ident]
            await self._deliver(book.settle(ident, sent=False))

    def _next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None
