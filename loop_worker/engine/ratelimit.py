"""What an LLM request asks of a rate limiter (``[llm.limits]``), and one for one process.

``OpenAILLM`` (``llm.py``) takes a :class:`RateLimiter`. Before each attempt (a retry
or a fallback model is an attempt of its own) it *acquires* a :class:`Permit` for the
model, the turn's tenant and the request's estimated tokens: the prompt's, as the loop
counted them (:data:`PROMPT_TOKENS`, else about a token per four characters), plus the
reply's ceiling (``[llm] max_tokens``, else ``[llm.limits] reply_tokens``). The wait is
an ordinary await: cancelling the turn stops it. After the attempt it *settles* the
permit with the tokens the reply's ``usage`` says it used (as estimated when the
server sent none, or the attempt failed). A 429 with ``Retry-After`` *pauses* the
model: every acquire for it waits until the pause ends, in every worker that shares
the limiter.

The tenant and the prompt's count reach ``OpenAILLM`` through context variables that
the engine sets (:data:`TURN_TENANT` for the turn's task, :data:`PROMPT_TOKENS` around
a call), as the agent's fallback models do (``agents.TURN_FALLBACKS``): the LLM
wrappers between the loop and ``OpenAILLM`` pass a call on unchanged.

The durable service shares one limiter across the fleet through NATS
(``loop_worker/limiter.py``); :class:`LocalLimiter` is the same arithmetic
(:class:`~.ratebook.RateBook`) for the engine alone in one process.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextvars import ContextVar
from typing import Protocol

from .ratebook import Ask, RateBook
from .settings import LimitSettings

#: The running turn's tenant (the engine sets it for the turn's task).
TURN_TENANT: ContextVar[str] = ContextVar("loopmesh_tenant", default="")
#: The prompt's tokens as the loop counted them, around the call that sends it.
PROMPT_TOKENS: ContextVar[int | None] = ContextVar("loopmesh_prompt_tokens", default=None)


class Permit(Protocol):
    async def settle(self, tokens: int | None = None, *, sent: bool = True) -> None:
        """The request is done: it used ``tokens`` (``None``: as estimated), or it was
        never sent (``sent`` false). Idempotent."""
        ...


class RateLimiter(Protocol):
    async def acquire(self, model: str, tenant: str, tokens: int) -> Permit:
        """Wait until a request of about ``tokens`` tokens to ``model`` for ``tenant``
        may go. Cancelling the awaiting task stops the wait and gives the place up."""
        ...

    async def pause(self, model: str, seconds: float) -> None:
        """The provider answered 429 with ``Retry-After``: no request to ``model`` for
        ``seconds`` (at most ``[llm.limits] max_pause_s``)."""
        ...


class _LocalPermit:
    __slots__ = ("_ident", "_limiter", "_settled")

    def __init__(self, limiter: LocalLimiter, ident: str) -> None:
        self._limiter = limiter
        self._ident = ident
        self._settled = False

    async def settle(self, tokens: int | None = None, *, sent: bool = True) -> None:
        if not self._settled:
            self._settled = True
            self._limiter._granted(self._limiter.book.settle(self._ident, tokens, sent=sent))


class LocalLimiter:
    """A :class:`RateLimiter` for the engine in one process (no NATS): a
    :class:`~.ratebook.RateBook`, woken by one timer when something may free up."""

    def __init__(self, settings: LimitSettings, *, hold_s: float = 600.0) -> None:
        self.settings = settings
        self.book = RateBook(settings)
        self.hold_s = hold_s
        self._ids = itertools.count(1)
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    async def acquire(self, model: str, tenant: str, tokens: int) -> Permit:
        ident = str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._waiters[ident] = future
        self._granted(self.book.ask(ident, model, tenant, tokens, self.hold_s))
        try:
            await future
        except BaseException:
            self._waiters.pop(ident, None)
            self._granted(self.book.settle(ident, sent=False))
            raise
        return _LocalPermit(self, ident)

    async def pause(self, model: str, seconds: float) -> None:
        seconds = min(seconds, self.settings.max_pause_s)
        self.book.pause(model, self.book.clock() + seconds)
        self._granted([])

    def _granted(self, asks: list[Ask]) -> None:
        for ask in asks:
            future = self._waiters.pop(ask.ident, None)
            if future is not None and not future.done():
                future.set_result(None)
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        wake = self.book.next_wake()
        if wake is not None:
            loop = asyncio.get_running_loop()
            delay = max(wake - self.book.clock(), 0.0)
            self._timer = loop.call_at(loop.time() + delay, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._granted(self.book.pump())


def estimate_tokens(chars: int) -> int:
    """About a token per four characters (a prompt the loop did not count)."""
    return chars // 4 + 1


def wall_to_monotonic(until: float) -> float:
    """A moment given as Unix time (a pause's end, shared between machines), on the
    monotonic clock."""
    return time.monotonic() + (until - time.time())
