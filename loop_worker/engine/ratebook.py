"""The arithmetic of ``[llm.limits]``: sliding windows, holds, pauses and fair queues.

A :class:`RateBook` is owned by one process at a time (the fleet's limiter leader,
``loop_worker/limiter_leader.py``, or :class:`~.ratelimit.LocalLimiter` in one
process); it does no I/O and reads one clock. Each configured model has a
:class:`Window` of requests and one of tokens (when it sets ``rpm`` / ``tpm``), and
each tenant with its own ceilings has two more. A request is *asked* with its
estimated tokens; it is granted when every window it counts in has room, and then
counts there from its grant until ``window_s`` after it is *settled* (the reply
arrived; its tokens corrected to the reply's ``usage``). So any span of
``window_s`` sees at most the limit, whenever inside its call the provider counts
it. A request bigger than a whole window goes alone into an empty one.

Waiting requests queue per model, per tenant, and are granted round-robin over the
tenants that wait: a tenant with a hundred waiting requests and one with one take
turns. A tenant held back by its own ceiling is passed over; one held back by the
model's ceiling holds the model's queue until there is room for it (a big request is
not starved by small ones). A pause (a provider's 429 with ``Retry-After``) grants
nothing for the model until it ends.

A grant that is never settled (its worker died) is settled as estimated once its
``hold_s`` has passed. Every call that can grant something returns what it granted.

Why not ``aiolimiter`` or ``pyrate-limiter``: neither takes back what a request did
not use (the correction after the reply), neither holds a request's share while it
runs, neither serves waiters fairly across tenants (aiolimiter's waiters are one FIFO;
pyrate-limiter's in-memory bucket stores a weight of N as N items, a tokens-per-minute
weight being thousands).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .settings import LimitSettings, ModelLimits


class Window:
    """At most ``limit`` units in any ``span`` seconds: what was granted and not yet
    settled (``used``), and settled units until ``span`` after their settling."""

    __slots__ = ("expiring", "limit", "span", "used")

    def __init__(self, limit: int, span: float) -> None:
        self.limit = limit
        self.span = span
        self.used = 0
        self.expiring: deque[tuple[float, int]] = deque()  # (until, units), in time order

    def expire(self, now: float) -> None:
        expiring = self.expiring
        while expiring and expiring[0][0] <= now:
            self.used -= expiring.popleft()[1]

    def fits(self, units: int, now: float) -> bool:
        self.expire(now)
        return self.used == 0 or self.used + units <= self.limit

    def settle(self, granted: int, used: int, now: float) -> None:
        """A grant of ``granted`` units is done, having used ``used``: those count until
        ``span`` from now."""
        self.used += used - granted
        if used > 0:
            self.expiring.append((now + self.span, used))

    def next_free(self) -> float | None:
        return self.expiring[0][0] if self.expiring else None


@dataclass(slots=True, eq=False)
class Ask:
    """One request's place in the book, from asked to settled."""

    ident: str
    model: str
    tenant: str
    tokens: int
    hold_s: float
    asked: float
    granted: float | None = None
    in_requests: tuple[Window, ...] = ()  # where it counts once granted
    in_tokens: tuple[Window, ...] = ()


@dataclass(slots=True)
class _Tenant:
    requests: Window | None
    tokens: Window | None


_UNLIMITED = _Tenant(None, None)


@dataclass(slots=True)
class _Model:
    limits: ModelLimits
    requests: Window | None
    tokens: Window | None
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    queues: dict[str, deque[Ask]] = field(default_factory=dict)  # in rotation order
    paused_until: float = 0.0

    def tenant(self, name: str) -> _Tenant:
        found = self.tenants.get(name)
        if found is None:
            rpm, tpm = self.limits.tenant(name)
            if not (rpm or tpm):
                return _UNLIMITED  # nothing to count: nothing kept per tenant
            span, per = self.limits.window_s, self.limits.per_window
            found = self.tenants[name] = _Tenant(
                Window(per(rpm), span) if rpm else None, Window(per(tpm), span) if tpm else None
            )
        return found


