"""A KV bucket as a service sees it: every entry, kept current by a live watch.

:class:`BucketWatch` watches a bucket (``kv.watchall()``) and keeps what each key holds,
decoded by the subclass: the loop worker's tool catalog (``loop_worker/catalog.py``) and
the named agents (:class:`loopmesh.agents.AgentsWatch`, which the loop worker and the
NATS Agent Protocol's host both watch) are two. An entry is there from the moment it was
put, and gone when its key is deleted or purged.

Expiry: on nats-server 2.15 a key that lapses through the bucket's TTL (``max_age``)
produces no watch update (the server drops the message and tells no consumer unless
the stream places delete markers, which the buckets do not ask for). So the watch
keeps its own clock: each entry lapses ``ttl`` after it was put (the server's
timestamp, for entries of the initial load; the moment it arrived, for live ones),
and is dropped then unless a newer put came. A delete marker, where a server places
one (nats-py reads ``Nats-Marker-Reason`` as a purge), drops the entry too. An entry
the subclass says :meth:`~BucketWatch.lasts` (a catalog spec put with ``Nats-TTL:
never``) does not lapse: it stays until deleted.

Loading: :meth:`BucketWatch.loaded` waits for the watch's initial values, so nothing
runs on a half-known bucket. A watch that ends or fails is opened again, and so is
one that lived through a reconnect of the client (``nc.stats["reconnects"]``, looked
at every ``check_s``): nats-py's ordered consumer behind a watch only notices a
restarted server after two missed heartbeats, and took about 20 s to deliver again in
a test. The entries known so far stay until the new watch's initial values are in,
which then replace them whole.

The watch runs in a task the object owns: ``async with`` (or ``start`` and the
idempotent ``close``) bounds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Generic, Self, TypeVar

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from loopmesh.aio import raise_if_cancelled

log = logging.getLogger("loopmesh.watch")

T = TypeVar("T")


class BucketWatch(Generic[T]):
    """Every entry of ``bucket``, decoded by :meth:`decode`, kept current by a KV watch.
    ``on_change`` is called with the whole list when it loads and whenever its keys
    change."""

    #: What the bucket holds, in log lines ("catalog", "agents").
    what = "bucket"
    #: Whether a changed value calls ``on_change`` too, not only a key put or deleted
    #: (a catalog spec is put again every few seconds: its keys are what change).
    values_change = False
    #: The keys watched (a KV key pattern: ``*`` one token, ``>`` the rest).
    keys = ">"

    def __init__(
        self,
        nc: Client,
        bucket: str,
        *,
        load_timeout_s: float = 10.0,
        on_change: Callable[[Sequence[T]], object] | None = None,
        retry_max_s: float = 2.0,
        check_s: float = 0.5,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._check_s = check_s
        self.bucket = bucket
        self.load_timeout_s = load_timeout_s
        self._on_change = on_change
        self._retry_max_s = retry_max_s
        self._items: dict[str, T] = {}
        self._list: tuple[T, ...] = ()
        self._loaded = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._last_error: BaseException | None = None
        self.watches = 0  # how many watches were opened (1 unless one ended or failed)

    # -- what a subclass says -------------------------------------------------------------

    def decode(self, key: str, revision: int, value: bytes) -> T | None:
        """The item a put of ``value`` under ``key`` holds; ``None`` to ignore it."""
        raise NotImplementedError

    def lasts(self, item: T) -> bool:
        """Whether ``item`` outlives the bucket's TTL (it stays until deleted)."""
        return False

    def not_loaded(self, timeout_s: float, last: BaseException | None) -> Exception:
        """The error :meth:`loaded` raises when the first load is not in after ``timeout_s``."""
        why = f" (last error: {last!r})" if last is not None else ""
        return TimeoutError(f"KV bucket {self.bucket} did not load within {timeout_s:g} s{why}")

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start watching (idempotent): :meth:`loaded` tells when the first load is in."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.what)

    async def close(self) -> None:
        """Stop watching. Idempotent."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- reading ------------------------------------------------------------------------

    @property
    def is_loaded(self) -> bool:
        return self._loaded.is_set()

    async def loaded(self, timeout: float | None = None) -> None:
        """Return once the initial load is in; raise :meth:`not_loaded`'s error after
        ``timeout`` (default ``load_timeout_s``) or when the watch is closed."""
        if self._loaded.is_set():
            return
        timeout = self.load_timeout_s if timeout is None else timeout
        task = self._task
        if task is None or task.done():
            raise self.not_loaded(0.0, self._last_error)
        waiter = asyncio.ensure_future(self._loaded.wait())
        try:
            await asyncio.wait({waiter, task}, timeout=timeout, return_when=_FIRST)
        finally:
            waiter.cancel()
        if not self._loaded.is_set():
            raise self.not_loaded(timeout, self._last_error)

    def items(self) -> Sequence[T]:
        """The items known now (empty until loaded), the same tuple until a change."""
        return self._list

    def get(self, key: str) -> T | None:
        return self._items.get(key)

    async def wait_for(self, predicate: Callable[[Self], bool], timeout: float) -> bool:
        """Wait up to ``timeout`` until ``predicate(self)`` holds (tests, tools)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: predicate(self))
        return predicate(self)

    # -- the watch ----------------------------------------------------------------------

    async def _run(self) -> None:
        delay = 0.05
        while True:
            try:
                kv = await self._js.key_value(self.bucket)
                status = await kv.status()
                last_seq = status.stream_info.state.last_seq
                if self.keys != ">":  # the last message of the watched keys
                    last_seq = await _last_of(self._js, self.bucket, self.keys)
                self.watches += 1
                await self._watch(kv, status.ttl or 0.0, last_seq)
                delay = 0.05
            except Exception as exc:
                self._last_error = exc
                log.warning("%s watch failed bucket=%s error=%r", self.what, self.bucket, exc)
            raise_if_cancelled()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._retry_max_s)

    async def _watch(self, kv: KeyValue, ttl: float, last_seq: int) -> None:
        """Follow one watch until it ends. Entries are collected in ``fresh`` and
        published whole once the initial values are in, then one change at a time.

        The initial values are in once the watch has delivered the bucket's last
        message as of before it opened (``last_seq``), or that message is gone. The
        watch's own end-of-initial-values marker is not enough: nats-py sends it when
        the consumer has nothing pending and its callback has seen nothing yet, which
        is also true when the server has already pushed every value to a busy client.
        """
        loop = asyncio.get_running_loop()
        reconnects = self._nc.stats["reconnects"]
        watcher = await kv.watch(self.keys)
        fresh: dict[str, T] = {}
        lapses: dict[str, float] = {}  # key -> loop time at which it expires
        initial = True
        reached = last_seq == 0  # the watch delivered the last message there was
        marked = False  # nats-py said the initial values were in
        try:
            while True:
                raise_if_cancelled()  # nats-py may have swallowed a cancel
                if self._nc.stats["reconnects"] != reconnects:
                    log.info("reconnected: watching again %s bucket=%s", self.what, self.bucket)
                    return
                wake = min([*lapses.values(), loop.time() + self._check_s])
                try:
                    async with asyncio.timeout_at(wake):
                        entry = await anext(watcher)
                except TimeoutError:
                    now = loop.time()
                    for key in [k for k, t in lapses.items() if t <= now]:
                        del lapses[key]
                        fresh.pop(key, None)
                        log.info("%s entry expired key=%s", self.what, key)
                    if initial and marked and await _gone(self._js, kv, last_seq):
                        initial = False
                        self._last_error = None
                    if not initial:
                        await self._publish(fresh)
                    continue
                except StopAsyncIteration:
                    log.info("%s watch ended; watching again bucket=%s", self.what, self.bucket)
                    return
                if entry is None:
                    marked = True
                    if initial and (reached or await _gone(self._js, kv, last_seq)):
                        initial = False
                        self._last_error = None
                        await self._publish(fresh)
                    continue
                reached = reached or entry.revision >= last_seq
                key = entry.key
                item = None
                if entry.operation is None and entry.value:  # not a delete or a purge
                    item = self.decode(key, entry.revision, entry.value)
                if item is None:
                    fresh.pop(key, None)
                    lapses.pop(key, None)
                else:
                    fresh[key] = item
                    if ttl > 0 and not self.lasts(item):
                        age = _age(entry.created) if initial else 0.0
                        lapses[key] = loop.time() + ttl - min(max(age, 0.0), ttl)
                    else:
                        lapses.pop(key, None)
                if initial and reached:  # everything the bucket held is in
                    initial = False
                    self._last_error = None
                if not initial:
                    await self._publish(fresh)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _publish(self, fresh: dict[str, T]) -> None:
        changed = fresh.keys() != self._items.keys() or not self._loaded.is_set()
        if not changed and fresh == self._items:
            return
        changed = changed or self.values_change
        self._items = dict(fresh)
        self._list = tuple(fresh.values())
        self._loaded.set()
        if changed and self._on_change is not None:  # before any waiter resumes
            try:
                self._on_change(self._list)
            except Exception:
                log.exception("%s change callback failed", self.what)
        async with self._changed:
            self._changed.notify_all()


_FIRST = asyncio.FIRST_COMPLETED


async def _gone(js: JetStreamContext, kv: KeyValue, seq: int) -> bool:
    """Whether the bucket no longer holds its message ``seq`` (it expired or was replaced),
    so a watch will never deliver it. Entries that outlive the TTL (pinned catalog
    specs) outlive later ones that lapse, so ``seq`` can be gone while older messages
    stay: then it is looked up."""
    status = await kv.status()
    state = status.stream_info.state
    if state.messages == 0 or state.first_seq > seq:
        return True
    try:
        await js.get_msg(status.stream_info.config.name or "", seq=seq)
    except NotFoundError:
        return True
    return False


async def _last_of(js: JetStreamContext, bucket: str, keys: str) -> int:
    """The sequence of the bucket's last message under ``keys`` (0: none)."""
    try:
        msg = await js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{keys}")
    except NotFoundError:
        return 0
    return int(msg.seq or 0)


def _age(created: object) -> float:
    """Seconds since the server stored an entry (0 when it does not say)."""
    if isinstance(created, datetime.datetime):
        return time.time() - created.timestamp()
    if isinstance(created, int | float) and created > 0:
        return time.time() - (created / 1e9 if created > 1e12 else created)
    return 0.0
