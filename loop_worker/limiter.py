"""The fleet's LLM rate limits (``[llm.limits]``), shared by every loop worker over NATS.

:class:`SharedLimiter` is the :class:`~loop_worker.engine.ratelimit.RateLimiter` that
the worker's ``OpenAILLM`` uses. For a model with limits, each request's place is asked
of the limiter leader (:mod:`.limiter_leader`, one loop worker elected through the
limits bucket) with a request on ``<prefix>.limits.ask``: answered at once when the
request may go, else held there, fairly across tenants, and answered when it may (or
after ``wait_s``, when the worker asks again under the same id, keeping its place). No
leader (an election under way) is a short wait: the ask is sent again. A call no leader
answers for ``leader_wait_s`` fails (:class:`~.errors.LimiterUnavailableError`, the
default ``no_leader = "fail"``) or goes uncounted (``"allow"``). A grant of a leader
deposed by one heard since (a lower term) is refused. A cancelled wait gives its place
up (a settle, never sent). After the request, the place is settled with the tokens the
reply used, and the grant's leader, term and time: what a checker hears on ``.settle``.

A provider's 429 with ``Retry-After`` pauses the model for every worker: the pause is
broadcast on ``<prefix>.limits.pause`` (every worker and the leader hear it at once)
and kept in the limits bucket for workers that start later. A model without limits
waits here for its pause, with no message; one with limits waits at the leader.

Metrics (the worker's registry): the time each request waited
(``loopmesh_llm_limit_wait_seconds``), the tokens granted (estimates,
``loopmesh_llm_limit_tokens_granted``), the calls no leader answered
(``loopmesh_llm_limit_unanswered``), the pauses (``loopmesh_llm_pauses``); the
provider's 429s are counted by ``OpenAILLM`` (``loopmesh_llm_rate_limited``).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import secrets
import time
from typing import TYPE_CHECKING

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyWrongLastSequenceError
from prometheus_client import Counter, Histogram

from loopmesh.aio import quietly, raise_if_cancelled
from loopmesh.jetstream import KV, Publisher, answered, kv_values, open_kv, worker_name
from schemas import Subjects, decode, encode
from schemas.limits import LimitAnswer, LimitAsk, LimitPause, LimitSettle

from .engine.ratelimit import Permit
from .engine.settings import LimitSettings
from .errors import LimiterError, LimiterUnavailableError
from .limiter_leader import LimiterLeader

if TYPE_CHECKING:
    from .config import LoopWorkerConfig

log = logging.getLogger("loopmesh.loop_worker.limiter")

WAITS = Histogram(
    "loopmesh_llm_limit_wait_seconds",
    "Time an LLM request waited for the rate limits (and pauses) before it was sent",
    ["gen_ai_request_model"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
GRANTED = Counter(
    "loopmesh_llm_limit_tokens_granted",
    "Tokens granted to LLM requests by the rate limits (estimates: prompt and reply ceiling)",
    ["gen_ai_request_model"],
)
UNANSWERED = Counter(
    "loopmesh_llm_limit_unanswered",
    "LLM requests no rate-limit leader answered for leader_wait_s, by what was done "
    "([llm.limits] no_leader: refused, or allowed uncounted)",
    ["gen_ai_request_model", "outcome"],
)
PAUSES = Counter(
    "loopmesh_llm_pauses",
    "Pauses of a model after the provider answered 429 with Retry-After (by this worker)",
    ["gen_ai_request_model"],
)

#: How long the leader may hold an ask before answering that it still waits.
WAIT_S = 5.0
#: Beyond ``WAIT_S``, how long an ask's answer may take before it is sent again.
ANSWER_S = 2.0


class _Permit:
    __slots__ = ("_grant", "_ident", "_limiter", "_settled")

    def __init__(
        self, limiter: SharedLimiter | None, ident: str, grant: LimitAnswer | None = None
    ) -> None:
        self._limiter = limiter
        self._ident = ident
        self._grant = grant
        self._settled = False

    async def settle(self, tokens: int | None = None, *, sent: bool = True) -> None:
        if self._settled or self._limiter is None:
            return
        self._settled = True
        await self._limiter._settle(self._ident, tokens, sent, self._grant)


_FREE = _Permit(None, "")  # a model without limits, or none answered: nothing to settle


class SharedLimiter:
    """``[llm.limits]`` for one worker: ask the leader, hear the pauses, and campaign to
    lead (:meth:`run`, in the worker's task group)::

        limiter = SharedLimiter.for_worker(nc, config)
        async with OpenAILLM(config.llm, limiter=limiter) as llm:
            await LoopWorker(nc, config, llm=llm, limiter=limiter).run(stop)
    """

    @classmethod
    def for_worker(cls, nc: Client, config: LoopWorkerConfig) -> SharedLimiter:
        """The limiter of a loop worker with ``config``: a place held by a worker that
        dies counts until twice the LLM's timeout has passed."""
        s = config.loop_worker
        return cls(
            nc, config.nats.subjects, config.llm.limits, name=s.name or worker_name(),
            hold_s=max(60.0, 2 * config.llm.timeout_s), leader_ttl_s=s.limiter_ttl_s,
        )  # fmt: skip

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: LimitSettings,
        *,
        name: str,
        publisher: Publisher | None = None,
        hold_s: float = 120.0,
        leader_ttl_s: float = 6.0,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.settings = settings
        self.name = name
        self.publisher = publisher or Publisher(nc)
        self._owns_publisher = publisher is None
        self.hold_s = hold_s
        self.leader_ttl_s = leader_ttl_s
        self._prefix = f"{name}-{secrets.token_hex(3)}-"  # two workers named alike differ
        self._ids = itertools.count(1)
        self._pauses: dict[str, float] = {}  # model -> monotonic end
        self._term = 0  # the last leader's term heard: a lower one's grant is refused
        self._term_heard = 0.0
        # the leader answers "still waiting" within this: a leader is heard well within
        # leader_wait_s while a call queues behind the limit
        self._wait_s = min(WAIT_S, settings.leader_wait_s / 2)
        self._pause_sub: Subscription | None = None
        self._kv: KV | None = None
        self.leader: LimiterLeader | None = None  # a candidate once started, with limits

    async def start(self) -> None:
        """Hear pauses from now on, learn those still running, and (with limits) stand
        as a candidate for leader (:meth:`run`)."""
        if self._pause_sub is not None:
            return
        js, bucket = self.nc.jetstream(), self.subjects.limits_bucket
        self._pause_sub = await self.nc.subscribe(self.subjects.limits_pause, cb=self._on_pause)
        try:
            self._kv = kv = await open_kv(js, self.publisher, bucket)
        except Exception as exc:
            if self.settings.models:
                raise
            # no limits to keep: pauses are still heard, just not kept for later workers
            log.warning("no %s bucket (provision it): pauses are not kept error=%r", bucket, exc)
            return
        for value in (await kv_values(js, bucket, "pause.>")).values():
            self._heard(value)
        if self.settings.models:
            self.leader = LimiterLeader(
                self.nc, self.subjects, self.settings, owner=self.name, kv=kv,
                ttl_s=self.leader_ttl_s, pauses=lambda: dict(self._pauses),
            )  # fmt: skip

    async def run(self) -> None:
        """Campaign to lead, and lead when elected, until cancelled (no limits: return)."""
        if self.leader is not None:
            await self.leader.run()

    async def close(self) -> None:
        """Stop hearing pauses; a leader leaves its state to the next. Idempotent."""
        sub, self._pause_sub = self._pause_sub, None
        if sub is not None:
            await quietly(sub.unsubscribe())
        if self.leader is not None:
            await self.leader.close()
        if self._owns_publisher:
            await self.publisher.close()

    async def __aenter__(self) -> SharedLimiter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the RateLimiter --------------------------------------------------------------

    async def acquire(self, model: str, tenant: str, tokens: int) -> Permit:
        started = time.monotonic()
        await self._paused(model)  # a pause heard here (the leader holds asks for it too)
        if model not in self.settings.models:
            WAITS.labels(model).observe(time.monotonic() - started)
            return _FREE
        ident = f"{self._prefix}{next(self._ids)}"
        ask = encode(
            LimitAsk(id=ident, model=model, tenant=tenant, tokens=tokens, hold_s=self.hold_s,
                     wait_s=self._wait_s)
        )  # fmt: skip
        try:
            grant = await self._ask(ask)
        except BaseException:
            await self._settle(ident, None, False)  # its place, if it was granted meanwhile
            raise
        if grant is None:  # no leader answered for leader_wait_s
            await self._settle(ident, None, False)
            return self._unanswered(model, time.monotonic() - started)
        WAITS.labels(model).observe(time.monotonic() - started)
        GRANTED.labels(model).inc(tokens)
        return _Permit(self, ident, grant)

    async def _ask(self, ask: bytes) -> LimitAnswer | None:
        """The leader's grant of ``ask``; ``None`` once no leader has answered for
        ``leader_wait_s`` (a leader's "still waiting" is an answer)."""
        delay = 0.02
        answered_at = time.monotonic()
        while (left := answered_at + self.settings.leader_wait_s - time.monotonic()) > 0:
            try:
                timeout = min(self._wait_s + ANSWER_S, left)
                msg = await answered(self.publisher, self.subjects.limits_ask, ask, timeout=timeout)
            except nats.errors.NoRespondersError:  # no leader this moment: an election
                raise_if_cancelled()
                await asyncio.sleep(min(delay, max(left, 0.0)))
                delay = min(delay * 2, 1.0)
                continue
            except nats.errors.TimeoutError:  # the leader died holding it: ask the next
                raise_if_cancelled()
                continue
            raise_if_cancelled()
            answer = decode(msg.data, LimitAnswer)
            if answer.error:
                raise LimiterError(answer.error)
            if answer.term and self._deposed(answer.term):
                log.warning("a grant of a former rate-limit leader refused leader=%s term=%d "
                            "current=%d", answer.leader, answer.term, self._term)  # fmt: skip
                await asyncio.sleep(min(delay, max(left, 0.0)))
                delay = min(delay * 2, 1.0)
                continue
            answered_at, delay = time.monotonic(), 0.02
            if answer.term:
                self._term, self._term_heard = answer.term, answered_at
            if answer.granted:
                return answer
        return None

    def _deposed(self, term: int) -> bool:
        """Whether a grant of ``term`` comes from a leader deposed by one heard within
        the leader TTL. (A leader not heard for that long may be gone with its bucket:
        one made again counts its terms from 1.)"""
        return term < self._term and time.monotonic() - self._term_heard < self.leader_ttl_s

    def _unanswered(self, model: str, waited_s: float) -> Permit:
        """A call no leader answered: refused (``no_leader = "fail"``), or let go uncounted."""
        allow = self.settings.no_leader == "allow"
        UNANSWERED.labels(model, "allowed" if allow else "refused").inc()
        log.warning("no rate-limit leader answered for %.0f s model=%s: the call is %s",
                    waited_s, model, "made uncounted" if allow else "refused")  # fmt: skip
        if not allow:
            raise LimiterUnavailableError(model, waited_s)
        WAITS.labels(model).observe(waited_s)
        return _FREE

    async def _settle(
        self, ident: str, tokens: int | None, sent: bool, grant: LimitAnswer | None = None
    ) -> None:
        settle = LimitSettle(id=ident, tokens=tokens, sent=sent)
        if grant is not None:
            settle = msgspec.structs.replace(
                settle, leader=grant.leader, term=grant.term, granted_at=grant.at
            )
        body = encode(settle)
        await quietly(self.nc.publish(self.subjects.limits_settle, body))

    async def pause(self, model: str, seconds: float) -> None:
        seconds = min(seconds, self.settings.max_pause_s)
        pause = LimitPause(model=model, until=time.time() + seconds, by=self.name)
        body = encode(pause)
        self._heard(body)
        PAUSES.labels(model).inc()
        await quietly(self.nc.publish(self.subjects.limits_pause, body))
        try:
            await self._keep(pause, body)
        except Exception as exc:  # the broadcast did the work; this is for later workers
            log.warning("pause not stored model=%s error=%r", model, exc)

    # -- pauses -----------------------------------------------------------------------

    async def _keep(self, pause: LimitPause, body: bytes) -> None:
        """Store the pause under its model's key, unless a longer one is there."""
        kv = self._kv
        if kv is None:
            return
        key = "pause." + base64.urlsafe_b64encode(pause.model.encode()).decode().rstrip("=")
        for _ in range(3):
            entry = await kv.entry(key)
            if entry is not None and entry.value:
                with _ignored():
                    if decode(entry.value, LimitPause).until >= pause.until:
                        return
            try:
                await kv.update(key, body, entry.revision if entry is not None else 0)
                return
            except KeyWrongLastSequenceError:
                continue  # another worker's pause: compare again

    async def _on_pause(self, msg: Msg) -> None:
        self._heard(msg.data)

    def _heard(self, body: bytes) -> None:
        with _ignored():
            pause = decode(body, LimitPause)
            until = time.monotonic() + (pause.until - time.time())
            if until <= time.monotonic() or until <= self._pauses.get(pause.model, 0.0):
                return
            self._pauses[pause.model] = until
            log.info("model paused model=%s for=%.1fs by=%s", pause.model,
                     pause.until - time.time(), pause.by)  # fmt: skip
            if self.leader is not None:
                self.leader.pause(pause.model, until)

    async def _paused(self, model: str) -> None:
        """Until ``model``'s pause (if any) has ended; it may be lengthened meanwhile."""
        left = self._pauses.get(model, 0.0) - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)
            await self._paused(model)


class _ignored:
    """Ignore a pause that does not decode (logged): it came from outside the fleet."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, msgspec.DecodeError | msgspec.ValidationError):
            log.warning("a limits message that does not decode was ignored error=%s", exc)
            return True
        return False
