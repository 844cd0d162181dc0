"""Messages that travel between services: turns, tool calls and their results,
tool specs for the catalog, and control messages."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .ids import turn_msg_id
from .types import SCHEMA_VERSION, Parent, Priority, Timestamp, Token
from .webhook import Webhook


class WireError(msgspec.Struct, frozen=True, kw_only=True):
    """An error that crosses the wire: a stable code and a message a person can act on.

    Codes: ``invalid_arguments``, ``unknown_tool``, ``timeout``, ``tool_exception``,
    ``mcp_error``, ``circuit_open``, ``cancelled``, ``unavailable``, ``rejected``,
    ``invalid_request``, ``invalid_call_id``.
    """

    code: str
    message: str


ToolFailureMode = Literal["continue", "fail"]
LoopMode = Literal["loop", "orchestrator"]
#: What a turn does when it arrives while an earlier turn of its session still runs.
OnBusy = Literal["enqueue", "reject", "interrupt", "rollback"]
#: How a cancel stops a turn: ``cancel`` at once (calls in flight are abandoned);
#: ``interrupt`` at its next safe point (never between a tool call and its record);
#: ``rollback`` as ``interrupt``, and the session returns to its snapshot from before
#: the turn began.
CancelMode = Literal["cancel", "interrupt", "rollback"]
#: A model name as an OpenAI-compatible server takes it (``org/model:tag`` and the like).
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^\S+$")]

#: Bounds of what a turn may carry besides its input.
MAX_PASSAGES = 32
MAX_PASSAGE_CHARS = 16_000
MAX_PARTS = 16
MAX_PART_CHARS = 8 * 2**20  # a data: URL; the NATS max payload is the real bound


class Passage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of retrieved context: its text and where it came from (a URL, a
    document id), shown to the model in the prompt's retrieved-context section."""

    text: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PASSAGE_CHARS)]
    source: Annotated[str, msgspec.Meta(max_length=2_000)] | None = None


