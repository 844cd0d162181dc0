"""Session snapshots in the sessions KV bucket, saved with revision checks.

``load`` remembers the revision it read; ``save`` writes with ``kv.update(...,
last=revision)``, so a checkpoint that would overwrite someone else's newer snapshot
raises :class:`~loop_worker.errors.StaleSessionError` instead. A save retried through a
reconnect may find that its first attempt did land: when the stored bytes are exactly
the ones being saved, that counts as success, not as a lost race. ``on_stale`` hears
of every lost race first (the service mutes that turn's events with it).

With ``pipelined=True`` (the service) a save publishes the checkpoint and returns; its
ack is awaited by the next save or load of the session, or by :meth:`flush`, which the
service calls before it acks the turn. The loop does not wait a round trip per
iteration, and a crash can lose at most the last checkpoint: the iteration is replayed
with the same call ids, whose effects are recorded, and the same event ids. A lost
race then surfaces one save later.

The engine keeps bulky tool outputs out of the snapshot (it stores a truncated copy in
the conversation); the full result lives in the call's effect record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NoReturn

from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas import SessionSnapshot, Subjects, decode, encode, session_key

from .errors import StaleSessionError
from .retry import retry

_ACK_WAIT_S = 5.0


class KVSessionStore:
    """The :class:`~loop_worker.protocols.SessionStore` of the durable service."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        timeout: float = 30.0,
        on_stale: Callable[[str], None] | None = None,
        pipelined: bool = False,
    ) -> None:
        self._js = js
        self._on_stale = on_stale
        self._pipelined = pipelined
        self._pending: dict[str, tuple[asyncio.Future[Any], bytes]] = {}
        self._subjects = subjects
        self._timeout = timeout
        self._kv: KeyValue | None = None
        self._revisions: dict[str, int] = {}

    async def start(self) -> None:
        if self._kv is None:
            self._kv = await retry(
                lambda: self._js.key_value(self._subjects.sessions_bucket),
                "open sessions bucket",
                timeout=self._timeout,
            )

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("KVSessionStore not started")
        return self._kv

    async def load(self, tenant: str, session: str) -> SessionSnapshot | None:
        key = session_key(tenant, session)
        await self._settle(key)
        try:
            entry = await retry(lambda: self.kv.get(key), f"load {key}", timeout=self._timeout)
        except KeyNotFoundError:
            self._revisions[key] = 0
            return None
        self._revisions[key] = entry.revision or 0
        return decode(entry.value or b"", SessionSnapshot)

    async def save(self, snapshot: SessionSnapshot) -> None:
        key = session_key(snapshot.tenant, snapshot.session)
        data = encode(snapshot)
        if not self._pipelined:
            await self._write(key, data)
            return
        await self._settle(key)  # the previous checkpoint's revision is the next's base
        last = self._revisions.get(key) or 0
        future = await self._js.publish_async(
            f"$KV.{self._subjects.sessions_bucket}.{key}",
            data,
            headers={"Nats-Expected-Last-Subject-Sequence": str(last)},
        )
        self._pending[key] = (future, data)

    async def flush(self, tenant: str, session: str) -> None:
        """Wait until the session's last checkpoint is stored (pipelined saves)."""
        await self._settle(session_key(tenant, session))

    async def _settle(self, key: str) -> None:
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        future, data = pending
        try:
            async with asyncio.timeout(_ACK_WAIT_S):
                ack = await asyncio.shield(future)
        except APIError as exc:
            if exc.err_code not in (10071, 10164):  # not a lost race: write it again
                await self._write(key, data)
                return
            self._stale(key)
        except Exception:  # no ack (a reconnect): write it again, checked
            future.cancel()
            await self._write(key, data, retried=True)
        else:
            self._revisions[key] = ack.seq

    async def _write(self, key: str, data: bytes, *, retried: bool = False) -> None:
        last = self._revisions.get(key)
        if last is None:  # saved without a load first: only if nobody else wrote it
            last = 0
        attempts = 1 if retried else 0

        async def update() -> int:
            nonlocal attempts
            attempts += 1
            return await self.kv.update(key, data, last=last)

        revision: int | None
        try:
            revision = await retry(update, f"save {key}", timeout=self._timeout)
        except KeyWrongLastSequenceError:
            revision = await self._landed(key, data) if attempts > 1 else None
            if revision is None:
                self._stale(key)
        self._revisions[key] = revision

    def _stale(self, key: str) -> NoReturn:
        self._revisions.pop(key, None)
        if self._on_stale is not None:
            self._on_stale(key)
        raise StaleSessionError(key) from None

    def forget(self, tenant: str, session: str) -> None:
        """Drop what is remembered of a session this worker no longer runs."""
        key = session_key(tenant, session)
        self._revisions.pop(key, None)
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending[0].cancel()

    async def _landed(self, key: str, data: bytes) -> int | None:
        """The revision of ``data`` if it is what ``key`` holds now."""
        try:
            entry = await retry(lambda: self.kv.get(key), f"check {key}", timeout=self._timeout)
        except KeyNotFoundError:
            return None
        return entry.revision if entry.value == data else None
