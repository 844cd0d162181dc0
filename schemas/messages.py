"""Conversation state: chat messages, tool calls, plans and the session snapshot."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .types import Timestamp, Token
from .wire import ContentPart, WireError

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call as the model made it: OpenAI's shape, arguments as raw JSON text."""

    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One message of a conversation, in OpenAI chat-completions form."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    #: Images and files after ``content`` (a user message), as OpenAI content parts.
    parts: tuple[ContentPart, ...] = ()


PlanStatus = Literal["pending", "in_progress", "done", "skipped"]


class PlanStep(msgspec.Struct, frozen=True, kw_only=True):
    """One step of a plan. ``id`` and ``result`` are set by the orchestrator (``mode =
    "orchestrator"``): the step's id in the planner's plan and what its executor found,
    which the synthesis reads."""

    title: str
    status: PlanStatus = "pending"
    id: str = ""
    result: str = ""


OrchestratorPhase = Literal["execute", "synthesize", "fallback"]


class OrchestratorState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where an orchestrated turn is (``SessionSnapshot.orchestrator``), checkpointed
    with every step: the plan itself is ``SessionSnapshot.plan``.

    ``step``: the index of the step in progress; ``messages``: its executor's
    conversation so far (the step's pending calls are ``SessionSnapshot.pending``);
    ``attempt``: its failed attempts. ``fallback``: the turn went on in the ordinary
    loop after ``offset`` iterations of the orchestrator.
    """

    phase: OrchestratorPhase = "execute"
    step: int = 0
    messages: tuple[ChatMessage, ...] = ()
    attempt: int = 0
    offset: int = 0


class PendingCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tool call stored before it runs, as the loop read it from the model's reply.

    ``error`` is set when the loop refused the call (unknown tool, unreadable
    arguments), so a resumed turn refuses it again instead of running it.
    """

    id: str  # the call id: turn, iteration, index
    name: str  # as the model wrote it
    server: str = ""
    tool: str = ""
    arguments: dict[str, Any] | None = None
    error: WireError | None = None


SessionStatus = Literal["idle", "running", "paused"]


class TurnEnd(msgspec.Struct, frozen=True, kw_only=True):
    """How a turn ended: its ``loop_end`` event's fields, kept with the session's last
    checkpoint so that a redelivery which finds the turn done can emit its ``loop_end``
    again (it may not have been stored before a crash; its fixed msg id lets the stream
    drop a second copy)."""

    reason: str
    content: str = ""
    iterations: int = 0
    error: str | None = None


class SessionSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A session's durable state, checkpointed after every iteration.

    ``turn_id`` and ``iteration`` name the turn in progress and the last completed
    iteration, so a worker that picks up a redelivered turn resumes from here.
    ``pending`` holds the tool calls of iteration ``iteration + 1`` while they run (its
    assistant message is the last of ``messages``): a worker that resumes then re-issues
    them with the same call ids instead of asking the model again.
    """

    tenant: Token
    session: Token
    messages: tuple[ChatMessage, ...] = ()
    summary: str = ""
    plan: tuple[PlanStep, ...] = ()
    status: SessionStatus = "idle"
    turn_id: Token | None = None
    iteration: int = 0
    turns: int = 0
    updated_at: Timestamp = 0.0
    pending: tuple[PendingCall, ...] = ()
    #: The turn in progress: when it started (its deadline counts from here) and the
    #: tool calls it has made, so a resumed turn keeps counting against its limits.
    turn_started_at: Timestamp = 0.0
    turn_tool_calls: int = 0
    #: What the turn in progress spent on LLM calls: tokens, and their cost ([prices]).
    turn_tokens: int = 0
    turn_cost: float = 0.0
    #: An orchestrated turn in progress (``None`` for the ordinary loop).
    orchestrator: OrchestratorState | None = None
    #: How the turn ``turn_id`` ended, once ``status`` is idle (``None`` before).
    last_end: TurnEnd | None = None
    #: The named agent the session belongs to (``schemas.agents``), set by its first
    #: turn (or when the session was created): a turn naming another is refused.
    agent: Token = "default"
    #: The ids of the session's last turns that ended here (up to
    #: :data:`ENDED_TURNS_KEPT`), oldest first: the loop worker's store adds each turn
    #: as it checkpoints its end. A delivery of one of them after a later turn ran (a
    #: check of the turns stream that raced its ack) is acked without running again.
    ended_turns: tuple[Token, ...] = ()
    #: The LLM tokens of the session's ended turns (the turn in progress: ``turn_tokens``).
    tokens: int = 0


#: How many turn ids :attr:`SessionSnapshot.ended_turns` keeps.
ENDED_TURNS_KEPT = 16


class SessionMeta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a person set on a session (``POST``/``PATCH /v1/sessions``), stored beside its
    snapshot under :func:`~schemas.subjects.session_meta_key`, so a loop worker's
    checkpoint never races it. ``expired_at``: when retention kept the session as its
    last snapshot only (its events and the rest were erased)."""

    title: str = ""
    labels: dict[str, str] = {}
    created_at: Timestamp = 0.0
    expired_at: Timestamp = 0.0
