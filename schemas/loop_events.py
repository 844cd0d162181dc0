"""The events of a turn's run, from its acceptance to its ``loop_end``: the loop and its
iterations, the LLM's requests and streamed replies, tool calls and their results,
approvals, the plan, memory, hooks, pauses, and how a turn ends (:data:`EndReason`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .event import Event, Usage
from .messages import PlanStep
from .webhook import Webhook


class TurnAccepted(Event, tag="turn_accepted", frozen=True, kw_only=True):
    input: str = ""


class TurnQueued(Event, tag="turn_queued", frozen=True, kw_only=True):
    """A turn that waits for a loop worker: the gateway accepted it behind ``ahead`` turns
    of its tenant that no loop worker holds yet (the tenant is at its ``[tenants]
    max_active_turns``, or the fleet is busy). Its ``turn_accepted`` follows when a
    loop worker takes it.

    ``cap`` set: a loop worker holds the turn, and it waits for one of the running turns
    that count in a cap to end: ``agent``, its agent's (``[[agents]] max_active_turns``,
    the agent named in ``agent``); ``tenant``, its tenant's (``[tenants."<name>"]
    max_active_turns``, both lanes together). ``ahead`` is 0 then."""

    ahead: int = 0
    agent: str = ""
    cap: Literal["", "agent", "tenant"] = ""


class LoopStart(Event, tag="loop_start", frozen=True, kw_only=True):
    """``agent`` and ``agent_revision``: the named agent whose definition runs the turn,
    and the agents bucket's revision of it (0: the ``default`` agent, not provisioned).
    ``webhook``: where the turn's events are POSTed (the turn's, else its agent's), read
    by the webhooks service."""

    max_iterations: int = 0
    model: str = ""
    resumed: bool = False
    worker: str = ""
    agent: str = "default"
    agent_revision: int = 0
    webhook: Webhook | None = None


class LoopIteration(Event, tag="loop_iteration", frozen=True, kw_only=True):
    max_iterations: int = 0


class ToolSelection(msgspec.Struct, frozen=True, kw_only=True):
    """Why these tools were offered (the tool pre-filter, ``[loop.prefilter]``):
    ``method`` ``embeddings`` (cosine similarity), ``bm25`` (lexical) or ``all`` (the
    catalog fits in ``top_k``); ``candidates``: the tools ranked (the loop's own are
    never ranked); ``scores``: each offered tool's, by ``server.tool``; ``note``: why
    it fell back to BM25, if it did."""

    method: str = ""
    top_k: int = 0
    candidates: int = 0
    scores: dict[str, float] = {}
    note: str = ""


class LLMRequest(Event, tag="llm_request", frozen=True, kw_only=True):
    """``offered``: the function names of the tools offered, when the pre-filter
    chose them (empty: all ``tools`` of the catalog); ``selection``: how it chose."""

    model: str = ""
    attempt: int = 1
    messages: int = 0
    tokens: int = 0
    tools: int = 0
    offered: tuple[str, ...] = ()
    selection: ToolSelection | None = None


class LLMResponse(Event, tag="llm_response", frozen=True, kw_only=True):
    """``by_hook``: a ``before_llm`` hook gave this reply and the model was not asked
    (no ``llm_request`` precedes it)."""

    model: str = ""
    content: str = ""
    tool_calls: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    latency_ms: float = 0.0
    by_hook: bool = False


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
    """``budget``: the tokens the prompt may use, the context budget less
    ``reply_reserve`` (kept for the model's reply)."""

    tokens: int = 0
    budget: int = 0
    messages: int = 0
    reply_reserve: int = 0


class MemoryPruned(Event, tag="memory_pruned", frozen=True, kw_only=True):
    removed: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    summary: str = ""


class ApprovalRequired(Event, tag="approval_required", frozen=True, kw_only=True):
    """A call waits for a person. ``call_session``: set when the call is a called
    agent's (a child turn's), announced here in the calling turn's session too; the
    decision goes to that session (``POST /v1/sessions/<call_session>/approvals/...``)."""

    call_id: str
    server: str = ""
    tool: str = ""
    arguments: dict[str, Any] = {}
    timeout_s: float = 0.0
    call_session: str | None = None


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


class Retract(Event, tag="retract", frozen=True, kw_only=True):
    """Take back text already streamed: the reply it belonged to was discarded.

    A reader drops every ``content_delta`` and ``thinking_delta`` of this event's
    ``iteration`` that it received *before* this event (they all belong to the discarded
    reply), and keeps the deltas that come after it (a new attempt, streamed from the
    start). Nothing else is taken back: ``tool_call``, ``message`` and ``loop_end``
    events are never retracted, and the turn's answer is only ever a ``message`` or
    ``loop_end.content``, never the deltas.

    ``reason``: ``retry`` (the LLM call failed mid-stream and is made again),
    ``nudge`` (the reply called no tool and the loop asked the model again, so the
    reply is not the answer). ``chars``: how many characters of content the dropped
    deltas held, for a reader to check it dropped what the loop meant.
    """

    reason: str = ""
    chars: int = 0


class HookErrorEvent(Event, tag="hook_error", frozen=True, kw_only=True):
    """An operator's hook raised. ``hook``: which (object and method); ``message``:
    what it raised; ``fatal``: the turn ends because of it (a ``before_turn`` hook)."""

    hook: str = ""
    message: str = ""
    fatal: bool = False


class OrchestratorFallback(Event, tag="orchestrator_fallback", frozen=True, kw_only=True):
    """An orchestrated turn (``mode = "orchestrator"``) goes on in the ordinary
    single-model loop, with the finished steps' results in its prompt.

    ``reason``: ``plan_unparseable`` (the planner's reply is no valid plan),
    ``plan_failed`` (the planner could not be reached), ``step_failed`` (a step failed
    past its retries; ``step`` names it) or ``synthesis_failed``. ``message`` says why
    in words; ``finished``: how many steps had finished.
    """

    reason: str = ""
    message: str = ""
    step: str = ""
    finished: int = 0


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
    "deadline",
    "max_tool_calls",
    "tool_failed",
    "interrupted",
    "rejected",
    "budget",
]

