"""The SDK's cross-replica event stream, read from loopmesh's events stream.

The SDK re-subscribes a client to a task that this gateway is not running (another
gateway runs it, or the one that did went away) by reading the task, then asking its
:class:`~a2a.server.cluster.TaskEventStream` for the events after the version read.
loopmesh's events stream already holds everything a turn did, durably: this stream
translates the turn's events after the task's ``seq``
(:mod:`~gateway.a2a.projection`) as they come, so a re-subscription is served by any
gateway, also after a restart, with nothing published twice. Its versions are the
store's (:func:`~gateway.a2a.store.version`): each update's is the sequence of the
event it came from.

``publish`` stores nothing: the updates a gateway makes from a turn's events are on the
events stream already. (What the SDK makes by itself for a task, such as the
``canceled`` it records for a task that asked for input, is in the task's record, which
a re-subscription reads first.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from a2a.server.cluster import TaskEventStream, TaskVersion, VersionedEvent
from a2a.utils.errors import TaskNotFoundError

from ..backend import Backend
from .follow import live_events
from .projection import Projection
from .store import TaskStore, version


class TurnEventStream(TaskEventStream):
    def __init__(self, backend: Backend, store: TaskStore) -> None:
        self.backend = backend
        self.store = store

    async def publish(self, task_id: str, event: VersionedEvent) -> None:
        return None  # see the module docstring

    async def subscribe(
        self, task_id: str, *, after: TaskVersion
    ) -> AsyncGenerator[VersionedEvent]:
        seen = self.store.seen(task_id, after)
        if seen is None:  # the SDK reads the task just before: not remembered any more
            raise TaskNotFoundError(message=f"task {task_id} was not read here just now")
        projection = Projection(seen.task, seen.seq)
        if projection.ended:
            return
        events = live_events(self.backend, seen.tenant, seen.session, projection.turn, seen.seq)
        async with contextlib.aclosing(events):
            async for seq, event in events:
                update = await projection.step(seq, event)
                if update is not None:
                    yield VersionedEvent(event=update, version=version(seq, 1))

    async def destroy(self, task_id: str) -> None:
        return None
