"""A2A tasks in JetStream: the SDK's :class:`VersionedTaskStore` over a KV bucket.

The bucket ``<prefix>-a2a-tasks`` holds each task under ``<tenant>.<task id>``: a
:class:`TaskRecord` with the task as A2A's JSON, the tenant, and ``seq``, the events
stream sequence of the last turn event folded into it. A key is built from the caller's
tenant, so another tenant's key never reads, lists or writes the task (to it, the task
does not exist); a task of another agent than the URL's is not found either.

**Versions.** A task's :class:`~a2a.server.cluster.TaskVersion` is its position in the
events stream: ``seq`` and a count of the writes made since that event (the SDK's own:
the task created, the user's message added), as ``seq << 20 | n``. Every write is
checked against the version it was made from (a revision-checked KV update), so two
writers never interleave: the second gets :class:`ConcurrentTaskModificationError`
and the SDK reloads, as it does across replicas.

**Reads fold.** The gateway that ran a task's request stores its updates as its turn
runs. If that gateway went away, the turn went on without it: a read of a task whose
turn is still running by its record (``submitted``, ``working``) folds in the turn's
events stored after ``seq`` (:class:`~gateway.a2a.projection.Projection`), so it shows
what the turn did, on any gateway, with the version of the last event folded. A write
made from such a read is checked against the same fold. A fold that reaches the turn's
``loop_end`` more than ``[gateway] a2a_repair_after_s`` ago is written back (no live
writer is that far behind), so it is folded once.

The store also remembers, for a little while, the task each read returned
(:meth:`TaskStore.seen`): the SDK's re-subscription asks its event stream for the
events after the version it just read, by task id alone (see :mod:`.events`).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
from a2a.server.cluster import (
    ConcurrentTaskModificationError,
    StoredTask,
    TaskVersion,
    VersionedTaskStore,
)
from a2a.server.context import ServerCallContext
from a2a.server.events import Event as A2AEvent
from a2a.types import ListTasksRequest, ListTasksResponse, Task, TaskState
from a2a.utils.constants import DEFAULT_LIST_TASKS_PAGE_SIZE
from a2a.utils.errors import InvalidParamsError
from a2a.utils.task import ListTasksCursor, decode_list_tasks_cursor, encode_list_tasks_cursor
from google.protobuf.json_format import MessageToDict, MessageToJson, Parse, ParseError
from nats.js.errors import KeyWrongLastSequenceError

from schemas import is_token

from ..backend import Backend
from .caller import caller_of
from .follow import stored_events
from .projection import RUNNING, TERMINAL, Projection, loopmesh_of

_N_BITS = 20
_SEEN = 4_096  # tasks remembered for a re-subscription


class TaskRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A task as the bucket holds it; ``n``: writes since the event at ``seq``."""

    tenant: str
    seq: int
    n: int = 1
    updated_at: float = 0.0
    task: msgspec.Raw


_decoder = msgspec.json.Decoder(TaskRecord)


def version(seq: int, n: int) -> TaskVersion:
    """The version of a task that reflects the events up to ``seq``, written ``n``
    times since."""
    return TaskVersion((seq << _N_BITS) | n)


@dataclass(frozen=True, slots=True)
class Seen:
    """What a read of a task returned: where its turn's events are, the task, and the
    sequence of the last event folded into it."""

    tenant: str
    session: str
    task: Task
    seq: int


@dataclass(frozen=True, slots=True)
class _Wrote:
    """The last write of a task by this process: a next write made from it needs no
    read first (the revision check still refuses it if anyone wrote since)."""

    version: TaskVersion
    seq: int
    n: int
    revision: int


@dataclass(slots=True)
class _Found:
    record: TaskRecord
    revision: int
    task: Task


