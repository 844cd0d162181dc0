"""The bodies the gateway reads and writes, as msgspec Structs.

``/openapi.json`` is generated from these types (see :mod:`gateway.openapi`), so the
documentation cannot drift from what the handlers decode and encode. Ids and lengths
are checked by the handlers (a hostile id is a 422 naming its field, a malformed body
a 400 with the path of the bad field), not by the types, so the two answers differ.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from starlette.responses import Response

from loopmesh.sessions import SessionSummary
from loopmesh.webhook import WebhookRequest
from schemas.agents import DEFAULT_AGENT, AgentSpec
from schemas.audit import SessionErased
from schemas.ids import TOKEN_PATTERN
from schemas.memory import MemorySource, MemoryText
from schemas.messages import ChatMessage, PlanStep, SessionStatus
from schemas.types import Token
from schemas.wire import MAX_PARTS, MAX_PASSAGES, ContentPart, Passage, ToolSpec

Id = Annotated[str, msgspec.Meta(description="1-64 characters from A-Z a-z 0-9 _ -")]
ToolName = Annotated[
    str, msgspec.Meta(description="a tool as `server.tool`, or a bare tool name (any server)")
]
PATH_ID_PATTERN = TOKEN_PATTERN


class _Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


#: A session's labels: up to 32, each key 1-64 characters from A-Z a-z 0-9 _ - . and
#: each value at most 256 characters (``GET /v1/sessions?label=key=value`` finds them).
Labels = Annotated[
    dict[str, str],
    msgspec.Meta(description="up to 32 labels: key 1-64 of A-Z a-z 0-9 _ - ., value <= 256"),
]
Title = Annotated[str, msgspec.Meta(description="at most 200 characters")]


class CreateSession(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Create a session; without ``session`` the gateway picks an id. ``agent``: the
    named agent the session belongs to (default ``default``); its turns run that agent.
    ``title`` and ``labels``: what lists and filters it (``PATCH`` changes them)."""

    session: Id | None = None
    agent: Id | None = None
    title: Title | None = None
    labels: Labels | None = None


class UpdateSession(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Change a session's ``title`` or ``labels`` (each given replaces what was; a
    field left out stays)."""

    title: Title | None = None
    labels: Labels | None = None


class PostTurn(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A user turn. ``tools`` limits the turn to these tools (default: every tool).
    ``mode``, ``planner_model`` and ``executor_model`` choose the dual-model
    orchestrator for this turn (default: the deployment's ``[loop]`` settings).
    ``context``: passages the client retrieved, for the prompt; ``parts``: images and
    files (OpenAI content parts) that go with the input. ``on_busy``: what to do when
    an earlier turn of the session has not ended (``enqueue``, ``reject``: answered 409,
    ``interrupt``, ``rollback``; default: the deployment's ``[loop] on_busy``).
    ``agent``: the named agent
    that runs it (default: the session's, ``default`` for a new session); a session
    belongs to one agent, and a turn naming another is refused by its loop worker with
    an ``error`` event. ``webhook``: where to POST the turn's events (``url``, https
    unless ``[webhooks] allow_http``; ``events``, default ``["loop_end"]``), signed with
    the deployment's secret; a URL whose host is not public (and not in ``[webhooks]
    allowlist``) is refused with 422 naming ``webhook.url``. ``user``: who the turn is
    for, the namespace of the memories its agent keeps of them (``[loop.memory]``).
    ``priority``: ``interactive`` (the default: a person waits) or ``batch`` (bulk work):
    loop workers take interactive turns of every tenant before batch ones."""

    input: str
    instructions: str | None = None
    model: str | None = None
    max_iterations: int | None = None
    tools: list[ToolName] | None = None
    mode: Literal["loop", "orchestrator"] | None = None
    planner_model: str | None = None
    executor_model: str | None = None
    context: Annotated[list[Passage], msgspec.Meta(max_length=MAX_PASSAGES)] | None = None
    parts: Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_PARTS)] | None = None
    on_busy: Literal["enqueue", "reject", "interrupt", "rollback"] | None = None
    agent: Id | None = None
    webhook: WebhookRequest | None = None
    user: Id | None = None
    priority: Literal["interactive", "batch"] = "interactive"


