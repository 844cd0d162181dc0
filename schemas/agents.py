"""Named agents: what defines a turn of one, as the agents KV bucket stores it.

An agent is a name plus the settings a turn of it runs with. The bucket
(:attr:`~schemas.subjects.Subjects.agents_bucket`) holds one :class:`AgentSpec` per
agent under its name; provisioning writes them from the ``[[agents]]`` tables of the
configuration, and loop workers and gateways read them live. A turn names its agent
(``Turn.agent``); a session belongs to one (``SessionSnapshot.agent``).

A field left ``None`` takes the deployment's own setting (``[loop]`` or ``[llm]``) on the
loop worker that runs the turn, so the ``default`` agent, when no ``[[agents]]`` table
names it, is exactly today's ``[loop]``. Field names are those of ``[loop]`` and of
:class:`~schemas.wire.Turn`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .types import Token
from .webhook import Webhook
from .wire import LoopMode, ModelName, ToolFailureMode

#: The agent of a turn that names none in a session that has none yet.
DEFAULT_AGENT = "default"

#: A tool as an allowlist or ``approval_tools`` names it: ``server.tool``, or a bare
#: name (a tool of any server, or the function name the model sees).
TOOL_REF_PATTERN = r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64})?$"
ToolRef = Annotated[
    str,
    msgspec.Meta(
        pattern=TOOL_REF_PATTERN,
        description="`server.tool` or a bare tool name: 1-64 characters from A-Z a-z 0-9 _ - each",
    ),
]

MAX_DESCRIPTION_CHARS = 2_000
MAX_INSTRUCTIONS_CHARS = 64_000
MAX_NAMES = 256


class AgentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One agent, stored under its name in the agents bucket.

    ``revision`` is the bucket's revision of the entry: readers set it from the KV entry
    (what provisioning writes leaves it 0), and a turn's ``loop_start`` records it.
    """

    #: The agent's name (``default`` is the deployment's ``[loop]`` unless defined here).
    name: Token
    #: What the agent does, for agent cards and tool lists.
    description: Annotated[str, msgspec.Meta(max_length=MAX_DESCRIPTION_CHARS)] = ""
    #: First in the system prompt, instead of ``[loop] instructions``; a turn's own
    #: ``instructions`` still follow them.
    instructions: Annotated[str, msgspec.Meta(max_length=MAX_INSTRUCTIONS_CHARS)] | None = None
    #: The model, instead of ``[llm] model``; a turn's own ``model`` wins.
    model: ModelName | None = None
    #: Tried in order when ``model`` fails, instead of ``[llm] fallback_models``.
    fallback_models: Annotated[tuple[ModelName, ...], msgspec.Meta(max_length=16)] | None = None
    #: The tools its turns may call. It narrows ``[loop] tools`` and a turn's own list
    #: narrows it: a tool must be on every list that is set. ``None``: no list of its own.
    tools: Annotated[tuple[ToolRef, ...], msgspec.Meta(max_length=MAX_NAMES)] | None = None
    #: Tools whose calls wait for a person, besides those of ``[loop] approval_tools``.
    approval_tools: Annotated[tuple[ToolRef, ...], msgspec.Meta(max_length=MAX_NAMES)] = ()
    #: ``loop`` or ``orchestrator``, and the orchestrator's models (see ``[loop]``).
    mode: LoopMode | None = None
    #: The orchestrator's planner, instead of ``[loop] planner_model``.
    planner_model: ModelName | None = None
    #: The orchestrator's executor, instead of ``[loop] executor_model``.
    executor_model: ModelName | None = None
    #: Limits of its turns (see ``[loop]``); a turn's own limits win.
    max_iterations: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Wall-clock seconds per turn, instead of ``[loop] deadline_s``.
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: Tool calls per turn, instead of ``[loop] max_tool_calls``.
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Calls of one iteration run at once, instead of ``[loop] max_parallel_tools``.
    max_parallel_tools: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: ``continue`` or ``fail``, instead of ``[loop] tool_failure``.
    tool_failure: ToolFailureMode | None = None
    #: The agents it may call (by name): each must be defined.
    agents: Annotated[tuple[Token, ...], msgspec.Meta(max_length=MAX_NAMES)] = ()
    #: Where its turns' events are POSTed when a turn names no webhook of its own.
    webhook: Webhook | None = None
    #: Its memory across sessions: ``off``, ``tools`` (the ``memory.*`` tools) or
    #: ``auto`` (those, and the nearest memories recalled into each turn's prompt),
    #: instead of ``[loop.memory] mode``.
    memory: Literal["off", "tools", "auto"] | None = None
    #: Its sessions idle this long (seconds) expire, instead of ``[tenants]
    #: session_retention_s`` (0: they never do).
    session_retention_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    #: What expiring does to its sessions, instead of ``[tenants] retention``: ``delete``
    #: erases them, ``snapshot`` keeps their last snapshot only.
    retention: Literal["delete", "snapshot"] | None = None
    #: Its turns that run at once across the fleet, per tenant: a turn past the cap waits
    #: (``turn_queued`` with ``agent`` set) for one of them to end. Unset: no cap.
    max_active_turns: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: The agents bucket's revision of the definition: set by the bucket, refused in
    #: configuration.
    revision: Annotated[int, msgspec.Meta(ge=0)] = 0


def default_agent() -> AgentSpec:
    """The ``default`` agent where no definition names it: the deployment's ``[loop]``."""
    return AgentSpec(
        name=DEFAULT_AGENT,
        description="The deployment's default agent: its [loop] and [llm] settings.",
    )