class ImageURL(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    #: an http(s) URL the model's provider fetches, or a ``data:image/...`` URL
    url: Annotated[
        str, msgspec.Meta(pattern=r"^(https?://|data:image/)", max_length=MAX_PART_CHARS)
    ]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(msgspec.Struct, frozen=True, kw_only=True, tag="image_url", tag_field="type"):
    """An image, as OpenAI's ``image_url`` content part."""

    image_url: ImageURL


DataURL = Annotated[
    str, msgspec.Meta(pattern=r"^data:[^,]{0,200};base64,", max_length=MAX_PART_CHARS)
]


class FileRef(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    file_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    #: a ``data:<media type>;base64,...`` URL
    file_data: (
        Annotated[
            str, msgspec.Meta(pattern=r"^data:[^,]{0,200};base64,", max_length=MAX_PART_CHARS)
        ]
        | None
    ) = None
    filename: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None

    def __post_init__(self) -> None:
        if (self.file_id is None) == (self.file_data is None):
            raise ValueError("a file part needs exactly one of file.file_id and file.file_data")


class FilePart(msgspec.Struct, frozen=True, kw_only=True, tag="file", tag_field="type"):
    """A file (a PDF, say), as OpenAI's ``file`` content part."""

    file: FileRef


#: Content parts beside a turn's text input, passed to models that take them.
ContentPart = ImagePart | FilePart


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """A user turn, published to ``<prefix>.turns.<tenant>.<session>`` (``.batch`` after
    it for a batch turn: :attr:`priority`).

    The subject is authoritative: ``tenant`` and ``session`` must repeat its tokens, and
    ``v`` must be a schema version the worker knows, or the turn is refused with an
    ``error`` event on the subject's session (see :mod:`schemas.admit`). Publish it with
    ``Nats-Msg-Id`` = :attr:`msg_id` (``<tenant>.<session>.<id>``), so publishing the
    same turn twice is deduplicated and two tenants' turns ``t1`` are not.
    """

    v: int = SCHEMA_VERSION
    id: Token
    tenant: Token
    session: Token
    input: str
    created_at: Timestamp = 0.0
    instructions: str | None = None
    model: str | None = None
    max_iterations: int | None = None
    metadata: dict[str, str] = {}
    #: The tools this turn may call, as ``server.tool`` or a bare tool name (any
    #: server); ``None`` allows every tool in the catalog.
    tools: tuple[str, ...] | None = None
    #: Limits of this turn; ``None`` takes the deployment's ``[loop]`` default.
    #: Wall-clock seconds from the turn's start to its end (reason ``deadline``).
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: Tool calls (run by tool workers) the whole turn may make (reason ``max_tool_calls``).
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Tool calls of one iteration that run at once; the rest queue.
    max_parallel_tools: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: ``continue``: a failed tool call's error goes to the model; ``fail``: the turn
    #: ends with reason ``tool_failed``.
    tool_failure: ToolFailureMode | None = None
    #: ``orchestrator``: a planner model plans, an executor model runs each step, the
    #: planner writes the answer; ``loop``: the single-model loop. ``None``: ``[loop] mode``.
    mode: LoopMode | None = None
    #: The orchestrator's models for this turn; ``None``: ``[loop] planner_model`` /
    #: ``executor_model``, then the turn's ``model``.
    planner_model: ModelName | None = None
    executor_model: ModelName | None = None
    #: Passages the client already retrieved, shown in the prompt's retrieved-context
    #: section (a deployment's retriever may add more: ``[loop] retriever``).
    context: Annotated[tuple[Passage, ...], msgspec.Meta(max_length=MAX_PASSAGES)] = ()
    #: Images and files that go with ``input`` (OpenAI content parts), passed to the model.
    parts: Annotated[tuple[ContentPart, ...], msgspec.Meta(max_length=MAX_PARTS)] = ()
    #: When an earlier turn of the session has not ended yet: ``enqueue`` (wait for
    #: it), ``reject`` (refused: an ``error`` event, code ``session_busy``, and a
    #: ``loop_end``, reason ``rejected``), ``interrupt`` (every earlier turn that has
    #: not ended, running or waiting its order, stops at its next safe point, or at its
    #: start, reason ``interrupted``, and this one starts from what they left) or
    #: ``rollback`` (the same, and the session returns to its snapshot from before the
    #: interrupted turns began). ``None``: ``[loop] on_busy``.
    on_busy: OnBusy | None = None
    #: The named agent this turn runs (``schemas.agents``): its definition applies, with
    #: this turn's own fields above on top. ``None``: the session's agent (``default``
    #: for a new session). A session belongs to one agent: a turn naming another is
    #: refused with an ``error`` event and its ``loop_end``, and so is an unknown name.
    agent: Token | None = None
    #: On a child turn (an agent that another agent's turn called as a tool): the calling
    #: turn and call; ``chain``: the agents above it, the first caller first (a callee
    #: already in it is refused: a cycle).
    parent: Parent | None = None
    chain: Annotated[tuple[Token, ...], msgspec.Meta(max_length=16)] = ()
    #: Who the turn is for, as the deployment names its users: the namespace of the
    #: memories its agent keeps of them (``[loop.memory]``). ``None``: the agent's own.
    user: Token | None = None
    #: Where to POST this turn's events (``schemas.webhook``); ``None``: its agent's
    #: webhook, if its definition names one. The URL is checked when the turn is
    #: accepted; a turn whose URL is refused gets an ``error`` event (code
    #: ``invalid_webhook``) and its ``loop_end``.
    webhook: Webhook | None = None
    #: Its lane: ``interactive`` turns are pulled before ``batch`` ones (scheduled,
    #: bulk), the session's order kept across both. A batch turn is published to
    #: ``<prefix>.turns.<tenant>.<session>.batch``, and the subject is authoritative: a
    #: body whose priority differs from its subject's lane is refused
    #: (``subject_mismatch``).
    priority: Priority = "interactive"

    @property
    def msg_id(self) -> str:
        """``<tenant>.<session>.<id>``: the ``Nats-Msg-Id`` to publish it with, and the
        key of its calls, events and bookkeeping."""
        return turn_msg_id(self.tenant, self.session, self.id)


class ToolCallRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call, published to ``<prefix>.tools.<pool>.<server>.<tool>``.

    ``call_id`` is deterministic (tenant, session, turn, iteration, index: see
    :func:`schemas.ids.call_id`; a tool worker refuses one that is not this request's
    own, :func:`schemas.ids.check_call_id`) and is the ``Nats-Msg-Id``
    and the key of the call's effect record: a repeated call returns the recorded
    result instead of running again. ``reply_to`` is the requester's inbox.
    ``first_attempt`` says nobody asked for this call before (a turn's first run, by a
    worker whose session lease has not lapsed): the first delivery of such a request
    cannot have a recorded effect, so the tool worker runs it without reading the
    record first. Leave it false when unsure; the read then happens, as it always does
    on a redelivery.
    """

    call_id: Token
    tenant: Token
    session: Token
    turn_id: Token
    iteration: int = 0
    server: Token
    tool: Token
    arguments: dict[str, Any] = {}
    timeout_s: float | None = None
    reply_to: str | None = None
    created_at: Timestamp = 0.0
    first_attempt: bool = False


ToolStatus = Literal["ok", "error", "timeout"]


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of a tool call: the reply to the requester and the effect record."""

    call_id: Token
    status: ToolStatus = "ok"
    content: str = ""
    error: WireError | None = None
    server: str = ""
    tool: str = ""
    duration_ms: float = 0.0
    worker: str = ""
    finished_at: Timestamp = 0.0


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A tool as the catalog lists it under ``<server>.<tool>``."""

    server: Token
    name: Token
    description: str = ""
    input_schema: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    pool: Token = "default"
    timeout_s: float = 30.0
    needs_approval: bool = False
    title: str | None = None
    updated_at: Timestamp = 0.0
    #: The pool is provisioned to outlive its workers (it may scale to zero): the entry
    #: was put with ``Nats-TTL: never`` and stays offered until it is deleted.
    pinned: bool = False


# -- control ----------------------------------------------------------------------------


class _Control(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Published to ``<prefix>.control.<tenant>.<session>``; the subject is
    authoritative, as for :class:`Turn`."""

    v: int = SCHEMA_VERSION
    tenant: Token
    session: Token
    turn_id: Token | None = None
    at: Timestamp = 0.0


class Cancel(_Control, tag="cancel", frozen=True, kw_only=True):
    """Stop the turn ``turn_id`` (or, naming none, the turns created before ``at``).
    ``mode``: see :data:`CancelMode`; ``by_turn``: the turn that interrupted it."""

    reason: str = ""
    mode: CancelMode = "cancel"
    by_turn: Token | None = None


class Pause(_Control, tag="pause", frozen=True, kw_only=True):
    pass


class Resume(_Control, tag="resume", frozen=True, kw_only=True):
    pass


class ApprovalDecision(_Control, tag="approval", frozen=True, kw_only=True):
    call_id: Token
    approved: bool
    reason: str = ""


Control = Cancel | Pause | Resume | ApprovalDecision
