"""This worker's pulls of turns: raw ``CONSUMER.MSG.NEXT`` requests to a tenant's lane
consumer, ``batch`` places at a time, all answered on one inbox.

A delivered turn answers its lane's oldest pull (the server fills a consumer's pulls in
the order they came) and is handed to the worker with its tenant; a status ends the pull
and tells what the lane's counts learn from it (nothing waiting, no consumer, the
consumer at its fleet-wide cap). A pull the server never answers is given up once it
should long have expired. Which lane asks for how many is :mod:`loop_worker.share`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from loopmesh.settings import TenantSettings
from schemas import Subjects

from .config import ServiceSettings
from .lanes import Lane

log = logging.getLogger("loopmesh.loop_worker.share")

Deliver = Callable[[Msg, str], None]
_LOST_S = 1.0  # a pull unanswered this long after it expired is given up


@dataclass(eq=False)
class _Pull:
    lane: Lane
    left: int
    rung_at_send: int
    got: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Pulls:
    """The pulls in flight for one worker's lanes. ``lanes``: each lane by its consumer's
    name (its owner's, read here); ``changed`` is set whenever a pull ends."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: ServiceSettings,
        *,
        lanes: Mapping[str, Lane],
        limits: Callable[[str], TenantSettings],
        recount: Callable[[Lane], None],
        deliver: Deliver,
        changed: asyncio.Event,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.settings = settings
        self._lanes = lanes
        self._limits = limits
        self._recount = recount  # a lane whose count may be wrong: read its consumer
        self._deliver = deliver
        self._changed = changed
        self._pulls: dict[str, _Pull] = {}
        self._ids = itertools.count()
        self._inbox = ""

    async def listen(self) -> Subscription:
        """Subscribe to the pulls' answers; the caller unsubscribes."""
        self._inbox = self.nc.new_inbox()
        return await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)

    async def answered(self) -> None:
        """Wait for the pulls in flight to be answered (a pull expires by itself within
        ``fetch_timeout_s``)."""
        pending = [p.done.wait() for p in self._pulls.values()]
        if pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.fetch_timeout_s + 1.0):
                    await asyncio.gather(*pending)

    async def ask(self, lane: Lane, batch: int) -> None:
        pull_id = str(next(self._ids))
        self._pulls[pull_id] = _Pull(lane, batch, lane.rung)
        lane.pulls.append(pull_id)
        lane.asked += batch
        expires = int(self.settings.fetch_timeout_s * 1e9)
        body = json.dumps({"batch": batch, "expires": expires}).encode()
        consumer = self.subjects.tenant_consumer(lane.tenant.name, lane.priority)
        stream = self.subjects.turns_stream_of(lane.tenant.name)
        api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        try:
            await self.nc.publish(api, body, reply=f"{self._inbox}.{pull_id}")
        except Exception as exc:
            log.warning("pull for tenant %s not sent error=%r", lane.tenant.name, exc)
            self._end(pull_id)
            return
        # A pull the server never answers (sent while the consumer was being placed on a
        # cluster, or lost in a reconnect) would hold its places for ever: given up
        # once it should long have expired.
        lost_s = self.settings.fetch_timeout_s + _LOST_S
        asyncio.get_running_loop().call_later(lost_s, self._end, pull_id)

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
        lane = pull.lane
        if status in ("404", "408"):  # nothing (more) to take before the pull expired
            if not pull.got and self._limits(lane.tenant.name).max_active_turns:
                # a capped tenant's pull may expire with turns waiting (its consumer at
                # its cap): its consumer tells
                self._recount(lane)
            elif not pull.got:
                lane.waiting = lane.rung - pull.rung_at_send  # those rung since may be coming
        elif status == "503":  # no such consumer (an idle one is removed): make it again
            lane.consumer = False
        else:  # 409: the consumer is at its fleet-wide cap (max_ack_pending), or changed
            reason = (msg.headers or {}).get("Description", "")
            name = lane.tenant.name
            log.debug("pull for tenant %s ended status=%s %s", name, status, reason)
            loop, pause = asyncio.get_running_loop(), self.settings.fetch_timeout_s
            lane.snooze_until = loop.time() + pause  # ask again after a pause, not at once
            loop.call_later(pause, self._changed.set)
        self._end(pull_id)

    async def _on_turn(self, msg: Msg) -> None:
        """A turn delivered: it answers its tenant's oldest pull (the server fills a
        consumer's pulls in the order they came)."""
        try:
            lane = self._lanes[msg.metadata.consumer]
            pull_id = lane.pulls[0]
        except (KeyError, IndexError, ValueError):  # no pull of ours asks for it now
            with contextlib.suppress(Exception):
                await msg.nak()
            return
        pull = self._pulls[pull_id]
        pull.left -= 1
        pull.got += 1
        lane.asked -= 1
        lane.held += 1
        lane.waiting = max(lane.waiting - 1, msg.metadata.num_pending)
        if pull.left <= 0:
            self._end(pull_id, answered=True)
        self._deliver(msg, lane.tenant.name)

    def _end(self, pull_id: str, *, answered: bool = False) -> None:
        pull = self._pulls.pop(pull_id, None)
        if pull is None:
            return
        pull.lane.pulls.remove(pull_id)
        if not answered:
            pull.lane.asked -= pull.left
        pull.done.set()
        self._changed.set()