class CreateSchedule(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A schedule: ``input`` becomes a turn of ``agent`` at every tick of ``cron`` (five
    fields, minute hour day-of-month month day-of-week, or six with seconds first) in
    ``timezone`` (IANA). ``session``: every run goes to this session (created if new);
    ``null``: a new session per run. ``policy``, while the previous run has not ended:
    ``skip`` the tick, ``buffer_one`` (at most one run waits), ``allow`` (always fire).
    ``catch_up_s``: a tick missed while no scheduler ran fires when one comes back if
    it is at most this old. Without ``id`` the gateway picks one. ``priority``: the lane
    of its runs' turns, ``batch`` (the default) or ``interactive``."""

    id: Id | None = None
    cron: str
    timezone: str = "UTC"
    agent: Id | None = None
    session: Id | None = None
    input: str
    policy: Literal["skip", "buffer_one", "allow"] = "skip"
    catch_up_s: float = 3600.0
    priority: Literal["interactive", "batch"] = "batch"


class ControlRequest(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Cancel, pause or resume a session's running turn."""

    reason: str | None = None


class ApprovalRequest(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Approve or deny a pending tool call."""

    approve: bool
    reason: str | None = None


class SessionCreated(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    session: str
    agent: str = DEFAULT_AGENT


class SessionList(msgspec.Struct, frozen=True, kw_only=True):
    """A page of sessions, most recently active first; ``next_cursor``: pass it as
    ``cursor`` for the next page (``null``: this is the last)."""

    sessions: list[SessionSummary]
    next_cursor: str | None = None


class SessionErasedView(msgspec.Struct, frozen=True, kw_only=True):
    """What ``DELETE /v1/sessions/{session}`` erased: the session and the sessions of
    the agents it called (``children``), and how many stored messages went from where
    (``removed``). The erase is recorded on the tenant's audit subject."""

    session: str
    erased_at: float
    children: list[str]
    removed: dict[str, int]


class SessionView(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    session: str
    status: SessionStatus
    turn_id: str | None
    iteration: int
    turns: int
    updated_at: float
    messages: list[ChatMessage]
    plan: list[PlanStep]
    summary: str
    agent: str = DEFAULT_AGENT
    title: str = ""
    labels: dict[str, str] = {}
    tokens: int = 0


class AuditList(msgspec.Struct, frozen=True, kw_only=True):
    """The tenant's latest audit records, oldest first: each a session erased
    (``reason`` ``request``) or expired (``retention``; ``mode`` ``snapshot`` when its
    last snapshot was kept), by whom, with what it called and what was removed."""

    records: list[SessionErased]


class ForkSession(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fork a session: a new session holding it as it was at the end of ``at_turn``, or
    at the start of ``before_turn`` (name one of the two, a turn id). ``session``: the
    new session's id (default: one the gateway picks). The session forked is left as
    it is; no tool call runs again."""

    at_turn: Id | None = None
    before_turn: Id | None = None
    session: Id | None = None


class SessionForked(msgspec.Struct, frozen=True, kw_only=True):
    """The new session (``session``), made from ``source``: ``at_turn`` is the last
    turn it holds (``null``: none), ``turns`` every turn it holds, oldest first."""

    tenant: str
    session: str
    source: str
    agent: str = DEFAULT_AGENT
    at_turn: str | None = None
    turns: list[str] = []
    messages: int = 0


class RewindSession(_Request, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Take a session back to the start of ``before_turn``, or to the end of ``at_turn``
    (name one of the two, a turn id): the turns after that point are undone."""

    before_turn: Id | None = None
    at_turn: Id | None = None


class RanCallView(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call that ran (its side effect stays): ``status`` ``ok``, ``error``, or
    ``timeout`` (it may have run)."""

    call_id: str
    server: str = ""
    tool: str = ""
    status: str = "ok"


class SessionRewound(msgspec.Struct, frozen=True, kw_only=True):
    """The session now ends with ``to_turn`` (``null``: it is empty); ``undone``: the
    turns taken back, oldest first; ``calls``: their tool calls that ran."""

    tenant: str
    session: str
    to_turn: str | None = None
    undone: list[str] = []
    calls: list[RanCallView] = []
    messages: int = 0


class TurnPosted(msgspec.Struct, frozen=True, kw_only=True):
    """``events_url`` streams this turn's events from just before it was published."""

    turn_id: str
    session: str
    events_url: str


class ControlAccepted(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    type: str
    session: str
    call_id: str | None = None


class ToolList(msgspec.Struct, frozen=True, kw_only=True):
    tools: list[ToolSpec]


class UsageLineView(msgspec.Struct, frozen=True, kw_only=True):
    agent: str
    model: str
    calls: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    unpriced_calls: int = 0  # calls of a model with no price in [prices]
    cached_tokens: int = 0  # of prompt_tokens, read from the provider's prompt cache


class UsageDayView(msgspec.Struct, frozen=True, kw_only=True):
    day: str  # YYYY-MM-DD, UTC
    tokens: int
    cost: float
    lines: list[UsageLineView]
    cached_tokens: int = 0


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """The tenant's LLM usage per UTC day, agent and model, as counted from the events
    (``llm_response`` usage); ``cost`` from the deployment's ``[prices]``."""

    tenant: str
    days: list[UsageDayView]
    tokens: int
    cost: float
    calls: int
    cached_tokens: int = 0  # of the prompt tokens, read from the providers' prompt caches


class AgentList(msgspec.Struct, frozen=True, kw_only=True):
    """The named agents, ``default`` first. A field left ``null`` takes the deployment's
    ``[loop]`` / ``[llm]`` setting; ``revision`` is the agents bucket's (0: ``default``
    as ``[loop]`` defines it, not provisioned)."""

    agents: list[AgentSpec]


class MemoryView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A memory as ``/v1/memory`` shows it (without its vector)."""

    id: str
    kind: str  # user or agent
    name: str  # the user's id or the agent's name
    text: str
    created_at: float
    source: MemorySource | None = None


class MemoryList(msgspec.Struct, frozen=True, kw_only=True):
    memories: list[MemoryView]


class MemoryNew(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/memory``: a memory of ``user`` or of ``agent`` (one of the two)."""

    text: MemoryText
    user: Token | None = None
    agent: Token | None = None


class MemoryErased(msgspec.Struct, frozen=True, kw_only=True):
    erased: int


class ScheduleRunView(msgspec.Struct, frozen=True, kw_only=True):
    """A tick and what became of it: ``outcome`` ``fired`` (its turn ``turn_id`` was
    published to ``session``), ``skipped`` (``reason`` says why), ``buffered`` (waiting
    for the previous run), ``missed`` (``missed`` ticks older than the catch-up window)
    or ``lost``. ``end``: the turn's ``loop_end`` reason once it has ended (``null``
    before, and in lists)."""

    tick: float
    at: float
    outcome: str
    turn_id: str | None = None
    session: str | None = None
    published: bool = False
    reason: str = ""
    missed: int = 0
    end: str | None = None


class ScheduleView(msgspec.Struct, frozen=True, kw_only=True):
    """A schedule. ``session`` ``null``: a new session per run. ``next_tick``: when it
    fires next (``null`` while paused); ``explain``: the cron expression in words.
    ``runs``: the last runs, newest first (a list shows the last one only)."""

    id: str
    cron: str
    timezone: str
    agent: str
    session: str | None
    input: str
    policy: str
    catch_up_s: float
    priority: str = "batch"
    paused: bool
    created_at: float
    next_tick: float | None
    explain: str
    runs: list[ScheduleRunView]


class ScheduleList(msgspec.Struct, frozen=True, kw_only=True):
    schedules: list[ScheduleView]


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    code: str
    message: str
    field: str | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorDetail


class Health(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    status: str
    detail: str | None = None


#: ``GET /v1/events/latest``: events (``schemas.events``) with their stream sequence
#: added as ``seq`` (their session's stream's: with partitions, the tenant's sessions
#: are in several streams, merged by ``ts``; see :meth:`Backend.latest_events`).
LatestEvents = Annotated[
    list[dict[str, Any]],
    msgspec.Meta(
        description="events, oldest first (by `ts` across partitions), each with the "
        "sequence in its session's events stream as `seq`"
    ),
]


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` (a Struct of this module, or plain data) as a JSON response."""
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


# -- POST /mcp: JSON-RPC 2.0, as the MCP specification defines it (docs/AGENTS.md) -----


class JsonRpcMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One MCP message: a request (with ``id``; ``tools/list``, ``tools/call``, ...) or
    a notification (without). Send ``Accept: application/json, text/event-stream``."""

    jsonrpc: Literal["2.0"]
    method: str
    id: int | str | None = None
    params: dict[str, Any] | None = None


# -- A2A (docs/AGENTS.md): described here for /openapi.json; the SDK reads and writes them


class A2AAgentCard(msgspec.Struct, frozen=True, kw_only=True):
    """An A2A agent card (protocol 1.0, in the protocol's JSON: camelCase names)."""

    name: str
    description: str = ""
    version: str = ""
    supportedInterfaces: list[dict[str, Any]] = []
    capabilities: dict[str, Any] = {}
    securitySchemes: dict[str, Any] = {}
    securityRequirements: list[dict[str, Any]] = []
    defaultInputModes: list[str] = []
    defaultOutputModes: list[str] = []
    skills: list[dict[str, Any]] = []


class JsonRpcRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A JSON-RPC 2.0 request of A2A: ``method`` one of ``SendMessage``,
    ``SendStreamingMessage``, ``GetTask``, ``ListTasks``, ``CancelTask``,
    ``SubscribeToTask``, ``CreateTaskPushNotificationConfig``,
    ``GetTaskPushNotificationConfig``, ``ListTaskPushNotificationConfigs``,
    ``DeleteTaskPushNotificationConfig``; send ``A2A-Version: 1.0``."""

    jsonrpc: str
    method: str
    id: str | int | None = None
    params: dict[str, Any] = {}


class JsonRpcError(msgspec.Struct, frozen=True, kw_only=True):
    code: int
    message: str
    data: Any = None


class JsonRpcAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A request's answer: its ``result``, or an ``error`` (``id`` null when the
    request was refused before its id was read: no key, a body that is not JSON-RPC)."""

    jsonrpc: Literal["2.0"]
    id: int | str | None
    result: dict[str, Any] | None = None


class JsonRpcResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Its result or its error (the two streaming methods answer an SSE stream of
    these instead)."""

    jsonrpc: str
    id: str | int | None = None
    result: Any = None
    error: JsonRpcError | None = None
