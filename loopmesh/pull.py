"""A durable pull consumer's deliveries, handed over the moment they arrive.

nats-py's ``PullSubscription.fetch(batch, timeout)`` returns once its batch is full or
its timeout has passed. When the server answers its first (``no_wait``) request with a
status — it answers 408 "Requests Pending" when other clients' pull requests wait for
more messages than are pending, which several workers on one consumer make common — it
asks again with a lingering request, and once that delivers a message it waits for
the rest of the batch until the timeout. What it was given meanwhile waits with it: a
turn delivered so would wait for the loop worker's fetch timeout before it ran.

:class:`Pull` keeps pull requests outstanding on the server for the room its owner
asks for, and :meth:`Pull.fetch` returns what was delivered as soon as there is any::

    async with Pull(nc, stream, consumer, expires_s=1.0) as pull:
        while serving:
            for msg in await pull.fetch(room, timeout=1.0):
                ...  # what it was given and did not take is nakked on close

It never has more outstanding (requested, and delivered but not taken) than the
``batch`` of the last call asked for, so an owner that asks for its free room is never
given more than it can hold. A request lasts ``expires_s`` on the server, which then
ends it (408); one the server lost (a reconnect) is given up ``expires_s`` after it
should have ended.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from types import TracebackType

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .aio import quietly

log = logging.getLogger("loopmesh.pull")

_STATUS = "Status"


class _Request:
    """A pull request on the server: how many messages it may still deliver, and when
    it is given up if the server never says it ended."""

    __slots__ = ("give_up", "left")

    def __init__(self, left: int, give_up: float) -> None:
        self.left = left
        self.give_up = give_up


class Pull:
    """Deliveries of the durable consumer ``consumer`` of ``stream`` on ``nc``, for one
    caller of :meth:`fetch` at a time."""

    def __init__(self, nc: Client, stream: str, consumer: str, *, expires_s: float) -> None:
        self._nc = nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._expires_s = expires_s
        self._sub: Subscription | None = None
        self._delivered: collections.deque[Msg] = collections.deque()
        self._requests: collections.deque[_Request] = collections.deque()  # oldest first
        self._changed = asyncio.Event()
        self._closed = False
        #: Pull requests sent, and the requests the server ended (expired or refused).
        self.stats = {"requests": 0, "ended": 0}

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)

    async def close(self) -> None:
        """Stop listening (the server drops requests nobody listens to) and nak what was
        delivered and not taken, so that another worker gets it now. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            await quietly(self._sub.unsubscribe())
        while self._delivered:
            await quietly(self._delivered.popleft().nak())

    async def __aenter__(self) -> Pull:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def outstanding(self) -> int:
        """Messages the server may still deliver to this pull's live requests."""
        now = time.monotonic()
        while self._requests and self._requests[0].give_up <= now:
            self._requests.popleft()  # lost by the server: it never said it ended
        return sum(r.left for r in self._requests)

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to ``batch`` deliveries, as soon as there is one; none after ``timeout``
        seconds without any. Pulls for ``batch`` less what is outstanding, again
        whenever a request ends."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        deadline = time.monotonic() + timeout
        while not self._delivered:
            self._changed.clear()  # first: a delivery while asking must wake the wait
            await self._ask(batch)
            now = time.monotonic()
            if self._delivered:
                break
            if now >= deadline or self._closed:
                return []
            wake = min(deadline, self._requests[0].give_up) if self._requests else deadline
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake - now)):
                    await self._changed.wait()
        return [self._delivered.popleft() for _ in range(min(batch, len(self._delivered)))]

    async def _ask(self, batch: int) -> None:
        """Top the outstanding requests up to ``batch``: at once when none is left,
        else once half a batch is missing (a request per delivery would fill the
        consumer's waiting list)."""
        outstanding = self.outstanding
        want = batch - outstanding - len(self._delivered)
        if want < 1 or (outstanding and want * 2 < batch):
            return
        expires = int(self._expires_s * 1e9)
        give_up = time.monotonic() + 2 * self._expires_s
        await self._nc.publish(
            self._next, b'{"batch":%d,"expires":%d}' % (want, expires), reply=self._inbox
        )  # a request that did not go out is not counted
        self._requests.append(_Request(want, give_up))
        self.stats["requests"] += 1

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(_STATUS) if msg.headers else None
        if status is None:
            if self._requests:
                oldest = self._requests[0]
                oldest.left -= 1
                if oldest.left <= 0:  # delivered in full: the server ends it silently
                    self._requests.popleft()
            if self._closed:
                await quietly(msg.nak())
            else:
                self._delivered.append(msg)
        elif status == "100":  # an idle heartbeat
            return
        else:
            self.stats["ended"] += 1
            if status == "408" and self._requests:  # the oldest expired
                self._requests.popleft()
            else:  # refused or dropped (a leader change, say): which is unknown
                if status != "404":
                    description = msg.headers.get("Description", "") if msg.headers else ""
                    log.warning("pull request ended: %s %s", status, description)
                self._requests.clear()
        self._changed.set()
