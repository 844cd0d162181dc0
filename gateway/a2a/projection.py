"""A turn's events as A2A task updates: the one translation every path uses.

A task is a turn (a follow-up message to a task that asked for input is the next turn of
it), so its state is a fold of the turn's events. :func:`translate` turns one event into
at most one A2A event, from the task as it stands, and :class:`Projection` applies it
with the SDK's own :class:`~a2a.server.tasks.TaskManager` semantics. The executor uses
it while the turn runs, a read folds in what a gateway that went away did not store, and
a re-subscription tails the rest: the same events give the same updates on any gateway.

=======================  ===================================================================
loopmesh event           A2A update
=======================  ===================================================================
``loop_start``           status ``working``
``content_delta``        a chunk of the ``answer`` artifact: appended (``append``) within
                         one reply; the first text of a new reply (the next iteration, or
                         the next turn) replaces what the artifact held
``retract``              the artifact emptied (its reply was discarded: retried, nudged)
``message``              the ``answer`` artifact replaced by the answer, ``lastChunk``
``loop_end``             ``completed`` (``task_completion``, ``converse``,
                         ``forced_summary``), ``input-required`` with the question
                         (``ask_question``), ``canceled`` (``cancelled``, ``interrupted``),
                         ``rejected`` (``rejected``), else ``failed`` with the reason
=======================  ===================================================================

The rest (tool calls, thinking, usage) stays on loopmesh's own event stream. Every
update carries ``metadata.loopmesh`` (session, agent, turn, and ``seq``: the events
stream sequence of the event it came from); a status update merges it into the task's.
"""

from __future__ import annotations

import time
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.tasks import InMemoryTaskStore, TaskManager
from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from schemas.events import ContentDelta, Event, LoopEnd, LoopStart, Retract
from schemas.events import Message as AnswerMessage

ANSWER = "answer"  # the artifact that holds the streamed reply, then the answer

Update = TaskStatusUpdateEvent | TaskArtifactUpdateEvent

TERMINAL = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_FAILED,
        TaskState.TASK_STATE_REJECTED,
    }
)
#: A task in these states has a turn that has not ended.
RUNNING = frozenset({TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING})

_COMPLETED = frozenset({"task_completion", "converse", "forced_summary"})
_CANCELED = frozenset({"cancelled", "interrupted"})


def loopmesh_of(task: Task) -> dict[str, Any]:
    """The task's ``metadata.loopmesh``: its session, agent, current turn and ``seq``."""
    if "loopmesh" not in task.metadata:
        return {}
    value = MessageToDict(task.metadata)["loopmesh"]
    return value if isinstance(value, dict) else {}


def metadata(values: dict[str, Any]) -> Struct:
    """``{"loopmesh": values}`` as a protobuf ``Struct``."""
    struct = Struct()
    struct.update({"loopmesh": values})
    return struct


def status_update(
    task: Task, state: int, seq: int, ts: float, message: Message | None = None
) -> TaskStatusUpdateEvent:
    status = TaskStatus(state=state, message=message)  # type: ignore[arg-type]
    status.timestamp.FromNanoseconds(int(ts * 1e9))
    return TaskStatusUpdateEvent(
        task_id=task.id,
        context_id=task.context_id,
        status=status,
        metadata=metadata({**loopmesh_of(task), "seq": seq}),
    )


def translate(task: Task, event: Event, seq: int) -> Update | None:
    """The A2A update that ``event`` (stream sequence ``seq``) makes to ``task``, or
    ``None`` when it makes none (see the module docstring)."""
    match event:
        case LoopStart():
            return status_update(task, TaskState.TASK_STATE_WORKING, seq, event.ts)
        case ContentDelta(text=text) if text:
            fresh = not _answer_is(task, event)
            return _chunk(task, event, seq, [Part(text=text)], append=not fresh)
        case Retract() if _answer_is(task, event):
            return _chunk(task, event, seq, [Part(text="")], append=False)
        case AnswerMessage(content=content):
            return _chunk(task, event, seq, [Part(text=content)], append=False, final=True)
        case LoopEnd():
            return _end(task, event, seq)
    return None


