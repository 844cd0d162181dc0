"""Erasing a session from everywhere loopmesh keeps it, and expiring one to its last
snapshot (``DELETE /v1/sessions/{session}``, :meth:`Client.delete_session`, retention).

A session is spread over streams and buckets, each keyed its own way; :class:`Eraser`
knows every one (docs/ARCHITECTURE.md, "Erasing a session"):

- a running or waiting turn is stopped first: the session's queued turns are purged
  from the turns stream, a ``cancel`` is sent, and the erase waits (``cancel_wait_s``)
  until the snapshot is idle and no loop worker holds the session's lease;
- the session's events are read once, for its turn ids, its tool calls' ids (the keys
  of their effect records and claims) and the sessions of the agents it called (a child
  session is named by its call's id), which are erased the same way, depth first;
- then each place is purged by subject, every revision and marker with it: the events
  in the session's partition, its turns, its snapshot and metadata (``<key>`` and
  ``<key>.>`` in the sessions bucket), lease, controls, webhooks, tool effects and
  claims, its A2A tasks and their push configurations (found by the task's
  ``metadata.loopmesh.session``), and the dead-letter records of its turns and events;
- an audit record (:class:`~schemas.audit.SessionErased`) goes to the tenant's audit
  subject. The usage ledger is left: it counts tokens by agent and model, not sessions.

``mode="snapshot"`` (retention) keeps the session's last snapshot and its metadata and
erases the rest of it; it stops nothing and leaves the sessions it called, which expire
by their own agent's retention. An erase for retention refuses (:class:`EraseError`) a
session with a turn waiting or running: it was active again since it was found idle.

A write that lands after the purge with a revision check (a zombie worker's checkpoint,
a lease renewal, an A2A task update) fails it, as the key's revision is gone. A tool call
that was already running when its turn was cancelled records its effect when it ends;
that record expires with the effects bucket's TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from schemas import (
    Cancel,
    DecodeError,
    SessionSnapshot,
    Subjects,
    decode,
    encode,
    session_key,
    session_meta_key,
)
from schemas.audit import EraseMode, SessionErased

from .aio import quietly
from .backlog import queued
from .controls import send_control
from .errors import EraseError
from .kv import kv_entries
from .publisher import Publisher, acked
from .retry import retry

log = logging.getLogger("loopmesh.erase")

#: How deep the sessions of called agents are followed (above ``[loop] agent_max_depth``).
MAX_DEPTH = 16
#: How long an erase waits for the session's running turn to end once cancelled.
CANCEL_WAIT_S = 10.0
_POLL_S = 0.1


class _Mark(msgspec.Struct):
    """What erasing reads of an event: which turn and call it belongs to."""

    type: str = ""
    turn_id: str = ""
    call_id: str = ""
    server: str = ""


class _Loopmesh(msgspec.Struct):
    session: str = ""


class _TaskMeta(msgspec.Struct):
    loopmesh: _Loopmesh = msgspec.field(default_factory=_Loopmesh)


class _Task(msgspec.Struct):
    id: str = ""
    metadata: _TaskMeta = msgspec.field(default_factory=_TaskMeta)


class _TaskRecord(msgspec.Struct):
    """An A2A task as the gateway stores it (``gateway/a2a/store.py``), as far as it
    names its session."""

    task: _Task = msgspec.field(default_factory=_Task)


_mark = msgspec.json.Decoder(_Mark)
_task_record = msgspec.json.Decoder(_TaskRecord)

#: The server a call of another agent is made to (``agents.<name>``).
AGENTS_SERVER = "agents"


@dataclass(slots=True)
class _Found:
    """What a session's events name: its calls and the child sessions among them."""

    calls: set[str] = field(default_factory=set)
    children: list[str] = field(default_factory=list)


