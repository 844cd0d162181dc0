"""What a partition run records as it happens, and the checks made over it.

:class:`Observer` (one connection of the test, on the host's side of every cut) keeps:

- which turns each loop worker runs (its ``loop_start`` seen, no ``loop_end`` yet), so
  that a worker is cut in the middle of one;
- every session snapshot stored, in order (a KV watch of the sessions bucket: it keeps
  one revision per key, so its history is gone by the end of the run);
- the rate-limit leader key's every revision (who led, renewed when), every answer sent
  to an ask on ``limits.ask``, and every settle on ``limits.settle`` (plain NATS
  messages, which any connection hears), each on one connection per node, pinned to its
  node, so that what a node cut from the others sends is heard too. A settle repeats the
  grant it used: its leader, term and time.

:func:`zombies` and :func:`two_leaders` judge them. The leader check judges the grants
that were used, not the answers on the wire: during a handover both leaders hear every
ask, and a grant the workers refused (a lower term than one they had seen) never let a
request go.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from loopmesh.testing.durable import SUBJECTS, connect_fast, kv_read
from schemas import DecodeError, SessionSnapshot, decode
from schemas.events import Event, decode_event
from schemas.limits import LeaderRecord, LimitAnswer, LimitAsk, LimitSettle

from .checker import Accepted


@dataclass(frozen=True)
class Cut:
    """A cut the nemesis made: what, whom (a worker's or node's name), from when to
    when (wall clock), the turns the cut loop worker was running, the calls (ledger
    labels) the cut tool worker was running."""

    kind: str
    target: str
    start: float
    end: float
    turns: tuple[tuple[str, str], ...] = ()
    calls: tuple[str, ...] = ()

    def __str__(self) -> str:
        running = f", running {['/'.join(t) for t in self.turns]}" if self.turns else ""
        if self.calls:
            running += f", in calls {list(self.calls)}"
        return f"{self.kind} {self.target} for {self.end - self.start:.2f}s{running}"


@dataclass(frozen=True)
class Answer:
    """An answer to an ask: its reply subject, the ask's id, granted or not."""

    reply: str
    ask: str
    granted: bool
    at: float