def _answer(task: Task) -> Artifact | None:
    return next((a for a in task.artifacts if a.artifact_id == ANSWER), None)


def _answer_is(task: Task, event: Event) -> bool:
    """Whether the answer artifact holds this reply's text (same turn and iteration)."""
    artifact = _answer(task)
    if artifact is None:
        return False
    meta = MessageToDict(artifact.metadata)
    return (
        meta.get("turn") == event.turn_id
        and meta.get("iteration") == event.iteration
        and not meta.get("final")
    )


def _chunk(
    task: Task, event: Event, seq: int, parts: list[Part], *, append: bool, final: bool = False
) -> TaskArtifactUpdateEvent:
    about: dict[str, Any] = {"turn": event.turn_id, "iteration": event.iteration}
    if final:
        about["final"] = True
    artifact_meta = Struct()
    artifact_meta.update(about)
    return TaskArtifactUpdateEvent(
        task_id=task.id,
        context_id=task.context_id,
        artifact=Artifact(artifact_id=ANSWER, name=ANSWER, parts=parts, metadata=artifact_meta),
        append=append,
        last_chunk=final,
        metadata=metadata({**loopmesh_of(task), "seq": seq}),
    )


def _end(task: Task, event: LoopEnd, seq: int) -> TaskStatusUpdateEvent:
    reason = event.reason

    def say(text: str) -> Message:
        return Message(
            message_id=f"{event.turn_id}-{seq}",
            context_id=task.context_id,
            task_id=task.id,
            role=Role.ROLE_AGENT,
            parts=[Part(text=text)],
        )

    if reason in _COMPLETED:
        artifact = _answer(task)
        held = "".join(p.text for p in artifact.parts) if artifact is not None else None
        message = None if held == event.content else say(event.content)
        return status_update(task, TaskState.TASK_STATE_COMPLETED, seq, event.ts, message)
    if reason == "ask_question":
        return status_update(
            task, TaskState.TASK_STATE_INPUT_REQUIRED, seq, event.ts, say(event.content)
        )
    why = f"{reason}: {event.error or event.content or reason}"
    if reason in _CANCELED:
        state = TaskState.TASK_STATE_CANCELED
    elif reason == "rejected":
        state = TaskState.TASK_STATE_REJECTED
    else:
        state = TaskState.TASK_STATE_FAILED
    return status_update(task, state, seq, event.ts, say(why))


class Projection:
    """A task and the events folded into it: ``seq`` is the sequence of the last event
    that changed it, ``ended`` whether its turn's ``loop_end`` is among them."""

    def __init__(self, task: Task, seq: int) -> None:
        self.task = task
        self.seq = seq
        self.end_ts = 0.0
        self._context = ServerCallContext()
        self._store = InMemoryTaskStore()
        self._manager = TaskManager(
            task_store=self._store,
            context=self._context,
            task_id=task.id,
            context_id=task.context_id,
            initial_message=None,
        )
        self._loaded = False

    @property
    def ended(self) -> bool:
        """Whether the task's turn has ended: every ``loop_end`` leaves it so."""
        return self.task.status.state not in RUNNING

    @property
    def turn(self) -> str:
        return str(loopmesh_of(self.task).get("turn", ""))

    async def apply(self, update: Update | Task) -> Task:
        """The task with ``update`` applied as the SDK applies it."""
        if not self._loaded:
            await self._store.save(self.task, self._context)
            self._loaded = True
        task = await self._manager.save_task_event(update)
        assert task is not None
        self.task = task
        return task

    async def step(self, seq: int, event: Event) -> Update | None:
        """Fold in ``event`` (sequence ``seq``); the update it made, if any."""
        if seq <= self.seq or self.ended or event.turn_id != self.turn:
            return None
        update = translate(self.task, event, seq)
        if isinstance(event, LoopEnd):
            self.end_ts = event.ts or time.time()
        if update is not None:
            await self.apply(update)
            self.seq = seq
        return update