#: The reasons a turn ends with an answer (its ``loop_end`` content: a caller's result,
#: the CLI's success, the NATS Agent Protocol's and MCP's reply): the task done, a reply,
#: or a question back. Every other reason is a failure (a limit, an error, a cancel).
ANSWERED: frozenset[EndReason] = frozenset({"task_completion", "converse", "ask_question"})


class LoopEnd(Event, tag="loop_end", frozen=True, kw_only=True):
    reason: EndReason
    content: str = ""
    iterations: int = 0
    error: str | None = None


class Error(Event, tag="error", frozen=True, kw_only=True):
    code: str = ""
    message: str = ""
    fatal: bool = False


class PayloadTruncated(Event, tag="payload_truncated", frozen=True, kw_only=True):
    """A message was larger than the NATS server's ``max_payload`` and was cut to fit
    (never dropped): its longest texts end with a ``[cut by loopmesh: ...]`` marker.

    ``what``: the message cut, an event type (``llm_response``, ``message``,
    ``loop_end``...) or ``tool_result`` (the result of call ``call_id``, as its effect
    record, its reply and its event hold it). ``fields``: the paths of the texts cut;
    ``size``: the encoded bytes before, ``kept`` after; ``max_payload``: the server's.
    """

    what: str = ""
    call_id: str = ""
    fields: tuple[str, ...] = ()
    size: int = 0
    kept: int = 0
    max_payload: int = 0


class BudgetReached(Event, tag="budget_reached", frozen=True, kw_only=True):
    """The turn's next LLM call would pass a spending ceiling (``[loop.budget]``), so the
    turn ends (``loop_end`` reason ``budget``). ``ceiling``: ``turn_tokens``,
    ``turn_cost``, ``tenant_daily_tokens`` or ``tenant_daily_cost``; ``limit``: its
    value; ``spent``: what was spent against it; ``needed``: what the call would add;
    ``over``: by how much it would pass; ``message`` says all that in words."""

    ceiling: str = ""
    limit: float = 0.0
    spent: float = 0.0
    needed: float = 0.0
    over: float = 0.0
    message: str = ""