class Eraser:
    """Erases sessions over one NATS connection (see the module's docstring)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        publisher: Publisher | None = None,
        timeout: float = 5.0,
        cancel_wait_s: float = CANCEL_WAIT_S,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.publisher = publisher or Publisher(nc)
        self.timeout = timeout
        self.cancel_wait_s = cancel_wait_s

    async def erase(
        self,
        tenant: str,
        session: str,
        *,
        mode: EraseMode = "delete",
        reason: Literal["request", "retention"] = "request",
        by: str = "",
    ) -> SessionErased | None:
        """Erase the session (``mode``: see the module); its audit record, or ``None``
        when nothing of the session exists (no snapshot, no events, no turn)."""
        s = self.subjects
        await self.publisher.start()
        try:
            await self.nc.jetstream().stream_info(s.audit_stream)
        except NotFoundError:
            raise EraseError(
                f"stream {s.audit_stream} is missing, so the erase could not be audited; "
                "nothing was erased: run `loopmesh provision` first"
            ) from None
        if not await self.exists(tenant, session):
            return None
        if reason == "retention" and await self._active(tenant, session):
            raise EraseError(f"session {tenant}.{session} is active again: not expired")
        removed: Counter[str] = Counter()
        tasks = await self._a2a_tasks(tenant)
        if mode == "delete":
            children = await self._erase_tree(tenant, session, tasks, removed, depth=0)
        else:
            found = await self._scan(tenant, session)
            await self._remove(tenant, session, found, tasks, mode, removed)
            children = []
        record = SessionErased(
            tenant=tenant, session=session, at=time.time(), reason=reason, mode=mode, by=by,
            children=tuple(children), removed=dict(sorted(removed.items())),
        )  # fmt: skip
        await retry(
            lambda: acked(self.publisher, s.audit(tenant), encode(record), timeout=self.timeout),
            f"audit the erase of {tenant}.{session}",
        )
        log.info("session erased tenant=%s session=%s mode=%s by=%s", tenant, session, mode, by)
        return record

    async def exists(self, tenant: str, session: str) -> bool:
        """Whether anything of the session is stored: a snapshot or its metadata, an
        event or a turn."""
        s = self.subjects
        if await self.snapshot(tenant, session) is not None:
            return True
        if await self._live(s.sessions_bucket, session_meta_key(tenant, session)) is not None:
            return True
        stream = s.events_stream_of(tenant, session)
        events = s.session_events(tenant, session)
        first = await retry(lambda: self.publisher.next_msg(stream, events, 1), "read events")
        if first is not None:
            return True
        return bool(await queued(self.publisher, s, tenant, session))

    async def snapshot(self, tenant: str, session: str) -> SessionSnapshot | None:
        """The session's snapshot as the bucket's leader has it, or ``None``."""
        value = await self._live(self.subjects.sessions_bucket, session_key(tenant, session))
        if value is None:
            return None
        try:
            return decode(value, SessionSnapshot)
        except DecodeError:
            return SessionSnapshot(tenant=tenant, session=session)  # there, if unreadable

    async def _erase_tree(
        self,
        tenant: str,
        session: str,
        tasks: dict[str, list[str]],
        removed: Counter[str],
        *,
        depth: int,
    ) -> list[str]:
        """Stop and erase the session and, first, the sessions it called; their ids."""
        await self._stop(tenant, session)
        found = await self._scan(tenant, session)
        children: list[str] = []
        if depth < MAX_DEPTH:
            for child in found.children:
                children.append(child)
                children += await self._erase_tree(tenant, child, tasks, removed, depth=depth + 1)
        await self._remove(tenant, session, found, tasks, "delete", removed)
        return children

    # -- stopping a running turn --------------------------------------------------------

    async def _stop(self, tenant: str, session: str) -> None:
        """Purge the session's waiting turns, cancel the running one, and wait (up to
        ``cancel_wait_s``) until it ended: the snapshot idle and the lease free."""
        s = self.subjects
        waiting = await queued(self.publisher, s, tenant, session)
        snapshot = await self.snapshot(tenant, session)
        idle = not waiting and (snapshot is None or snapshot.status == "idle")
        if idle and not await self._leased(tenant, session):
            return
        for lane in s.session_turns(tenant, session):
            await self._purge(s.turns_stream_of(tenant), lane)
        cancel = Cancel(
            tenant=tenant, session=session, at=time.time(), reason="the session is being erased"
        )
        await retry(lambda: send_control(self.nc, s, cancel), f"cancel {tenant}.{session}")
        deadline = time.monotonic() + self.cancel_wait_s
        while time.monotonic() < deadline:
            snapshot = await self.snapshot(tenant, session)
            idle = snapshot is None or snapshot.status == "idle"
            if idle and not await self._leased(tenant, session):
                return
            await asyncio.sleep(_POLL_S)
        log.warning(
            "erasing a session whose turn did not end within %.0fs tenant=%s session=%s",
            self.cancel_wait_s, tenant, session,
        )  # fmt: skip

    async def _active(self, tenant: str, session: str) -> bool:
        """Whether a turn of the session waits or runs (a worker holds its lease)."""
        if await queued(self.publisher, self.subjects, tenant, session):
            return True
        return await self._leased(tenant, session)

    async def _leased(self, tenant: str, session: str) -> bool:
        return (
            await self._live(self.subjects.leases_bucket, session_key(tenant, session)) is not None
        )

    async def _live(self, bucket: str, key: str) -> bytes | None:
        """The key's value as the bucket's leader has it (``None``: none, or deleted)."""
        msg = await retry(
            lambda: self.publisher.leader_get(f"KV_{bucket}", f"$KV.{bucket}.{key}"),
            f"read {bucket}",
        )
        if msg is None or not msg.data or (msg.headers or {}).get("KV-Operation"):
            return None
        return bytes(msg.data)

    # -- what the events name -----------------------------------------------------------

    async def _scan(self, tenant: str, session: str) -> _Found:
        """The session's tool calls and child sessions, read from its events."""
        s = self.subjects
        found = _Found()
        stream, subject = s.events_stream_of(tenant, session), s.session_events(tenant, session)
        async for msg in self._messages(stream, subject):
            try:
                mark = _mark.decode(msg.data)
            except msgspec.DecodeError:
                continue
            if mark.type == "tool_call" and mark.call_id:
                found.calls.add(mark.call_id)
                if mark.server == AGENTS_SERVER and mark.call_id not in found.children:
                    found.children.append(mark.call_id)
        return found

    # -- removing -----------------------------------------------------------------------

    async def _remove(
        self,
        tenant: str,
        session: str,
        found: _Found,
        tasks: dict[str, list[str]],
        mode: EraseMode,
        removed: Counter[str],
    ) -> None:
        s = self.subjects
        key = session_key(tenant, session)
        removed["events"] += await self._purge(
            s.events_stream_of(tenant, session), s.session_events(tenant, session)
        )
        for lane in s.session_turns(tenant, session):
            removed["turns"] += await self._purge(s.turns_stream_of(tenant), lane)
        if mode == "delete":
            removed["sessions"] += await self._purge_key(s.sessions_bucket, key)
            removed["sessions"] += await self._purge_key(s.sessions_bucket, f"{key}.>")
        else:  # its last snapshot and its metadata stay; nothing else of it
            removed["sessions"] += await self._purge_key(s.sessions_bucket, key, keep=1)
            for other in await kv_entries(
                self.nc.jetstream(), s.sessions_bucket, f"{key}.>", headers_only=True
            ):
                if other != f"{key}.meta":
                    removed["sessions"] += await self._purge_key(s.sessions_bucket, other)
        removed["leases"] += await self._purge_key(s.leases_bucket, key)
        removed["controls"] += await self._purge_key(s.control_bucket, key)
        removed["controls"] += await self._purge_key(s.control_bucket, f"{key}.>")
        removed["webhooks"] += await self._purge_key(s.webhooks_bucket, f"{key}.>")
        for call in sorted(found.calls):
            removed["effects"] += await self._purge_key(s.effects_bucket, call)
            removed["effects"] += await self._purge_key(s.effects_bucket, f"claim.{call}")
        for task in tasks.get(session, []):
            removed["a2a_tasks"] += await self._purge_key(s.a2a_tasks_bucket, f"{tenant}.{task}")
            removed["a2a_tasks"] += await self._purge_key(s.a2a_push_bucket, task)
        removed["deadletter"] += await self._deadletters(tenant, session)

    async def _a2a_tasks(self, tenant: str) -> dict[str, list[str]]:
        """The ids of the tenant's A2A tasks by the session their turns ran in."""
        entries = await retry(
            lambda: kv_entries(self.nc.jetstream(), self.subjects.a2a_tasks_bucket, f"{tenant}.*"),
            "list the A2A tasks",
        )
        tasks: dict[str, list[str]] = {}
        for entry in entries.values():
            try:
                task = _task_record.decode(entry.value or b"").task
            except msgspec.DecodeError:
                continue
            if task.metadata.loopmesh.session and task.id:
                tasks.setdefault(task.metadata.loopmesh.session, []).append(task.id)
        return tasks

    async def _deadletters(self, tenant: str, session: str) -> int:
        """Delete the dead-letter records of the session's turns and events."""
        s = self.subjects
        stream = s.deadletter_stream
        turns, events = s.session_turns(tenant, session), f"{s.prefix}.events.{tenant}.{session}."
        js = self.nc.jetstream(timeout=self.timeout)
        info = await retry(lambda: js.stream_info(stream), f"{stream} info")
        if not info.state.messages:
            return 0
        doomed = [
            msg.metadata.sequence.stream
            async for msg in self._messages(stream, s.all_deadletter, headers_only=True)
            if (subject := (msg.headers or {}).get("Loopmesh-Subject", "")) in turns
            or subject.startswith(events)
        ]
        for seq in doomed:
            await retry(lambda at=seq: js.delete_msg(stream, at), f"delete {stream} {seq}")  # type: ignore[misc]
        return len(doomed)

    async def _messages(
        self, stream: str, subject: str, *, headers_only: bool = False
    ) -> AsyncIterator[Msg]:
        """Every message of ``subject`` in ``stream`` stored when this starts, read by an
        ephemeral consumer (no acks, in memory, gone 30 s after its last use)."""
        js = self.nc.jetstream(timeout=self.timeout)
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.ALL, ack_policy=js_api.AckPolicy.NONE,
            inactive_threshold=30.0, mem_storage=True, headers_only=headers_only,
        )  # fmt: skip
        sub = await retry(
            lambda: js.pull_subscribe(subject, stream=stream, config=config), f"read {stream}"
        )
        try:
            pending = (await sub.consumer_info()).num_pending or 0
            while pending > 0:
                msgs = await sub.fetch(min(pending, 256), timeout=self.timeout)
                if not msgs:
                    break
                pending = msgs[-1].metadata.num_pending or 0
                for msg in msgs:
                    yield msg
        finally:
            await quietly(sub.unsubscribe())

    async def _purge_key(self, bucket: str, key: str, *, keep: int = 0) -> int:
        """Purge a key (or keys: a wildcard) of ``bucket``, every revision and marker."""
        return await self._purge(f"KV_{bucket}", f"$KV.{bucket}.{key}", keep=keep)

    async def _purge(self, stream: str, subject: str, *, keep: int = 0) -> int:
        """Purge ``subject``'s messages from ``stream`` (but the last ``keep``); how many."""
        request: dict[str, object] = {"filter": subject}
        if keep:
            request["keep"] = keep
        reply = await retry(
            lambda: self.nc.request(
                f"$JS.API.STREAM.PURGE.{stream}", json.dumps(request).encode(),
                timeout=self.timeout,
            ),
            f"purge {subject} from {stream}",
        )  # fmt: skip
        answer = json.loads(reply.data)
        if "error" in answer:
            raise EraseError(f"{stream} did not purge {subject}: {answer['error']}")
        return int(answer.get("purged", 0))
