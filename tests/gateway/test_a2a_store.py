"""The A2A task store on a real nats-server: versions checked like the SDK's cluster
stores want them, tenants and agents apart, and a read that folds in the turn's stored
events."""

from __future__ import annotations

import time

import pytest
from a2a.server.cluster import ConcurrentTaskModificationError, TaskVersion
from a2a.server.context import ServerCallContext
from a2a.types import ListTasksRequest, Task, TaskState, TaskStatus, TaskStatusUpdateEvent
from nats.aio.client import Client

from gateway.a2a.caller import Caller
from gateway.a2a.projection import metadata, status_update
from gateway.a2a.store import TaskStore
from gateway.backend import Backend
from loopmesh.testing.durable import SUBJECTS
from schemas import encode
from schemas.events import ContentDelta, LoopEnd, LoopStart
from schemas.events import Message as AnswerMessage


def context(tenant: str = "acme", agent: str = "default") -> ServerCallContext:
    return ServerCallContext(user=Caller(tenant, "k", agent))


def new_task(task_id: str = "t1", session: str = "s1", seq: int = 0) -> Task:
    about = {"session": session, "agent": "default", "turn": task_id, "seq": seq}
    task = Task(
        id=task_id, context_id=session, metadata=metadata(about),
        status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
    )  # fmt: skip
    return task


@pytest.fixture
def store(nc: Client) -> TaskStore:
    return TaskStore(Backend(nc, SUBJECTS), repair_after_s=0)


async def test_a_write_from_a_stale_version_is_refused_and_a_cancel_is_not(
    store: TaskStore, nc: Client
):
    task = new_task()
    first = await store.save(task, event=task, prev=None, prev_version=TaskVersion.MISSING,
                             context=context())  # fmt: skip
    with pytest.raises(ConcurrentTaskModificationError):  # it exists already
        await store.save(task, event=task, prev=None, prev_version=TaskVersion.MISSING,
                         context=context())  # fmt: skip
    working = status_update(task, TaskState.TASK_STATE_WORKING, 5, time.time())
    task.status.CopyFrom(working.status)
    second = await store.save(task, event=working, prev=None, prev_version=first,
                              context=context())  # fmt: skip
    assert second.is_after(first)
    other = TaskStore(Backend(nc, SUBJECTS))  # another gateway, which read the first
    with pytest.raises(ConcurrentTaskModificationError):
        await other.save(task, event=None, prev=None, prev_version=first, context=context())
    task.status.state = TaskState.TASK_STATE_CANCELED  # a cancel overwrites what runs
    cancelled = await other.save(task, event=None, prev=None, prev_version=first,
                                 context=context())  # fmt: skip
    stored = await store.get("t1", context())
    assert stored is not None and stored.version == cancelled
    assert stored.task.status.state == TaskState.TASK_STATE_CANCELED
    with pytest.raises(ConcurrentTaskModificationError):  # and nothing overwrites an end
        await store.save(task, event=None, prev=None, prev_version=second, context=context())


async def test_another_tenant_or_agent_never_reads_a_task(store: TaskStore):
    task = new_task()
    await store.save(task, event=task, prev=None, prev_version=TaskVersion.MISSING,
                     context=context())  # fmt: skip
    assert await store.get("t1", context()) is not None
    assert await store.get("t1", context(tenant="globex")) is None
    assert await store.get("t1", context(agent="calc")) is None
    assert await store.get("t.1", context()) is None  # no such id reaches a key
    assert (await store.list(ListTasksRequest(), context(tenant="globex"))).tasks == []


async def test_a_read_folds_in_the_turns_events_its_gateway_did_not_store(
    store: TaskStore, nc: Client
):
    task = new_task()
    await store.save(task, event=task, prev=None, prev_version=TaskVersion.MISSING,
                     context=context())  # fmt: skip
    js = nc.jetstream()
    ids = {"tenant": "acme", "session": "s1", "turn_id": "t1", "ts": time.time()}
    for event in (
        LoopStart(**ids), ContentDelta(**ids, iteration=1, text="Hel"),
        ContentDelta(**ids, iteration=1, text="lo"),
        ContentDelta(**{**ids, "turn_id": "t2"}, text="another turn's"),
        AnswerMessage(**ids, iteration=1, content="Hello"),
        LoopEnd(**ids, reason="task_completion", content="Hello", iterations=1),
    ):  # fmt: skip
        await js.publish(SUBJECTS.event("acme", "s1", event.type), encode(event))
    stored = await store.get("t1", context())
    assert stored is not None
    assert stored.task.status.state == TaskState.TASK_STATE_COMPLETED
    [artifact] = stored.task.artifacts
    assert [p.text for p in artifact.parts] == ["Hello"]
    # its turn ended long enough ago (repair_after_s=0): written back, read as it is now
    again = await TaskStore(Backend(nc, SUBJECTS)).get("t1", context())
    assert again is not None and again.version == stored.version and again.task == stored.task


def test_status_updates_carry_where_they_came_from():
    update = status_update(new_task(seq=3), TaskState.TASK_STATE_WORKING, 9, 1.0)
    assert isinstance(update, TaskStatusUpdateEvent)
    assert update.metadata["loopmesh"]["seq"] == 9 and update.metadata["loopmesh"]["turn"] == "t1"
