"""Session snapshots in the sessions KV bucket, saved with revision checks.

``load`` remembers the revision it read; ``save`` writes with ``kv.update(...,
last=revision)``, so a checkpoint that would overwrite someone else's newer snapshot
raises :class:`~loop_worker.engine.errors.StaleSessionError` instead. A save retried through a
reconnect may find that its first attempt did land: when the stored bytes are exactly
the ones being saved, that counts as success, not as a lost race. ``on_stale`` hears
of every lost race first (the service mutes that turn's events with it).

With ``pipelined=True`` (the service) a save only keeps the checkpoint; it is
published by :meth:`commit` — which the dispatcher calls before it publishes a tool
call of the session, so the checkpoint holding the pending calls is on the wire first
— by :meth:`flush` and :meth:`load`, or by :meth:`run` once it is ``commit_after_s``
old. A checkpoint saved before the previous one went out replaces it (the one after
an iteration is usually replaced by the next iteration's, which holds it all). A
commit awaits the previous checkpoint's ack (its revision is the next one's base),
and :meth:`flush`, which the service calls before it acks the turn, awaits the last.
The loop does not wait a round trip per iteration, and a crash can lose at most the
last checkpoint: the iteration is replayed with the same call ids, whose effects are
recorded, and the same event ids. A lost race surfaces at a later commit, and every
save of the session raises :class:`~loop_worker.engine.errors.StaleSessionError` from then on.

A snapshot saved at a turn's end (``status`` idle) gets the turn's id added to its
``ended_turns`` (the last :data:`~schemas.messages.ENDED_TURNS_KEPT`): the snapshot
itself says which turns it holds, and :meth:`ended_before` asks it whether a turn ended
before the session's last one, so a delivery of it that got past the checks of the
turns stream is not run twice.

:meth:`forget` keeps a session's last snapshot and revision when both are known to be
stored (the most recent, up to :data:`WARM_BYTES` of encoded snapshots); :meth:`preload`
with ``warm=True`` uses them instead of a read. When the caller may say ``warm`` is its
business (the loop worker's reasoning: :func:`loop_worker.turn.warm`).

The engine keeps bulky tool outputs out of the snapshot (it stores a truncated copy in
the conversation); the full result lives in the call's effect record. A snapshot larger
than one NATS message has its longest message texts cut to fit (:mod:`loopmesh.payload`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import msgspec
from nats.aio.client import Client
from nats.js.errors import APIError, KeyWrongLastSequenceError

from loopmesh.aio import raise_if_cancelled
from loopmesh.jetstream import KV, WRONG_LAST_SEQUENCE, Publisher, open_kv, retry, settled
from loopmesh.payload import fit, limit_of
from schemas import SessionSnapshot, Subjects, decode, session_key
from schemas.messages import ENDED_TURNS_KEPT

from .engine.errors import StaleSessionError

log = logging.getLogger("loopmesh.loop_worker.store")

_ACK_WAIT_S = 5.0
_TEXTS = frozenset({"content", "summary", "arguments"})  # what a snapshot too large may cut
_JSON_TEXTS = frozenset({"arguments"})  # a tool call's arguments stay JSON when cut
WARM_BYTES = 32 * 1024 * 1024  # encoded size of the ended sessions' snapshots kept


def _acked(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _ended(snapshot: SessionSnapshot) -> SessionSnapshot:
    """``snapshot``, with its turn among its ``ended_turns`` once the turn has ended."""
    turn_id, ended = snapshot.turn_id, snapshot.ended_turns
    if snapshot.status != "idle" or turn_id is None or turn_id in ended:
        return snapshot
    return msgspec.structs.replace(snapshot, ended_turns=(*ended, turn_id)[-ENDED_TURNS_KEPT:])


class KVSessionStore:
    """The :class:`~loop_worker.engine.protocols.SessionStore` of the durable service."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        timeout: float = 30.0,
        on_stale: Callable[[str], None] | None = None,
        pipelined: bool = False,
        publisher: Publisher | None = None,
        commit_after_s: float = 0.05,
        before_commit: Callable[[SessionSnapshot], Awaitable[None]] | None = None,
    ) -> None:
        self._nc = nc
        self._before_commit = before_commit  # awaited before a checkpoint goes out
        self._publisher = publisher or Publisher(nc)
        self._on_stale = on_stale
        self._pipelined = pipelined
        self._pending: dict[str, tuple[asyncio.Future[Any], bytes]] = {}
        self._kept: dict[str, tuple[SessionSnapshot, float]] = {}  # saved, not published
        self._lost: set[str] = set()  # sessions whose checkpoint lost a race
        self._commit_after_s = commit_after_s
        self._subjects = subjects
        self._timeout = timeout
        self._kv: KV | None = None
        self._revisions: dict[str, int] = {}
        self._preloaded: dict[str, SessionSnapshot | BaseException | None] = {}
        # the last snapshot loaded or committed, and its encoded size
        self._current: dict[str, tuple[SessionSnapshot | None, int]] = {}
        self._warm: dict[str, tuple[SessionSnapshot | None, int, int]] = {}  # + revision
        self._warm_bytes = 0

    async def start(self) -> None:
        if self._kv is None:
            bucket = self._subjects.sessions_bucket
            js = self._nc.jetstream()
            self._kv = await open_kv(js, self._publisher, bucket, timeout=self._timeout)

    @property
    def kv(self) -> KV:
        if self._kv is None:
            raise RuntimeError("KVSessionStore not started")
        return self._kv

    async def preload(self, tenant: str, session: str, *, warm: bool = False) -> bool:
        """Load the snapshot now (alongside other reads); the next :meth:`load` of the
        session returns it, or raises what this one raised. ``warm``: the caller vouches
        that nobody wrote the session since :meth:`forget` kept it, so what was kept
        serves, if anything was. Whether it did (no read)."""
        key = session_key(tenant, session)
        kept = self._warm.pop(key, None)
        if kept is not None:
            self._warm_bytes -= kept[1]
            if warm:
                snapshot, size, revision = kept
                self._preloaded[key], self._revisions[key] = snapshot, revision
                self._current[key] = (snapshot, size)
                return True
        loaded: SessionSnapshot | BaseException | None
        try:
            loaded = await self.load(tenant, session)
        except Exception as exc:
            loaded = exc
        self._preloaded[key] = loaded
        return False

    def ended_before(self, tenant: str, session: str, turn_id: str) -> bool:
        """Whether the preloaded snapshot holds turn ``turn_id`` ended, with a later turn
        of the session on top: running it again would apply it twice."""
        loaded = self._preloaded.get(session_key(tenant, session))
        return (
            isinstance(loaded, SessionSnapshot)
            and turn_id in loaded.ended_turns
            and loaded.turn_id != turn_id
        )

    def preloaded_turn(self, tenant: str, session: str) -> str | None:
        """The turn a preloaded snapshot was saved by (``None``: none, or no preload)."""
        loaded = self._preloaded.get(session_key(tenant, session))
        return loaded.turn_id if isinstance(loaded, SessionSnapshot) else None

    def preloaded_agent(self, tenant: str, session: str) -> str | None:
        """The agent of a preloaded snapshot (``None``: none, or no preload)."""
        loaded = self._preloaded.get(session_key(tenant, session))
        return loaded.agent if isinstance(loaded, SessionSnapshot) else None

    async def load(self, tenant: str, session: str) -> SessionSnapshot | None:
        key = session_key(tenant, session)
        if key in self._preloaded:
            loaded = self._preloaded.pop(key)
            if isinstance(loaded, BaseException):
                raise loaded
            return loaded
        await self._commit(key)
        await self._settle(key)
        entry = await retry(lambda: self.kv.entry(key), f"load {key}", timeout=self._timeout)
        self._revisions[key] = entry.revision if entry is not None else 0
        snapshot = None
        if entry is not None and entry.value is not None:
            snapshot = decode(entry.value, SessionSnapshot)
        self._current[key] = (snapshot, len(entry.value or b"") if entry is not None else 0)
        return snapshot

    async def save(self, snapshot: SessionSnapshot) -> None:
        snapshot = _ended(snapshot)
        key = session_key(snapshot.tenant, snapshot.session)
        if not self._pipelined:
            self._current.pop(key, None)
            snapshot, data = self._encode(snapshot)
            if self._before_commit is not None:
                await self._before_commit(snapshot)
            await self._write(key, data)
            self._current[key] = (snapshot, len(data))
            return
        if key in self._lost:
            raise StaleSessionError(key)
        kept = self._kept.get(key)
        self._kept[key] = (snapshot, kept[1] if kept else time.monotonic())

    async def commit(self, tenant: str, session: str) -> None:
        """Publish the session's kept checkpoint (pipelined saves); its ack is awaited
        later. Raises :class:`StaleSessionError` if an earlier one lost a race."""
        await self._commit(session_key(tenant, session))

    async def flush(self, tenant: str, session: str) -> None:
        """Wait until the session's last checkpoint is stored (pipelined saves)."""
        key = session_key(tenant, session)
        await self._commit(key)
        await self._settle(key)

    async def run(self) -> None:
        """Publish checkpoints kept for ``commit_after_s`` (until cancelled)."""
        while True:
            await asyncio.sleep(self._commit_after_s)
            due = time.monotonic() - self._commit_after_s
            for key, (_, since) in list(self._kept.items()):
                pending = self._pending.get(key)
                if since > due or (pending is not None and not _acked(pending[0])):
                    continue  # its base is not known yet: the next commit waits for it
                try:
                    await self._commit(key)
                except Exception as exc:  # the engine's next save or commit sees it
                    log.debug("checkpoint not committed key=%s error=%r", key, exc)
            raise_if_cancelled()

    async def _commit(self, key: str) -> None:
        while self._before_commit is not None:  # until no newer save came meanwhile
            kept = self._kept.get(key)
            if kept is None:
                return
            await self._before_commit(kept[0])
            if self._kept.get(key) is kept:
                break
        kept = self._kept.pop(key, None)
        if kept is None:
            return
        snapshot, data = self._encode(kept[0])
        await self._settle(key)  # the previous checkpoint's revision is the next's base
        last = self._revisions.get(key) or 0
        self._current.pop(key, None)  # stored once settled
        future = await self._publisher.publish(
            self.kv.prefix + key, data, {"Nats-Expected-Last-Subject-Sequence": str(last)}
        )
        self._pending[key] = (future, data)
        self._current[key] = (snapshot, len(data))

    def _encode(self, snapshot: SessionSnapshot) -> tuple[SessionSnapshot, bytes]:
        """The snapshot as stored: if larger than one NATS message, its longest message
        texts cut to fit (the events of those replies said so when they were cut)."""
        fitted = fit(snapshot, limit_of(self._nc), keys=_TEXTS, json_keys=_JSON_TEXTS)
        if fitted.cut:
            log.warning(
                "snapshot of %s.%s cut from %d to %d bytes to fit max_payload: %s",
                snapshot.tenant, snapshot.session, fitted.size, len(fitted.data),
                ", ".join(fitted.cut),
            )  # fmt: skip
        return fitted.value, fitted.data

    async def _settle(self, key: str) -> None:
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        future, data = pending
        try:
            ack = await settled(future, _ACK_WAIT_S)
        except APIError as exc:
            if exc.err_code not in WRONG_LAST_SEQUENCE:  # not a lost race: write it again
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
        if self._pipelined:
            self._lost.add(key)
            self._kept.pop(key, None)
        if self._on_stale is not None:
            self._on_stale(key)
        raise StaleSessionError(key) from None

    def forget(self, tenant: str, session: str) -> None:
        """Drop what is remembered of a session this worker no longer runs, keeping its
        last snapshot and revision if both are known to be stored."""
        key = session_key(tenant, session)
        revision = self._revisions.get(key)
        current = self._current.pop(key, None)
        if (
            revision is not None
            and current is not None
            and key not in self._pending
            and key not in self._kept
            and key not in self._lost
        ):
            self._keep_warm(key, (*current, revision))
        self._revisions.pop(key, None)
        self._kept.pop(key, None)
        self._lost.discard(key)
        self._preloaded.pop(key, None)
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending[0].cancel()

    def _keep_warm(self, key: str, kept: tuple[SessionSnapshot | None, int, int]) -> None:
        old = self._warm.pop(key, None)
        if old is not None:
            self._warm_bytes -= old[1]
        self._warm[key] = kept
        self._warm_bytes += kept[1]
        while self._warm_bytes > WARM_BYTES and self._warm:
            self._warm_bytes -= self._warm.pop(next(iter(self._warm)))[1]  # the oldest

    async def _landed(self, key: str, data: bytes) -> int | None:
        """The revision of ``data`` if it is what ``key`` holds now."""
        entry = await retry(lambda: self.kv.entry(key), f"check {key}", timeout=self._timeout)
        return entry.revision if entry is not None and entry.value == data else None