class RateBook:
    """Every configured model's windows and queue (see the module's docstring)."""

    def __init__(
        self, settings: LimitSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._models: dict[str, _Model] = {}
        for name, limits in settings.models.items():
            span, per = limits.window_s, limits.per_window
            self._models[name] = _Model(
                limits,
                Window(per(limits.rpm), span) if limits.rpm else None,
                Window(per(limits.tpm), span) if limits.tpm else None,
            )
        self._asks: dict[str, Ask] = {}  # queued or granted, by ident
        self._holds: list[tuple[float, str]] = []  # (hold deadline, ident) of grants

    def limits(self, model: str) -> bool:
        """Whether ``model`` has limits (requests to others are never held)."""
        return model in self._models

    def state(self, ident: str) -> Ask | None:
        """The ask ``ident`` while it waits or runs (``granted`` says which)."""
        return self._asks.get(ident)

    def waiting(self, model: str | None = None) -> int:
        models = self._models.values() if model is None else [self._models[model]]
        return sum(len(q) for m in models for q in m.queues.values())

    def running(self) -> int:
        return sum(1 for a in self._asks.values() if a.granted is not None)

    # -- what changes the book; each returns the asks it granted ----------------------

    def ask(self, ident: str, model: str, tenant: str, tokens: int, hold_s: float) -> list[Ask]:
        """Queue a request of about ``tokens`` tokens; the asks granted now (this one
        among them when it may go at once). An ``ident`` already in the book is left as
        it is."""
        if ident in self._asks:
            return []
        m = self._models.get(model)
        ask = Ask(ident, model, tenant, max(tokens, 0), hold_s, self.clock())
        if m is None:  # no limits: granted, counted nowhere
            ask.granted = ask.asked
            self._asks[ident] = ask
            heapq.heappush(self._holds, (ask.asked + hold_s, ident))
            return [ask]
        self._asks[ident] = ask
        m.queues.setdefault(tenant, deque()).append(ask)
        return self._grant(m, self.clock())

    def settle(self, ident: str, tokens: int | None = None, *, sent: bool = True) -> list[Ask]:
        """The request ``ident`` is done: it used ``tokens`` (``None``: as estimated), or
        it was never sent (``sent`` false: it counts nowhere; a waiting ask leaves its
        queue). An unknown ``ident`` (settled already, or never asked) changes nothing."""
        ask = self._asks.pop(ident, None)
        if ask is None:
            return []
        now = self.clock()
        m = self._models.get(ask.model)
        if ask.granted is None:
            if m is not None:
                queue = m.queues.get(ask.tenant)
                if queue is not None:
                    queue.remove(ask)
                    if not queue:
                        del m.queues[ask.tenant]
                return self._grant(m, now)  # it may have held the queue
            return []
        used = (ask.tokens if tokens is None else max(tokens, 0)) if sent else 0
        for window in ask.in_requests:
            window.settle(1, 1 if sent else 0, now)
        for window in ask.in_tokens:
            window.settle(ask.tokens, used, now)
        return self._grant(m, now) if m is not None else []

    def pause(self, model: str, until: float) -> list[Ask]:
        """Grant nothing for ``model`` until ``until`` (on the book's clock); a pause
        only ever lengthens."""
        m = self._models.get(model)
        if m is not None:
            m.paused_until = max(m.paused_until, until)
        return []

    def paused_until(self, model: str) -> float:
        m = self._models.get(model)
        return m.paused_until if m is not None else 0.0

    def pump(self) -> list[Ask]:
        """Settle the grants past their hold, then grant what now fits."""
        now = self.clock()
        granted: list[Ask] = []
        while self._holds and self._holds[0][0] <= now:
            _, ident = heapq.heappop(self._holds)
            ask = self._asks.get(ident)
            if ask is not None and ask.granted is not None:
                granted += self.settle(ident)  # a worker that died: as estimated
        for m in self._models.values():
            if m.queues:
                granted += self._grant(m, now)
        return granted

    def next_wake(self) -> float | None:
        """When :meth:`pump` may next grant or settle something, on the book's clock
        (``None``: only a settle or an ask can)."""
        times: list[float] = [self._holds[0][0]] if self._holds else []
        for m in self._models.values():
            if not m.queues:
                continue
            if m.paused_until > self.clock():
                times.append(m.paused_until)
                continue
            windows: list[Window | None] = [m.requests, m.tokens]
            for tenant in m.queues:
                own = m.tenants.get(tenant)
                if own is not None:
                    windows += [own.requests, own.tokens]
            times += [at for w in windows if w is not None and (at := w.next_free()) is not None]
        return min(times) if times else None

    # -- granting -----------------------------------------------------------------------

    def _grant(self, m: _Model, now: float) -> list[Ask]:
        """Grant from ``m``'s queues, a request per tenant in turn, while there is room."""
        granted: list[Ask] = []
        if m.paused_until > now:
            return granted
        progress = True
        while m.queues and progress:
            progress = False
            for tenant in list(m.queues):
                queue = m.queues[tenant]
                ask = queue[0]
                t = m.tenant(tenant)
                if not _fits(t.requests, t.tokens, ask.tokens, now):
                    continue  # its own ceiling: the others go on
                if not _fits(m.requests, m.tokens, ask.tokens, now):
                    return granted  # the model's: it goes first once there is room
                queue.popleft()
                if queue:
                    m.queues[tenant] = m.queues.pop(tenant)  # to the back of the rotation
                else:
                    del m.queues[tenant]
                ask.in_requests = tuple(w for w in (m.requests, t.requests) if w is not None)
                ask.in_tokens = tuple(w for w in (m.tokens, t.tokens) if w is not None)
                for window in ask.in_requests:
                    window.used += 1
                for window in ask.in_tokens:
                    window.used += ask.tokens
                ask.granted = now
                heapq.heappush(self._holds, (now + ask.hold_s, ask.ident))
                granted.append(ask)
                progress = True
        return granted

    # -- a leader's hand-over ------------------------------------------------------------

    def dump(self) -> list[tuple[str, str, str, list[tuple[float, int]]]]:
        """Every window's units as (model, tenant or "", "requests" or "tokens", [(seconds
        until they expire, units)]), in whole seconds rounded up; what runs now counts
        as settled now. For a new leader (:meth:`load`)."""
        now = self.clock()
        out: list[tuple[str, str, str, list[tuple[float, int]]]] = []
        for name, m in self._models.items():
            pairs: list[tuple[str, _Tenant]] = [("", _Tenant(m.requests, m.tokens))]
            for tenant_name, t in m.tenants.items():
                pairs.append((tenant_name, t))
            for tenant_name, t in pairs:
                for kind, w in (("requests", t.requests), ("tokens", t.tokens)):
                    if w is None:
                        continue
                    w.expire(now)
                    bins: dict[float, int] = {}
                    settled = 0
                    for until, units in w.expiring:
                        left = float(math.ceil(until - now))
                        bins[left] = bins.get(left, 0) + units
                        settled += units
                    if w.used > settled:
                        span = float(math.ceil(w.span))
                        bins[span] = bins.get(span, 0) + w.used - settled
                    if bins:
                        out.append((name, tenant_name, kind, sorted(bins.items())))
        return out

    def load(self, windows: Iterable[tuple[str, str, str, list[tuple[float, int]]]]) -> None:
        """Count what a former leader :meth:`dump`-ed (windows of models or tenants this
        book has no limits for are left out)."""
        now = self.clock()
        for model, tenant, kind, bins in windows:
            m = self._models.get(model)
            if m is None:
                continue
            owner = _Tenant(m.requests, m.tokens) if not tenant else m.tenant(tenant)
            w = owner.requests if kind == "requests" else owner.tokens
            if w is None:
                continue
            for seconds, units in sorted(bins):
                if seconds > 0 and units > 0:
                    w.used += units
                    w.expiring.append((now + seconds, units))


def _fits(requests: Window | None, tokens: Window | None, units: int, now: float) -> bool:
    return (requests is None or requests.fits(1, now)) and (
        tokens is None or tokens.fits(units, now)
    )
