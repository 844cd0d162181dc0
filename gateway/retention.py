"""Sessions that expire: the gateway's sweeper of idle sessions.

A session idle (its last activity, ``updated_at``) longer than its retention expires:
its agent's ``session_retention_s`` and ``retention`` where the agent sets them, else
its tenant's (``[tenants."<name>"]``, or ``[tenants."*"]``); 0 keeps it. ``delete``
erases it as ``DELETE /v1/sessions/{session}`` does; ``snapshot`` keeps its last
snapshot, title and labels, and erases its events, turns, effects, controls and A2A
tasks (:mod:`loopmesh.erase`). Each expiry is an audit record with reason ``retention``.

Every gateway sweeps every ``[gateway] retention_sweep_s``: it reads the sessions
bucket once, and claims each expiry by a revision-checked write of the session's
metadata (``expired_at``), so of several gateways one erases a session and records it;
a session kept as its snapshot is not expired again until it is active again.

Memories ([loop.memory]) older than their tenant's ``memory_retention_s`` are erased in
the same pass (every trace of each, as ``DELETE /v1/memory/{memory}`` does); of several
gateways erasing one, the second finds it gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from loopmesh.errors import EraseError
from loopmesh.jetstream import kv_entries, kv_values
from loopmesh.memory import decode_memory
from loopmesh.sessions import meta_of
from loopmesh.settings import Tenants
from schemas import AgentSpec, DecodeError, SessionSnapshot, decode
from schemas.audit import EraseMode

from .backend import Backend

log = logging.getLogger("loopmesh.gateway.retention")


@dataclass(frozen=True, slots=True)
class Policy:
    """How long a session may stay idle (0: forever) and what expiring does."""

    after_s: float
    mode: EraseMode


def policy(tenants: Tenants, agent: AgentSpec | None, tenant: str) -> Policy:
    """The retention of a session of ``tenant`` and ``agent``: the agent's, field by
    field, over its tenant's."""
    limits = tenants.get(tenant) or tenants.get("*")
    after = limits.session_retention_s if limits is not None else 0.0
    mode: EraseMode = limits.retention if limits is not None else "delete"
    if agent is not None and agent.session_retention_s is not None:
        after = agent.session_retention_s
    if agent is not None and agent.retention is not None:
        mode = agent.retention
    return Policy(after, mode)


class Retention:
    """The sweeper (``start``, ``close``); :meth:`sweep` is one pass. ``sweeps`` counts
    the passes done."""

    def __init__(
        self, backend: Backend, tenants: Tenants, *, every_s: float, cancel_wait_s: float
    ) -> None:
        self.backend = backend
        self.tenants = tenants
        self.every_s = every_s
        self.cancel_wait_s = cancel_wait_s
        self.sweeps = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.every_s > 0:
            self._task = asyncio.create_task(self._run(), name="retention")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.sweep()
                await self.sweep_memories()
            except Exception as exc:  # NATS away for a while: the next pass tries again
                log.warning("retention sweep failed error=%r", exc)
            self.sweeps += 1

    async def sweep_memories(self) -> int:
        """Erase the memories older than their tenant's ``memory_retention_s``; how many."""
        if not any(t.memory_retention_s for t in self.tenants.values()):
            return 0
        store = await self.backend.memory()
        values = await self.backend.call(
            "read the memories",
            kv_values(self.backend.js, store.bucket, ">", timeout=self.backend.timeout),
        )
        now, erased = time.time(), 0
        for value in values.values():
            memory = decode_memory(value)
            if memory is None:
                continue
            limits = self.tenants.get(memory.tenant) or self.tenants.get("*")
            after = limits.memory_retention_s if limits is not None else 0.0
            if after and now - memory.created_at >= after:
                gone = await store.delete(memory.tenant, memory.kind, memory.name, memory.id)
                erased += int(gone)
        return erased

    async def sweep(self) -> int:
        """Expire the sessions idle past their retention; how many."""
        agents = {a.name: a for a in await self.backend.agents()}
        if not self._any(agents):
            return 0
        backend = self.backend
        bucket = backend.subjects.sessions_bucket
        entries = await backend.call(
            "read the sessions", kv_entries(backend.js, bucket, ">", timeout=backend.timeout)
        )
        now, expired = time.time(), 0
        for key, entry in entries.items():
            if key.count(".") != 1 or not entry.value:
                continue
            try:
                snapshot = decode(entry.value, SessionSnapshot)
            except DecodeError:
                continue
            rule = policy(self.tenants, agents.get(snapshot.agent), snapshot.tenant)
            if snapshot.status != "idle" or not rule.after_s:
                continue
            if now - snapshot.updated_at < rule.after_s:
                continue
            meta_entry = entries.get(f"{key}.meta")
            meta = meta_of(meta_entry.value if meta_entry is not None else None)
            if rule.mode == "snapshot" and meta.expired_at >= snapshot.updated_at:
                continue  # kept as its snapshot already, and not active since
            claim = msgspec.structs.replace(meta, expired_at=now)
            try:
                last = meta_entry.revision if meta_entry is not None else 0
                await backend.put_session_meta(snapshot.tenant, snapshot.session, claim, last)
            except KeyWrongLastSequenceError:
                continue  # another gateway expires it
            try:
                await backend.eraser(self.cancel_wait_s).erase(
                    snapshot.tenant, snapshot.session, mode=rule.mode, reason="retention",
                    by="retention",
                )  # fmt: skip
            except EraseError as exc:
                log.warning("session not expired session=%s error=%s", key, exc.message)
                continue
            expired += 1
        return expired

    def _any(self, agents: dict[str, AgentSpec]) -> bool:
        """Whether any tenant or agent sets a retention (else a pass reads nothing)."""
        return any(t.session_retention_s for t in self.tenants.values()) or any(
            a.session_retention_s for a in agents.values()
        )