@dataclass
class Observer:
    nc: Client
    tenant: str
    node_urls: Sequence[str] = ()  # a connection each hears the limiter's asks and answers
    snapshots: list[tuple[str, SessionSnapshot | None]] = field(default_factory=list)
    leader_revisions: list[tuple[int, str, float]] = field(default_factory=list)
    running_by: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    settles: dict[str, LimitSettle] = field(default_factory=dict)  # by request id
    _asks: dict[str, str] = field(default_factory=dict)  # reply subject -> ask id
    #: per node connection: reply subject -> arrivals (time, payload)
    _replies: list[dict[str, list[tuple[float, bytes]]]] = field(default_factory=list)
    _pinned: list[Client] = field(default_factory=list)
    _subs: list[Subscription] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        nc, js = self.nc, self.nc.jetstream()
        prefix = SUBJECTS.prefix
        self._subs = [await nc.subscribe(f"{prefix}.events.{self.tenant}.>", cb=self._on_event)]
        for url in self.node_urls or [""]:
            pinned = await connect_fast(url, name="chaos observer") if url else nc
            if url:
                self._pinned.append(pinned)
            heard: dict[str, list[tuple[float, bytes]]] = defaultdict(list)
            self._replies.append(heard)
            self._subs += [
                await pinned.subscribe(SUBJECTS.limits_ask, cb=self._on_ask),
                await pinned.subscribe(SUBJECTS.limits_settle, cb=self._on_settle),
                await pinned.subscribe("_INBOX.>", cb=partial(self._on_reply, heard)),
            ]
        sessions = await js.key_value(SUBJECTS.sessions_bucket)
        limits = await js.key_value(SUBJECTS.limits_bucket)
        self._tasks = [
            asyncio.create_task(self._watch(await sessions.watchall(), self._on_snapshot)),
            asyncio.create_task(self._watch(await limits.watch("leader"), self._on_leader)),
        ]

    async def close(self) -> None:
        """Stop listening (idempotent)."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for pinned in self._pinned:
            await pinned.close()
        self._pinned = []

    @property
    def answers(self) -> list[Answer]:
        """Every answer to an ask: as many as the connection that heard the most heard,
        the n-th at its earliest n-th arrival."""
        out = []
        for reply in {r for heard in self._replies for r in heard}:
            ask = self._asks.get(reply)
            if ask is None:
                continue
            heard = [h[reply] for h in self._replies if reply in h]
            for n in range(max(len(h) for h in heard)):
                at, data = min(h[n] for h in heard if len(h) > n)
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    out.append(Answer(reply, ask, decode(data, LimitAnswer).granted, at))
        return out

    async def running(self, worker: str, *, timeout: float) -> tuple[tuple[str, str], ...]:
        """The turns ``worker`` runs, once it runs one (none after ``timeout``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not self.running_by.get(worker):
                    self._changed.clear()
                    await self._changed.wait()
        return tuple(sorted(self.running_by.get(worker, ())))

    async def leader(self) -> str:
        """The owner of the rate-limit leader key now ("" if none)."""
        data = await kv_read(self.nc, SUBJECTS.limits_bucket, "leader")
        return decode(data, LeaderRecord).owner if data else ""

    def terms(self) -> str:
        """The leader key's history as terms: owner, and its first and last revision."""
        terms: list[list[object]] = []
        for revision, owner, _ in self.leader_revisions:
            if terms and terms[-1][0] == owner:
                terms[-1][2] = revision
            else:
                terms.append([owner, revision, revision])
        return ", ".join(f"{o or '(free)'} r{a}-r{b}" for o, a, b in terms)

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except DecodeError:
            return
        turn = (event.session, event.turn_id)
        if event.type == "loop_start":
            for turns in self.running_by.values():
                turns.discard(turn)
            self.running_by.setdefault(getattr(event, "worker", ""), set()).add(turn)
            self._changed.set()
        elif event.type == "loop_end":
            for turns in self.running_by.values():
                turns.discard(turn)

    async def _on_ask(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            if msg.reply:
                self._asks[msg.reply] = decode(msg.data, LimitAsk).id

    async def _on_settle(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            settle = decode(msg.data, LimitSettle)
            self.settles[settle.id] = settle

    async def _on_reply(self, heard: dict[str, list[tuple[float, bytes]]], msg: Msg) -> None:
        if len(msg.data) < 256:  # a LimitAnswer is short; publish acks and the rest pass
            heard[msg.subject].append((time.time(), msg.data))

    def _on_snapshot(self, key: str, value: bytes | None, revision: int) -> None:
        snap = None
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            snap = decode(value, SessionSnapshot) if value else None
        self.snapshots.append((key, snap))

    def _on_leader(self, key: str, value: bytes | None, revision: int) -> None:
        owner, at = "", 0.0
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            if value:
                record = decode(value, LeaderRecord)
                owner, at = record.owner, record.at
        self.leader_revisions.append((revision, owner, at))

    async def _watch(self, watcher: object, on: object) -> None:
        async for entry in watcher:  # type: ignore[attr-defined]
            if entry is not None:  # None marks the end of the initial values
                on(entry.key, entry.value, entry.revision)  # type: ignore[operator]


def zombies(
    cuts: Sequence[Cut],
    events: Mapping[str, Sequence[tuple[Event, str]]],
    snapshots: Sequence[tuple[str, SessionSnapshot | None]],
    accepted: Sequence[Accepted] = (),
    ledger: Iterable[Mapping[str, Any]] = (),
) -> list[str]:
    """Writes for a turn by a worker that no longer held it:

    - an event stored after its turn's ``loop_end``: nobody holds a turn that ended (in
      a run without paused nodes, which forward what they held when they resume, only
      a worker that lost the turn writes one; its ``loop_start`` names it);
    - a session snapshot that goes back: fewer turns than one stored before it, or the
      turn in progress again after a snapshot that ended it;
    - a tool call that started after its turn's ``loop_end`` was emitted (a request
      sent again for a turn that had ended; one machine, one clock).
    """
    found = []
    ended: dict[tuple[str, str], float] = {}
    for session, stored in events.items():
        for n, (event, _) in enumerate(stored):
            turn = (session, event.turn_id)
            if event.type == "loop_end" and turn not in ended:
                ended[turn] = event.ts
                after = [
                    f"{e.type} {m}" + (f" by {w}" if (w := getattr(e, "worker", "")) else "")
                    for e, m in stored[n + 1 :]
                    if e.turn_id == event.turn_id
                ]
                if after:
                    found.append(f"{session}/{event.turn_id}{_cut_on(turn, cuts)}: {after} "
                                 "stored after its loop_end")  # fmt: skip
    turn_of = {a.label: (a.session, a.turn_id) for a in accepted}
    for run in ledger:
        turn = turn_of.get(str(run["label"]))
        end = ended.get(turn) if turn is not None else None
        if end is not None and float(run["start"]) > end:
            found.append(
                f"{run['label']}: a call started {float(run['start']) - end:.3f}s after its "
                f"turn's loop_end (pid {run['pid']})"
            )
    by_session: dict[str, list[SessionSnapshot]] = defaultdict(list)
    for key, snap in snapshots:
        if snap is not None:
            by_session[key].append(snap)
    for key, snaps in by_session.items():
        most, ended = 0, set()
        for snap in snaps:
            if snap.turns < most:
                found.append(f"{key}: snapshot of {snap.turns} turns after one of {most}")
            if snap.status != "idle" and snap.turn_id in ended:
                found.append(f"{key}: turn {snap.turn_id} {snap.status} again after it ended")
            most = max(most, snap.turns)
            if snap.status == "idle" and snap.turn_id:
                ended.add(snap.turn_id)
    return found


def _cut_on(turn: tuple[str, str], cuts: Sequence[Cut]) -> str:
    """`` (running on <worker> when it was cut)``, if a cut worker was running it."""
    on = [c.target for c in cuts if turn in c.turns]
    return f" (running on {', '.join(on)} when it was cut)" if on else ""


def two_leaders(settles: Iterable[LimitSettle]) -> list[str]:
    """Grants of two leaders at once, both obeyed. Each used grant's settle repeats its
    leader, term (the leader key's revision when that leader took it: a later leader's
    is higher) and time (the leader's clock; one machine, one clock). In the order they
    were granted, the terms of the grants used never go down, and a term has one leader:
    a grant of a lower term used after one of a higher term means the old leader still
    granted while the new one did, and a worker went by it."""
    used = sorted((s for s in settles if s.sent and s.term), key=lambda s: s.granted_at)
    found = []
    leader_of: dict[int, str] = {}
    newest: LimitSettle | None = None
    for s in used:
        if leader_of.setdefault(s.term, s.leader) != s.leader:
            found.append(f"term {s.term} granted by both {leader_of[s.term]} and {s.leader}")
        if newest is not None and s.term < newest.term:
            found.append(
                f"ask {s.id} granted by {s.leader} (term {s.term}) "
                f"{s.granted_at - newest.granted_at:.3f}s after {newest.leader} granted "
                f"in term {newest.term}"
            )
        if newest is None or s.term > newest.term:
            newest = s
    return found
