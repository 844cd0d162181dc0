"""The gateway's side of NATS: turns, controls, sessions, the catalog, agents, events.

Every call takes the caller's tenant and builds subjects and keys with it, so a request
can only ever reach its own tenant's data; ids are checked before they get here. The
connection itself (calls bounded by a timeout, buckets, the publisher, stream reads,
readiness) is :mod:`gateway.connection`'s.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Mapping

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)

from loopmesh.agents import read_agents, spec_of
from loopmesh.backlog import Queued, turns_waiting, unfinished
from loopmesh.controls import control_key
from loopmesh.erase import CANCEL_WAIT_S, Eraser
from loopmesh.jetstream import kv_values, open_kv
from loopmesh.memory import MemoryStore
from loopmesh.schedules import ScheduleStore, run_ends
from loopmesh.sessions import meta_of, read_sessions
from loopmesh.usage import UsageDay, read_days
from schemas import (
    DEFAULT_AGENT,
    AgentSpec,
    Control,
    DecodeError,
    SessionMeta,
    SessionSnapshot,
    ToolSpec,
    Turn,
    decode,
    encode,
    session_key,
    session_meta_key,
)
from schemas.agents import default_agent
from schemas.audit import SessionErased
from schemas.events import Event
from schemas.keys import CONTROL_RECORDED_HEADER
from schemas.schedules import ScheduleRun

from .connection import Connection

log = logging.getLogger("loopmesh.gateway")


class Backend(Connection):
    """NATS operations of the gateway, on one connection (:class:`~.connection.Connection`):
    sessions, turns and controls, schedules, the catalog, agents and events."""

    async def memory(self) -> MemoryStore:
        """The memory bucket ([loop.memory]); ``Unavailable`` while it is missing."""
        await self._bucket(self.subjects.memory_bucket)
        return MemoryStore(self.js, self.subjects.memory_bucket, timeout_s=self.timeout)

    # -- sessions ---------------------------------------------------------------------

    async def usage(self, tenant: str) -> list[UsageDay]:
        """The tenant's days in the usage ledger, oldest first."""
        await self._bucket(self.subjects.usage_bucket)
        return await self._call("read usage", read_days(self.js, self.subjects, tenant))

    async def turns_waiting(self, tenant: str) -> int:
        """The tenant's turns no loop worker holds yet, of both lanes
        (:func:`loopmesh.backlog.turns_waiting`)."""
        return await self._call(
            "read the tenant's backlog", turns_waiting(self.js, self.subjects, tenant)
        )

    async def publish_event(self, event: Event, msg_id: str) -> None:
        """Store ``event`` in its session's events (deduplicated by ``msg_id``)."""
        subject = self.subjects.event(event.tenant, event.session, event.type)
        stream = self.subjects.events_stream_of(event.tenant, event.session)
        await self._call(
            f"publish a {event.type} event",
            self.js.publish(subject, encode(event), stream=stream, headers={"Nats-Msg-Id": msg_id}),
        )

    async def unfinished(self, tenant: str, session: str) -> list[Queued]:
        """The session's turns in the turns stream that have not ended."""
        return await self._call(
            "read the session's turns",
            unfinished(self.publisher(), self.subjects, tenant, session),
        )

    async def session(self, tenant: str, session: str) -> SessionSnapshot | None:
        kv = await self._bucket(self.subjects.sessions_bucket)
        try:
            entry = await self._call("read session", kv.get(session_key(tenant, session)))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return decode(entry.value, SessionSnapshot)
        except DecodeError as exc:
            log.warning("unreadable session tenant=%s session=%s error=%s", tenant, session, exc)
            return None

    async def create_session(self, tenant: str, session: str, agent: str = DEFAULT_AGENT) -> bool:
        """Store an empty snapshot of a session of ``agent`` unless the session exists;
        whether it was created."""
        kv = await self._bucket(self.subjects.sessions_bucket)
        empty = SessionSnapshot(tenant=tenant, session=session, updated_at=time.time(), agent=agent)
        try:
            await self._call(
                "create session", kv.create(session_key(tenant, session), encode(empty))
            )
        except KeyWrongLastSequenceError:
            return False
        return True

    # -- session data: metadata, the list, erasing ----------------------------------------

    async def session_index(self, tenant: str) -> list[tuple[SessionSnapshot, SessionMeta]]:
        """Every session of the tenant with its metadata (empty where none was set)."""
        await self._bucket(self.subjects.sessions_bucket)
        return await self._call(
            "list sessions", read_sessions(self.js, self.subjects, tenant, timeout=self.timeout)
        )

    async def session_meta(self, tenant: str, session: str) -> tuple[SessionMeta, int]:
        """The session's metadata and its revision (0: none set)."""
        kv = await self.kv(self.subjects.sessions_bucket)
        entry = await self._call(
            "read session metadata", kv.entry(session_meta_key(tenant, session))
        )
        if entry is None or entry.value is None:
            return SessionMeta(), entry.revision if entry is not None else 0
        return meta_of(entry.value), entry.revision

    async def put_session_meta(
        self, tenant: str, session: str, meta: SessionMeta, last: int
    ) -> None:
        """Write the session's metadata if its revision is still ``last``
        (:class:`~nats.js.errors.KeyWrongLastSequenceError` otherwise)."""
        kv = await self.kv(self.subjects.sessions_bucket)
        key = session_meta_key(tenant, session)
        await self._call("write session metadata", kv.update(key, encode(meta), last))

    async def audit(self, tenant: str, limit: int) -> list[SessionErased]:
        """The tenant's latest ``limit`` audit records, oldest first."""
        stream = self.subjects.audit_stream
        info = await self._call("audit stream info", self.js.stream_info(stream))
        if not info.state.messages:
            return []
        found: list[SessionErased] = []
        subject = self.subjects.audit(tenant)
        async for batch in self.stored_events(stream, subject, info.state.first_seq, "audit"):
            for msg in batch:
                try:
                    found.append(decode(msg.data, SessionErased))
                except DecodeError:
                    continue
            found = found[-limit:]
        return found

    def eraser(self, cancel_wait_s: float = CANCEL_WAIT_S) -> Eraser:
        """Erases sessions (:mod:`loopmesh.erase`) on this connection."""
        return Eraser(
            self.nc, self.subjects, publisher=self.publisher(), timeout=self.timeout,
            cancel_wait_s=cancel_wait_s,
        )  # fmt: skip

    # -- turns and controls -----------------------------------------------------------

    async def publish_turn(self, turn: Turn, trace: Mapping[str, str] | None = None) -> bool:
        """Publish ``turn`` with JetStream and await the ack; whether JetStream already
        had it (a retried POST, deduplicated by ``Nats-Msg-Id``). ``trace``: the
        ``traceparent`` (and ``tracestate``) headers the turn carries to its worker."""
        ack = await self._call(
            "publish turn",
            self.js.publish(
                self.subjects.turn(turn.tenant, turn.session, turn.priority),
                encode(turn),
                headers={**(trace or {}), "Nats-Msg-Id": turn.msg_id},
            ),
        )
        return bool(ack.duplicate)

    async def send_control(self, control: Control) -> None:
        """Record ``control`` in the control bucket, then publish it to the session's
        control subject, marked as recorded (the loop workers' contract, see
        ``loop_worker/controls.py``)."""
        kv = await self._bucket(self.subjects.control_bucket)
        key = control_key(control)
        await self._call("record control", kv.put(key, encode(control)))
        await self.nc.publish(
            self.subjects.control(control.tenant, control.session),
            encode(control),
            headers={CONTROL_RECORDED_HEADER: "1"},
        )
        await self._call("flush control", self.nc.flush())

    # -- schedules ------------------------------------------------------------------------

    async def schedules(self) -> ScheduleStore:
        """The schedules bucket (:class:`~loopmesh.schedules.ScheduleStore`); a call on it
        goes through :meth:`call`, so NATS not answering in time is a 503."""
        if self._schedules is None:
            bucket = self.subjects.schedules_bucket
            await self._bucket(bucket)
            kv = await self._call(
                f"open bucket {bucket}", open_kv(self.js, self.publisher(), bucket)
            )
            self._schedules = ScheduleStore(
                kv, self.js, self.subjects, max_per_tenant=self.max_schedules
            )
        return self._schedules

    async def run_ends(self, tenant: str, runs: tuple[ScheduleRun, ...]) -> dict[str, str]:
        """The ``loop_end`` reason of each run that has ended, by turn id."""
        return await self._call(
            "read the runs' ends", run_ends(self.publisher(), self.subjects, tenant, runs)
        )

    # -- catalog ----------------------------------------------------------------------

    async def tools(self) -> list[ToolSpec]:
        bucket = self.subjects.catalog_bucket
        await self._bucket(bucket)
        values = await self._call("list tools", kv_values(self.js, bucket, timeout=self.timeout))
        specs: list[ToolSpec] = []
        for value in values.values():
            try:
                specs.append(decode(value, ToolSpec))
            except DecodeError:
                continue
        specs.sort(key=lambda s: (s.server, s.name))
        return specs

    # -- agents -----------------------------------------------------------------------

    async def agents(self) -> list[AgentSpec]:
        """Every named agent, ``default`` first, each with its revision."""
        await self._bucket(self.subjects.agents_bucket)
        found = await self._call(
            "list agents", read_agents(self.js, self.subjects, timeout=self.timeout)
        )
        return list(found.values())

    async def agent(self, name: str) -> AgentSpec | None:
        """The named agent as it stands now, or ``None``."""
        kv = await self._bucket(self.subjects.agents_bucket)
        try:
            entry = await self._call("read agent", kv.get(name))
        except (KeyNotFoundError, KeyDeletedError):
            return default_agent() if name == DEFAULT_AGENT else None
        return spec_of(name, entry.value, entry.revision or 0)

    # -- events -----------------------------------------------------------------------

    async def events_bounds(self, tenant: str, session: str) -> tuple[int, int]:
        """The first and last sequence of the events stream that holds the session's
        events (its partition's: a sequence means something only within one stream)."""
        stream = self.subjects.events_stream_of(tenant, session)
        info = await self._call("events stream info", self.js.stream_info(stream))
        return info.state.first_seq, info.state.last_seq

    async def current_turn_start(self, tenant: str, session: str) -> int | None:
        """The sequence after which the session's current turn's events come, where a
        stream opened without ``since`` starts: while a turn has not ended (running, or
        waiting like one just posted), after the session's last ``loop_end``; once all
        have ended, before the latest turn's ``turn_accepted``. ``None``: the session
        has no turn yet (the stream starts at new events)."""
        return await self._call(
            "find the session's current turn", self._current_turn_start(tenant, session)
        )

    async def _current_turn_start(self, tenant: str, session: str) -> int | None:
        publisher, subjects = self.publisher(), self.subjects
        stream = subjects.events_stream_of(tenant, session)
        # read before the backlog: a turn that ends in between is then found as ended
        end = await publisher.leader_get(stream, subjects.event(tenant, session, "loop_end"))
        if await unfinished(publisher, subjects, tenant, session):
            if end is not None:
                return _sequence(end)
            first, _ = await self.events_bounds(tenant, session)
            return first - 1  # the session's first turn: all of its events
        accepted = await publisher.leader_get(
            stream, subjects.event(tenant, session, "turn_accepted")
        )
        if accepted is not None:
            return _sequence(accepted) - 1
        if end is not None:  # only turns refused before they started
            first, _ = await self.events_bounds(tenant, session)
            return first - 1
        return None

    async def latest_events(self, tenant: str, limit: int, scan: int) -> list[tuple[int, bytes]]:
        """The tenant's latest ``limit`` events among each events stream's last ``scan``
        messages, oldest first, as (sequence, JSON).

        With more than one partition the tenant's sessions are spread over several
        streams, whose sequences do not compare: each partition's newest ``limit`` are
        read, and they are merged by the events' own ``ts`` (the time the worker made
        them; a tie goes to the lower partition). The merge never reorders one stream's
        events, so a session's events always come in their sequence order, even where a
        worker's clock stepped back. Each event keeps its own stream's sequence: the id
        to resume its session's stream with (``GET /v1/sessions/{session}/events``,
        Last-Event-ID)."""
        parts = await asyncio.gather(
            *(self._latest_in(k, tenant, limit, scan) for k in range(self.subjects.partitions))
        )
        if len(parts) == 1:
            return parts[0]
        merged = heapq.merge(*parts, key=lambda found: _ts_of(found[1]))
        return list(merged)[-limit:]

    async def _latest_in(
        self, partition: int, tenant: str, limit: int, scan: int
    ) -> list[tuple[int, bytes]]:
        """The tenant's latest ``limit`` events among one partition's last ``scan``."""
        stream = self.subjects.partition_stream(partition)
        info = await self._call("events stream info", self.js.stream_info(stream))
        first, last = info.state.first_seq, info.state.last_seq
        if last == 0:
            return []
        start = max(first, last - scan + 1, 1)
        out: list[tuple[int, bytes]] = []
        subject = self.subjects.tenant_events(tenant, partition)
        async for batch in self.stored_events(stream, subject, start, "latest events"):
            out.extend((msg.metadata.sequence.stream, msg.data) for msg in batch)
            out = out[-limit:]
        return out


class _Stamped(msgspec.Struct):
    ts: float = 0.0


_stamp = msgspec.json.Decoder(_Stamped)


def _ts_of(data: bytes) -> float:
    """An event's ``ts`` (0 for bytes that are no event: they sort first)."""
    try:
        return _stamp.decode(data).ts
    except msgspec.DecodeError:
        return 0.0


def _sequence(msg: Msg) -> int:
    """The stream sequence of a message read by :meth:`Publisher.leader_get`."""
    return int((msg.headers or {})["Nats-Sequence"])
