"""Conversation state: chat messages, tool calls, plans and the session snapshot."""

from __future__ import annotations

from typing import Literal

import msgspec

from .types import Timestamp, Token

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


PlanStatus = Literal["pending", "in_progress", "done", "skipped"]


class PlanStep(msgspec.Struct, frozen=True, kw_only=True):
    title: str
    status: PlanStatus = "pending"


SessionStatus = Literal["idle", "running", "paused"]


class SessionSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A session's durable state, checkpointed after every iteration.

    ``turn_id`` and ``iteration`` name the turn in progress and the last completed
    iteration, so a worker that picks up a redelivered turn resumes from here.
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
