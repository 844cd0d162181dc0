"""Control messages (cancel, pause, resume, approvals) for the turns a worker runs.

Controls arrive on ``<prefix>.control.<tenant>.<session>`` over core NATS, for speed.
Every loop worker subscribes to all of them and routes each to the
:class:`~loop_worker.engine.control.TurnControl` of the session's running turn. Because a
core message reaches only the workers connected at that moment, controls are also
recorded in the control KV bucket by exactly one worker (a queue group), so a turn
that starts or is redelivered later still sees them:

- ``<tenant>.<session>`` holds the last cancel, pause or resume naming no turn;
- ``<tenant>.<session>.turn.<turn_id>`` holds the last one naming that turn (an
  interrupt from a later turn's ``on_busy`` does), so that it replaces neither another
  turn's nor a session-wide one;
- ``<tenant>.<session>.approval.<call_id>`` holds an approval decision.

A sender that records the control itself (:func:`send_control`) marks the message with
the ``Loopmesh-Recorded`` header, and the workers leave the record alone.

The subject is authoritative (:func:`schemas.admit.admit_control`): a control whose body
names another tenant or session than its subject, that does not decode, or whose
schema version is newer than ours is neither routed nor recorded, and the worker of
the queue group that would have recorded it publishes an ``error`` event on the
subject's session saying why (:mod:`.refusals`).

A recorded cancel or pause applies to a turn it names, or, naming no turn, to turns
created before it was sent (``at``). A turn that starts reads both of its keys and
applies what applies, the older first (a cancel is final; a later pause or resume wins
over an earlier one). When a turn ends, a session-wide cancel or pause that applied to
it is cleared, so it does not reach the session's next turn (a turn that saw no cancel
or pause, recorded or live, has none to clear: its end reads nothing); a turn's own
record stays until the bucket's TTL, so a later delivery of the turn still sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from loopmesh.aio import both, quietly
from loopmesh.controls import record, send_control
from loopmesh.jetstream import KV, Publisher, open_kv, retry
from schemas import (
    ApprovalDecision,
    Cancel,
    Control,
    DecodeError,
    Pause,
    Resume,
    Subjects,
    Turn,
    decode,
    new_id,
    session_key,
)
from schemas.admit import Refused, admit_control
from schemas.keys import CONTROL_RECORDED_HEADER, approval_key, turn_control_key

from . import refusals
from .engine.control import TurnControl

log = logging.getLogger("loopmesh.loop_worker.controls")

RECORDED_HEADER = CONTROL_RECORDED_HEADER
RECORDER_QUEUE = "loop-workers-control"


class RecordedTurnControl(TurnControl):
    """A :class:`TurnControl` that also finds approval decisions recorded in KV (read
    from the bucket's leader on a cluster: a follower may not have the decision yet)."""

    def __init__(self, turn: Turn, reads: KV) -> None:
        super().__init__()
        self.turn = turn
        self._reads = reads
        self.stopped = False  # a cancel or pause reached it (recorded or live)

    async def wait_decision(self, call_id: str, timeout: float) -> ApprovalDecision | None:
        if call_id not in self._decisions:
            key = approval_key(self.turn.tenant, self.turn.session, call_id)
            entry = await retry(lambda: self._reads.entry(key), f"get {key}", timeout=timeout)
            if entry is not None and entry.value is not None:
                try:
                    await self.decide(decode(entry.value or b"", ApprovalDecision))
                except DecodeError as exc:
                    log.warning("bad recorded approval key=%s error=%s", key, exc)
        return await super().wait_decision(call_id, timeout)


class Controls:
    """Routes control messages to running turns and records them in KV."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        record: bool = True,
        publisher: Publisher | None = None,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._record = record
        self._publisher = publisher or Publisher(nc)
        self._kv: KeyValue | None = None
        self._reads: KV | None = None
        self._subs: list[Subscription] = []
        self._running: dict[str, RecordedTurnControl] = {}  # session key → running turn
        #: Called with each control message routed to a running turn (for metrics/tests).
        self.on_routed: Callable[[Control], None] | None = None

    async def start(self) -> None:
        if self._subs:
            return
        js = self._nc.jetstream()
        self._kv = await retry(
            lambda: js.key_value(self._subjects.control_bucket), "open control bucket"
        )
        self._reads = await open_kv(js, self._publisher, self._subjects.control_bucket)
        subject = self._subjects.all_control
        self._subs.append(await self._nc.subscribe(subject, cb=self._route))
        self._subs.append(await self._nc.subscribe(subject, queue=RECORDER_QUEUE, cb=self._store))

    async def close(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await quietly(sub.unsubscribe())

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("Controls not started")
        return self._kv

    async def open(self, turn: Turn) -> RecordedTurnControl:
        """Register ``turn`` as running and apply what was recorded for it."""
        assert self._reads is not None, "Controls not started"
        reads = self._reads
        control = RecordedTurnControl(turn, reads)
        key = session_key(turn.tenant, turn.session)
        self._running[key] = control  # live messages from now on
        found = await both(
            _recorded(reads, key, turn),
            _recorded(reads, turn_control_key(turn.tenant, turn.session, turn.id), turn),
        )
        for recorded in sorted((c for c in found if c is not None), key=lambda c: c.at):
            await _apply(control, recorded)
        return control

    async def close_turn(self, turn: Turn, control: TurnControl) -> None:
        """Unregister ``turn``; clear a recorded cancel or pause that applied to it."""
        key = session_key(turn.tenant, turn.session)
        if self._running.get(key) is control:
            del self._running[key]
        if isinstance(control, RecordedTurnControl) and not control.stopped:
            return
        assert self._reads is not None, "Controls not started"
        try:
            entry = await self._reads.entry(key)
            if entry is None or entry.value is None:
                return
            recorded = decode(entry.value, Control)
        except DecodeError:
            return
        except Exception as exc:
            log.info("control record not checked key=%s error=%r", key, exc)
            return
        if isinstance(recorded, Cancel | Pause) and _applies(recorded, turn):
            try:
                await self.kv.delete(key, last=entry.revision)
            except Exception as exc:  # a newer control arrived; keep it
                log.debug("control record kept key=%s error=%r", key, exc)

    async def send(self, control: Control) -> None:
        """Record ``control`` and publish it to its session (as :func:`send_control`)."""
        await send_control(self._nc, self._subjects, control, kv=self.kv, flush=False)

    def running(self, tenant: str, session: str) -> RecordedTurnControl | None:
        return self._running.get(session_key(tenant, session))

    # -- subscriptions ----------------------------------------------------------------

    async def _route(self, msg: Msg) -> None:
        try:
            control = admit_control(self._subjects, msg.subject, msg.data)
        except Refused:
            return  # the recorder's queue group reports it, once
        running = self._running.get(session_key(control.tenant, control.session))
        if running is None or not _applies(control, running.turn):
            return
        await _apply(running, control)
        if self.on_routed is not None:
            self.on_routed(control)

    async def _store(self, msg: Msg) -> None:
        """One worker of the queue group: report a refused control, or record it."""
        try:
            control = admit_control(self._subjects, msg.subject, msg.data)
        except Refused as refused:
            try:
                await refusals.report(
                    self._publisher, self._subjects, refused, what="control", ref=new_id()
                )
            except Exception as exc:
                log.warning("refused control not reported error=%r", exc)
            return
        if not self._record or (msg.headers and msg.headers.get(RECORDED_HEADER)):
            return
        try:
            await record(self.kv, control)
        except Exception as exc:
            log.warning("control not recorded control=%r error=%r", control, exc)


async def _recorded(reads: KV, key: str, turn: Turn) -> Control | None:
    """The control recorded under ``key``, if it applies to ``turn``."""
    entry = await retry(lambda: reads.entry(key), f"get {key}")
    if entry is None or entry.value is None:
        return None
    try:
        recorded = decode(entry.value, Control)
    except DecodeError as exc:
        log.warning("bad recorded control key=%s error=%s", key, exc)
        return None
    if (recorded.tenant, recorded.session) != (turn.tenant, turn.session):
        log.warning("recorded control names another session key=%s", key)
        return None
    return recorded if _applies(recorded, turn) else None


def _applies(control: Control, turn: Turn) -> bool:
    if control.turn_id is not None:
        return control.turn_id == turn.id
    return not turn.created_at or not control.at or control.at >= turn.created_at


async def _apply(target: TurnControl, control: Control) -> None:
    if isinstance(control, Cancel | Pause) and isinstance(target, RecordedTurnControl):
        target.stopped = True
    match control:
        case Cancel(mode="cancel", reason=reason):
            target.cancel(reason or "cancelled")
        case Cancel(mode=mode, by_turn=by):
            target.interrupt(by or "", rollback=mode == "rollback")
        case Pause():
            target.pause()
        case Resume():
            target.resume()
        case ApprovalDecision():
            await target.decide(control)
