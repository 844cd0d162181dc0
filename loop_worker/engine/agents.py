"""A turn's named agent: its definition (``schemas.agents.AgentSpec``) over the
deployment's settings.

The engine looks the turn's agent up through the :class:`~.protocols.Agents` Protocol
(the durable service watches the agents bucket; :class:`StaticAgents` holds a fixed
list) and runs the turn with :func:`resolve`'s :class:`Agent`. What wins:

========================== =================================================================
setting                    who decides
========================== =================================================================
instructions               the agent's (else ``[loop] instructions``); the turn's own follow
model, orchestrator models the turn's, else the agent's, else ``[llm]`` / ``[loop]``
fallback models            the agent's, else ``[llm] fallback_models``
mode, limits               the turn's, else the agent's, else ``[loop]``
tools (allowlists)         every list that is set: ``[loop]``, the agent's, the turn's (the
                           most restrictive wins)
approval_tools             the agent's and ``[loop]``'s together (a call waits if either names it)
webhook                    the turn's, else the agent's (recorded in ``loop_start``)
memory                     the agent's, else ``[loop.memory] mode``
========================== =================================================================

The fallback models reach the LLM through :data:`TURN_FALLBACKS`, which the engine sets for
the turn's task: every LLM wrapper between the loop and ``OpenAILLM`` passes a call on
unchanged, so a per-turn chain needs no new argument through each of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas.agents import DEFAULT_AGENT, AgentSpec, default_agent

from .settings import LoopSettings

#: The fallback models of the running turn's agent (``None``: ``[llm] fallback_models``),
#: read by ``OpenAILLM.complete``.
TURN_FALLBACKS: ContextVar[tuple[str, ...] | None] = ContextVar("loopmesh_fallbacks", default=None)

#: Fields an agent sets over ``[loop]`` when it sets them (``None``: the deployment's).
_OVER_LOOP = (
    "instructions",
    "mode",
    "planner_model",
    "executor_model",
    "max_iterations",
    "deadline_s",
    "max_tool_calls",
    "max_parallel_tools",
    "tool_failure",
)


@dataclass(frozen=True)
class Agent:
    """A turn's agent, resolved: ``settings`` is ``[loop]`` with the agent's values,
    ``model`` the agent's model (else ``[llm] model``), ``tools`` its own allowlist."""

    spec: AgentSpec
    settings: LoopSettings
    model: str
    fallbacks: tuple[str, ...] | None
    tools: tuple[str, ...] | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def revision(self) -> int:
        return self.spec.revision


def resolve(spec: AgentSpec, settings: LoopSettings, model: str) -> Agent:
    """``spec`` over the deployment's ``settings`` and ``model`` (see the module's table)."""
    changes: dict[str, Any] = {
        field: value for field in _OVER_LOOP if (value := getattr(spec, field)) is not None
    }
    if spec.memory is not None:
        changes["memory"] = msgspec.structs.replace(settings.memory, mode=spec.memory)
    if spec.approval_tools:
        changes["approval_tools"] = tuple(
            dict.fromkeys((*settings.approval_tools, *spec.approval_tools))
        )
    return Agent(
        spec=spec,
        settings=msgspec.structs.replace(settings, **changes) if changes else settings,
        model=spec.model or model,
        fallbacks=spec.fallback_models,
        tools=spec.tools,
    )


class StaticAgents:
    """A fixed set of agents (:class:`~.protocols.Agents`), ``default`` among them unless
    one is given: the engine's when no agents are configured (tests, embedding)."""

    def __init__(self, specs: Iterable[AgentSpec] = ()) -> None:
        self.specs = {DEFAULT_AGENT: default_agent()}
        self.specs.update((s.name, s) for s in specs)

    async def agent(self, name: str) -> AgentSpec | None:
        return self.specs.get(name)

    def put(self, spec: AgentSpec) -> None:
        """Define ``spec`` (or change it): the next turn of it runs the new definition."""
        self.specs[spec.name] = spec