class TaskStore(VersionedTaskStore):
    def __init__(self, backend: Backend, *, repair_after_s: float = 60.0) -> None:
        self.backend = backend
        self.bucket = backend.subjects.a2a_tasks_bucket
        self.repair_after_s = repair_after_s
        self._seen: OrderedDict[tuple[str, TaskVersion], Seen] = OrderedDict()
        self._wrote: OrderedDict[str, _Wrote] = OrderedDict()

    # -- reads ------------------------------------------------------------------------

    async def get(self, task_id: str, context: ServerCallContext) -> StoredTask | None:
        caller = caller_of(context)
        found = await self._read(caller.tenant, task_id)
        if found is None or loopmesh_of(found.task).get("agent") != caller.agent:
            return None
        projection, at = await self._fold(found)
        task = Task()
        task.CopyFrom(projection.task)
        self._remember((task_id, at), Seen(caller.tenant, _session(task), task, projection.seq))
        return StoredTask(projection.task, at)

    def seen(self, task_id: str, at: TaskVersion) -> Seen | None:
        """What a read of ``task_id`` at version ``at`` in this process returned, if it
        is still remembered."""
        return self._seen.get((task_id, at))

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        caller = caller_of(context)
        entries = await self.backend.entries(self.bucket, f"{caller.tenant}.*")
        tasks: list[Task] = []
        for entry in entries.values():
            found = _found(entry.value, entry.revision)
            if found is None or loopmesh_of(found.task).get("agent") != caller.agent:
                continue
            projection, _ = await self._fold(found)
            tasks.append(projection.task)
        if params.context_id:
            tasks = [t for t in tasks if t.context_id == params.context_id]
        if params.status:
            tasks = [t for t in tasks if t.status.state == params.status]
        if params.HasField("status_timestamp_after"):
            after = params.status_timestamp_after.ToNanoseconds()
            tasks = [t for t in tasks if t.status.timestamp.ToNanoseconds() >= after]
        tasks.sort(key=_order, reverse=True)
        total = len(tasks)
        if params.page_token:
            cursor = decode_list_tasks_cursor(params.page_token)
            if cursor is None:
                raise InvalidParamsError(message="pageToken is not one this server gave")
            tasks = [t for t in tasks if _order(t) < cursor.sort_key()]
        size = params.page_size or DEFAULT_LIST_TASKS_PAGE_SIZE
        page = tasks[:size]
        token = ""
        if len(tasks) > size:
            last = page[-1]
            token = encode_list_tasks_cursor(
                ListTasksCursor(timestamp_ns=_order(last)[1], task_id=last.id)
            )
        return ListTasksResponse(
            tasks=page, next_page_token=token, page_size=size, total_size=total
        )

    async def _read(self, tenant: str, task_id: str) -> _Found | None:
        if not is_token(task_id):
            return None  # no task has such an id, and it must not reach a key
        kv = await self.backend.kv(self.bucket)
        entry = await self.backend._call("read a task", kv.entry(f"{tenant}.{task_id}"))
        if entry is None or entry.value is None:
            return None
        return _found(entry.value, entry.revision)

    async def _fold(self, found: _Found, *, repair: bool = True) -> tuple[Projection, TaskVersion]:
        """The task with its turn's stored events folded in, and its version."""
        record = found.record
        projection = Projection(found.task, record.seq)
        at = version(record.seq, record.n)
        if found.task.status.state not in RUNNING:
            return projection, at
        meta = loopmesh_of(found.task)
        events = stored_events(
            self.backend, record.tenant, str(meta.get("session")), projection.turn, record.seq
        )
        async with contextlib.aclosing(events):
            async for seq, event in events:
                await projection.step(seq, event)
        if projection.seq == record.seq:
            return projection, at
        at = version(projection.seq, 1)
        if repair and projection.ended and time.time() - projection.end_ts >= self.repair_after_s:
            await self._repair(found, projection)
        return projection, at

    async def _repair(self, found: _Found, projection: Projection) -> None:
        """Write back a fold that reached its turn's end (best effort: a writer that got
        there first wins)."""
        record = msgspec.structs.replace(
            found.record,
            seq=projection.seq,
            n=1,
            updated_at=time.time(),
            task=msgspec.Raw(MessageToJson(projection.task, indent=None).encode()),
        )
        kv = await self.backend.kv(self.bucket)
        self._wrote.pop(f"{record.tenant}.{found.task.id}", None)
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self.backend._call(
                "repair a task",
                kv.update(f"{record.tenant}.{found.task.id}", msgspec.json.encode(record),
                          last=found.revision),
            )  # fmt: skip

    def _remember(self, key: tuple[str, TaskVersion], seen: Seen) -> None:
        self._seen[key] = seen
        self._seen.move_to_end(key)
        while len(self._seen) > _SEEN:
            self._seen.popitem(last=False)

    # -- writes -----------------------------------------------------------------------

    async def save(
        self,
        task: Task,
        *,
        event: A2AEvent | None,
        prev: Task | None,
        prev_version: TaskVersion,
        context: ServerCallContext,
    ) -> TaskVersion:
        tenant = caller_of(context).tenant
        if not is_token(task.id):
            raise InvalidParamsError(message=f"task id {task.id[:80]!r} is not a loopmesh id")
        key = f"{tenant}.{task.id}"
        kv = await self.backend.kv(self.bucket)
        cancel = task.status.state == TaskState.TASK_STATE_CANCELED
        event_seq = _seq_of(event, task)
        wrote = self._wrote.get(key)
        if wrote is not None and wrote.version == prev_version and not cancel:
            seq, n, last = wrote.seq, wrote.n, wrote.revision  # this process wrote it last
        else:
            entry = await self.backend._call("read a task", kv.entry(key))
            found = _found(entry.value, entry.revision) if entry and entry.value else None
            if found is None:
                if not prev_version.is_missing or cancel:
                    raise ConcurrentTaskModificationError(task.id)
                seq, n, last = event_seq or 0, 0, 0
            else:
                seq, n = await self._base(found, prev_version, cancel)
                last = found.revision
        seq, n = (event_seq, 1) if event_seq is not None and event_seq > seq else (seq, n + 1)
        record = TaskRecord(
            tenant=tenant, seq=seq, n=n, updated_at=time.time(),
            task=msgspec.Raw(MessageToJson(task, indent=None).encode()),
        )  # fmt: skip
        try:
            revision = await self.backend._call(
                "write a task", kv.update(key, msgspec.json.encode(record), last=last)
            )
        except KeyWrongLastSequenceError:
            self._wrote.pop(key, None)
            raise ConcurrentTaskModificationError(task.id) from None
        self._wrote[key] = _Wrote(version(seq, n), seq, n, revision)
        self._wrote.move_to_end(key)
        while len(self._wrote) > _SEEN:
            self._wrote.popitem(last=False)
        return version(seq, n)

    async def _base(
        self, found: _Found, prev_version: TaskVersion, cancel: bool
    ) -> tuple[int, int]:
        """The (seq, n) a write made from ``prev_version`` builds on; raises
        :class:`ConcurrentTaskModificationError` when the task moved on since."""
        record = found.record
        if found.task.status.state in TERMINAL:
            if cancel or prev_version != version(record.seq, record.n):
                raise ConcurrentTaskModificationError(found.task.id)
            return record.seq, record.n
        if cancel or prev_version == version(record.seq, record.n):
            return record.seq, record.n  # a cancel overwrites a task that has not ended
        projection, at = await self._fold(found, repair=False)  # a write made from a fold
        if at != prev_version:
            raise ConcurrentTaskModificationError(found.task.id)
        return projection.seq, 1

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        tenant = caller_of(context).tenant
        if not is_token(task_id):
            return
        bucket = await self.backend._bucket(self.bucket)
        self._wrote.pop(f"{tenant}.{task_id}", None)
        await self.backend._call("delete a task", bucket.delete(f"{tenant}.{task_id}"))


def _found(value: bytes | None, revision: int) -> _Found | None:
    if not value:
        return None
    try:
        record = _decoder.decode(value)
        task = Parse(bytes(record.task), Task(), ignore_unknown_fields=True)
    except (msgspec.DecodeError, ParseError):
        return None
    return _Found(record, revision, task)


def _session(task: Task) -> str:
    return str(loopmesh_of(task).get("session", ""))


def _seq_of(event: A2AEvent | None, task: Task) -> int | None:
    """The events-stream sequence an update came from (``metadata.loopmesh.seq``): an
    update's own, or for a whole task, the task's."""
    source = event if event is not None and not isinstance(event, Task) else task
    meta = source.metadata if hasattr(source, "metadata") else None
    if meta is None or "loopmesh" not in meta:
        return None
    seq = MessageToDict(meta)["loopmesh"].get("seq")
    return int(seq) if isinstance(seq, int | float) else None


def _order(task: Task) -> tuple[bool, int, str]:
    """The ``ListTasks`` order, newest status first (as the SDK's own stores)."""
    stamped = task.status.HasField("timestamp")
    return stamped, task.status.timestamp.ToNanoseconds() if stamped else 0, task.id
