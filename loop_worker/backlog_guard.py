"""``[tenants] max_backlog`` for turns published straight to NATS.

The gateway refuses a turn past the limit before it publishes it (429 ``backlog_full``).
A turn published on NATS is in the turns stream before loopmesh sees it, so the loop
workers judge it when they hear it published (the doorbell, :mod:`.share`): when the
tenant's turns waiting, this one counted, are more than its limit, the turn is refused.

- **The publisher learns at once.** The turn's session gets an ``error`` event, code
  ``backlog_full``, and a ``loop_end`` (reason ``error``), as for any refused turn
  (:mod:`.refusals`), while the turn still waits in the stream.
- **It never runs.** The worker that pulls it later records it in the dead-letter stream
  (to publish again once there is room) and acks it.
- **Exactly one of refusing and running wins.** Both take the turn's admission key in
  the control bucket (``<tenant>.<session>.admit.<turn>``) by creating it, ``refused``
  or ``running``; whoever comes second reads what the first wrote. A turn a worker
  already runs is never refused, and a refused one never runs.
- **What is counted.** Each lane's consumer's ``num_pending`` (what the gateway reads),
  read at most every :data:`READ_EVERY_S` per tenant, plus the turns heard since. A
  worker reads only once its own count of the tenant's waiting turns, which errs high,
  is past the limit. Turns published at the same moment are counted as they arrive, so
  the limit holds within the turns in flight, as at the gateway.
- **A tenant with no ``max_backlog``** costs nothing: no read, no key. A tenant with one
  costs one key write per turn it runs (kept as long as the bucket keeps a control).
- Workers all down while the turn was published: nobody judged it, and it runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter as Tally
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError
from prometheus_client import Counter

from loopmesh.backlog import turns_waiting
from loopmesh.jetstream import KV, Publisher, open_kv, retry
from loopmesh.settings import TenantSettings
from schemas import Subjects, Turn
from schemas.admit import Refused, admit_turn
from schemas.keys import turn_admit_key

from .refusals import report

log = logging.getLogger("loopmesh.loop_worker.backlog")

#: How long a tenant's backlog read is counted on, with the turns heard since.
READ_EVERY_S = 0.1
REFUSED, RUNNING = b"refused", b"running"
#: The dead-letter reason of a refused turn.
BACKLOG_FULL = "backlog_full: refused when published, its tenant past [tenants] max_backlog"

BACKLOG_REFUSED = Counter(
    "loopmesh_loop_backlog_refused",
    "Turns published on NATS refused because their tenant was past [tenants] max_backlog",
    ["tenant"],
)


class BacklogGuard:
    """Judges the turns the doorbell hears (:meth:`heard`); says at delivery whether a
    turn runs (:meth:`admit`)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        publisher: Publisher,
        limits: Callable[[str], TenantSettings],
        counted: Callable[[str], int],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.publisher = publisher
        self.limits = limits
        self.counted = counted  # this worker's count of the tenant's turns waiting
        self._kv: KV | None = None
        self._read: dict[str, tuple[float, int]] = {}  # tenant -> (when, waiting)
        self._since: Tally[str] = Tally()  # turns heard since the tenant's last read
        self._locks: dict[str, asyncio.Lock] = {}
        self._judging: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        js = self.nc.jetstream()
        self._kv = await open_kv(js, self.publisher, self.subjects.control_bucket)

    async def close(self) -> None:
        for task in list(self._judging):
            task.cancel()

    @property
    def kv(self) -> KV:
        if self._kv is None:
            raise RuntimeError("BacklogGuard not started")
        return self._kv

    # -- at publish ---------------------------------------------------------------------

    def heard(self, tenant: str, msg: Msg) -> None:
        """A turn of ``tenant`` was published: judge it if the tenant may be past its
        limit."""
        limit = self.limits(tenant).max_backlog
        if not limit:
            return
        self._since[tenant] += 1
        if self.counted(tenant) <= limit:
            return
        task = asyncio.create_task(self._judge(tenant, msg, limit))
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    async def _judge(self, tenant: str, msg: Msg, limit: int) -> None:
        msg_id = msg.headers.get("Nats-Msg-Id") if msg.headers else None
        try:
            turn = admit_turn(
                self.subjects, self.subjects.stored_turn(msg.subject), msg.data, msg_id
            )
        except Refused:
            return  # refused at delivery, whatever its backlog
        try:
            waiting = await self._waiting(tenant)
            if waiting <= limit or not await self._take(turn, REFUSED):
                return
            BACKLOG_REFUSED.labels(tenant).inc()
            message = (
                f"tenant {tenant} has {waiting - 1} turns waiting, its limit ([tenants] "
                f"max_backlog = {limit}); publish it again once some have run"
            )
            refused = Refused(
                "backlog_full", message, tenant=tenant, session=turn.session, turn_id=turn.id
            )
            await report(self.publisher, self.subjects, refused, what="turn", ref="backlog")
        except Exception as exc:  # not judged: it runs
            log.warning("turn not judged against its backlog turn=%s error=%r", turn.id, exc)

    async def _waiting(self, tenant: str) -> int:
        """The tenant's turns waiting, this one among them."""
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            at, waiting = self._read.get(tenant, (0.0, 0))
            if time.monotonic() - at < READ_EVERY_S:
                return waiting + self._since[tenant]
            self._since[tenant] = 0  # those heard from now on may not be in the read
            waiting = await turns_waiting(self.nc.jetstream(), self.subjects, tenant)
            self._read[tenant] = (time.monotonic(), waiting)
            return waiting + self._since[tenant]

    # -- at delivery --------------------------------------------------------------------

    async def admit(self, turn: Turn) -> bool:
        """Whether ``turn`` runs: False when it was refused at publish."""
        if not self.limits(turn.tenant).max_backlog:
            return True
        return await self._take(turn, RUNNING)

    async def forget(self, turn: Turn) -> None:
        """Drop a refused turn's key once it is dead-lettered and acked: published
        again, it is judged again."""
        key = turn_admit_key(turn.tenant, turn.session, turn.id)
        try:
            entry = await self.kv.entry(key)
            if entry is not None and entry.value == REFUSED:
                await self.kv.delete(key, last=entry.revision)
        except Exception as exc:  # kept: published again, the turn is refused again
            log.info("refused turn's key kept key=%s error=%r", key, exc)

    async def _take(self, turn: Turn, outcome: bytes) -> bool:
        """Create the turn's admission key with ``outcome``; True if it holds that
        (created now, or by an earlier try of ours whose answer was lost)."""
        key = turn_admit_key(turn.tenant, turn.session, turn.id)
        last = 0  # no key; or a deleted one's marker: the turn published again
        while True:
            try:
                write = functools.partial(self.kv.update, key, outcome, last)
                await retry(write, f"admit {key}")
                return True
            except KeyWrongLastSequenceError:
                entry = await retry(lambda: self.kv.entry(key), f"read {key}")
                if entry is not None and entry.value is not None:
                    return entry.value == outcome
                last = entry.revision if entry is not None else 0
