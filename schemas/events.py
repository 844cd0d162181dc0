"""Events: one tagged union (``type``) published to ``<prefix>.events.<tenant>.<session>.<type>``.

Every event carries the schema version, tenant, session, turn id, iteration and a
timestamp. The stream sequence is an event's id for readers that resume.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import msgspec

from .messages import PlanStep
from .types import SCHEMA_VERSION, Timestamp, Token


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = SCHEMA_VERSION
    tenant: Token
    session: Token
    turn_id: Token
    iteration: int = 0
    ts: Timestamp = 0.0

    @property
    def type(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TurnAccepted(Event, tag="turn_accepted", frozen=True, kw_only=True):
    input: str = ""


class LoopStart(Event, tag="loop_start", frozen=True, kw_only=True):
    max_iterations: int = 0
    model: str = ""
    resumed: bool = False
    worker: str = ""


class LoopIteration(Event, tag="loop_iteration", frozen=True, kw_only=True):
    max_iterations: int = 0


class LLMRequest(Event, tag="llm_request", frozen=True, kw_only=True):
    model: str = ""
    attempt: int = 1
    messages: int = 0
    tokens: int = 0
    tools: int = 0


class LLMResponse(Event, tag="llm_response", frozen=True, kw_only=True):
    model: str = ""
    content: str = ""
    tool_calls: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    latency_ms: float = 0.0


class ThinkingStart(Event, tag="thinking_start", frozen=True, kw_only=True):
    pass


class ThinkingDelta(Event, tag="thinking_delta", frozen=True, kw_only=True):
    text: str = ""


class ThinkingEnd(Event, tag="thinking_end", frozen=True, kw_only=True):
    text: str = ""


class ContentDelta(Event, tag="content_delta", frozen=True, kw_only=True):
    text: str = ""


class Message(Event, tag="message", frozen=True, kw_only=True):
    role: str = "assistant"
    content: str = ""


class ToolCallEvent(Event, tag="tool_call", frozen=True, kw_only=True):
    call_id: str
    server: str = ""
    tool: str = ""
    arguments: dict[str, Any] = {}


class ToolResultEvent(Event, tag="tool_result", frozen=True, kw_only=True):
    call_id: str
    server: str = ""
    tool: str = ""
    content: str = ""
    truncated: bool = False
    duration_ms: float = 0.0
    worker: str = ""  # the tool worker that ran the call


class ToolErrorEvent(Event, tag="tool_error", frozen=True, kw_only=True):
    call_id: str
    server: str = ""
    tool: str = ""
    code: str = ""
    message: str = ""
    worker: str = ""  # the tool worker that reported it; empty when the loop refused the call


class ToolTimeout(Event, tag="tool_timeout", frozen=True, kw_only=True):
    call_id: str
    server: str = ""
    tool: str = ""
    timeout_s: float = 0.0


class NoToolCall(Event, tag="no_tool_call", frozen=True, kw_only=True):
    content: str = ""


class PlanUpdate(Event, tag="plan_update", frozen=True, kw_only=True):
    plan: tuple[PlanStep, ...] = ()


class ContextBudget(Event, tag="context_budget", frozen=True, kw_only=True):
    tokens: int = 0
    budget: int = 0
    messages: int = 0


class MemoryPruned(Event, tag="memory_pruned", frozen=True, kw_only=True):
    removed: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    summary: str = ""


class ApprovalRequired(Event, tag="approval_required", frozen=True, kw_only=True):
    call_id: str
    server: str = ""
    tool: str = ""
    arguments: dict[str, Any] = {}
    timeout_s: float = 0.0


class ApprovalDecided(Event, tag="approval_decision", frozen=True, kw_only=True):
    call_id: str
    approved: bool = False
    reason: str = ""


class Question(Event, tag="question", frozen=True, kw_only=True):
    text: str = ""


class Retry(Event, tag="retry", frozen=True, kw_only=True):
    what: str = "llm"
    attempt: int = 1
    reason: str = ""
    delay_s: float = 0.0
    model: str = ""


class Paused(Event, tag="paused", frozen=True, kw_only=True):
    pass


class Resumed(Event, tag="resumed", frozen=True, kw_only=True):
    pass


EndReason = Literal[
    "task_completion",
    "ask_question",
    "converse",
    "max_iterations",
    "cancelled",
    "circuit_open",
    "forced_summary",
    "llm_failed",
    "budget_exceeded",
    "error",
]


class LoopEnd(Event, tag="loop_end", frozen=True, kw_only=True):
    reason: EndReason
    content: str = ""
    iterations: int = 0
    error: str | None = None


class Error(Event, tag="error", frozen=True, kw_only=True):
    code: str = ""
    message: str = ""
    fatal: bool = False


AnyEvent = (
    TurnAccepted
    | LoopStart
    | LoopIteration
    | LLMRequest
    | LLMResponse
    | ThinkingStart
    | ThinkingDelta
    | ThinkingEnd
    | ContentDelta
    | Message
    | ToolCallEvent
    | ToolResultEvent
    | ToolErrorEvent
    | ToolTimeout
    | NoToolCall
    | PlanUpdate
    | ContextBudget
    | MemoryPruned
    | ApprovalRequired
    | ApprovalDecided
    | Question
    | Retry
    | Paused
    | Resumed
    | LoopEnd
    | Error
)


def tool_event_msg_id(call_id: str, type: str) -> str:
    """The ``Nats-Msg-Id`` of a call's ``tool_result`` / ``tool_error`` / ``tool_timeout``.

    Both the tool worker that ran the call and the engine that awaited it publish this
    event; the shared id lets JetStream keep one.
    """
    return f"{call_id}:{type}"


EVENT_TYPES: tuple[type[Event], ...] = typing.get_args(AnyEvent)

#: Every event type name, in the order above.
EVENT_NAMES: tuple[str, ...] = tuple(
    t.__struct_config__.tag  # type: ignore[misc]
    for t in EVENT_TYPES
)
