"""The agent loop: prompt → LLM → parse → tools → checkpoint, until something ends it.

:class:`Engine` is pure: the LLM, the tools, the event stream and the session store
are the Protocols of ``protocols.py``. ``run`` takes one turn to its end and emits
exactly one ``loop_end`` (a turn that had already finished emits its ``loop_end`` again,
from the last checkpoint, and nothing else). A turn whose snapshot says it is still running resumes
after its last checkpointed iteration.

Checkpoints: when the turn starts, after every iteration, and once more in the middle
of an iteration that calls tools: the assistant message and its calls are stored
(``SessionSnapshot.pending``) *before* the calls run. A worker that resumes from that
checkpoint re-issues exactly those calls, with the same call ids (the dispatcher
returns the results of those that finished), and does not ask the model again: a
different reply would otherwise be paired with the recorded results of other calls.

Agents: a turn runs as its named agent (``Turn.agent``, else its session's), whose
definition :mod:`.agents` applies over the settings. A session belongs to one agent;
a turn naming another, or an agent nobody defined, is refused before anything is
checkpointed (an ``error`` event and its ``loop_end``), so the session keeps its state.

A cancelled ``run`` *task* (a worker shutting down) is not the end of the turn: it
leaves the snapshot "running" for another worker to resume. Cancelling the turn itself
goes through :class:`~loop_worker.engine.control.TurnControl`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from loopmesh.settings import Price
from schemas import DEFAULT_AGENT, AgentSpec, SessionSnapshot, Turn
from schemas.events import Error, LoopEnd

from .agents import TURN_FALLBACKS, Agent, StaticAgents, resolve
from .budget import UsageToday
from .control import TurnControl
from .hooks import Hooks, Retriever
from .prefilter import Prefilter
from .prompt import load_prompts
from .protocols import (
    LLM,
    AgentCalls,
    Agents,
    EventSink,
    SessionStore,
    ToolDispatcher,
    ToolSelector,
    all_tools,
)
from .ratelimit import TURN_TENANT
from .run import TurnRun, describe, ended_again
from .scope import TurnScope
from .settings import LLMSettings, LoopSettings
from .tokens import TokenCounter


class Engine:
    def __init__(
        self,
        *,
        settings: LoopSettings,
        llm: LLM,
        tools: ToolDispatcher,
        events: EventSink,
        store: SessionStore,
        hooks: Hooks | None = None,
        counter: TokenCounter | None = None,
        model: str = "",
        clock: Callable[[], float] = time.time,
        fallback_message: str | None = None,
        worker: str = "",
        select_tools: ToolSelector | None = None,
        prefilter: Prefilter | None = None,
        prices: Mapping[str, Price] | None = None,
        usage: UsageToday | None = None,
        agents: Agents | None = None,
        agent_calls: AgentCalls | None = None,
    ) -> None:
        self.settings = settings
        #: What models' tokens cost ([prices]) and the tenants' spend today, for the
        #: budgets ([loop.budget]; without ``usage`` the daily ceilings are not checked).
        self.prices: Mapping[str, Price] = prices or {}
        self.usage = usage
        #: The named agents' definitions (``None``: only ``default``, the settings above).
        self.agents: Agents = agents if agents is not None else StaticAgents()
        #: How a turn runs the agents its agent calls (``None``: it cannot call any).
        self.agent_calls = agent_calls
        self._agents: dict[AgentSpec, Agent] = {}
        self.llm = llm
        self.tools = tools
        self.events = events
        self.store = store
        self.hooks = hooks if hooks is not None else Hooks.from_paths(settings.hooks)
        if settings.retriever:
            self.hooks = Hooks([*self.hooks.hooks, Retriever(settings.retriever)])
        self.counter = counter
        self._counters: dict[str | None, TokenCounter] = {}  # one per model, shared by turns
        self.model = model
        self.clock = clock
        self.prompts = load_prompts()
        self.fallback_message = fallback_message or LLMSettings().fallback_message
        self.worker = worker
        #: The tool pre-filter (``[loop.prefilter]``); ``None`` when it is off. Its
        #: ``select_tools(query, tools)`` narrows any list of tools, one plan step's say.
        self.prefilter = prefilter
        if prefilter is None and settings.prefilter.enabled:
            self.prefilter = Prefilter.from_settings(settings.prefilter)
        # the orchestrator's per-step tools: the pre-filter's choice when it is on
        if select_tools is None and self.prefilter is not None:
            select_tools = self.prefilter
        self.select_tools = select_tools or all_tools

    def counter_for(self, model: str | None) -> TokenCounter:
        """A token counter for one turn of ``model``. Its per-message cache is shared
        by every turn, so what one turn counted (the system prompt, the history) is
        not tokenised again by the next; its history memo is its own, so concurrent
        sessions do not displace each other's."""
        if self.counter is not None:
            return self.counter
        counter = self._counters.get(model)
        if counter is None:
            counter = self._counters[model] = TokenCounter(model)
        return counter.fork()

    def agent_for(self, spec: AgentSpec) -> Agent:
        """``spec`` resolved over this engine's settings (``agents.resolve``), kept for
        the turns that follow until the definition changes."""
        agent = self._agents.get(spec)
        if agent is None:
            if len(self._agents) >= 256:
                self._agents.clear()
            agent = self._agents[spec] = resolve(spec, self.settings, self.model)
        return agent

    async def run(self, turn: Turn, control: TurnControl | None = None) -> LoopEnd | None:
        scope = TurnScope(turn, control or TurnControl(), self.events, self.clock)
        try:
            stored = await self.store.load(turn.tenant, turn.session)
        except Exception as exc:
            return await refuse(scope, "store", describe(exc))
        if stored is not None and stored.turn_id == turn.id and stored.status == "idle":
            return await ended_again(scope, stored.last_end)
        # the turn's agent: a session belongs to the one its first turn named
        name = turn.agent or (stored.agent if stored is not None else DEFAULT_AGENT)
        if stored is not None and name != stored.agent:
            return await refuse(
                scope, "agent_mismatch",
                f"session {turn.session!r} belongs to agent {stored.agent!r}, and this turn "
                f"names agent {name!r}: send it to a session of its own",
            )  # fmt: skip
        try:
            spec = await self.agents.agent(name)
        except Exception as exc:
            return await refuse(scope, "agents_unavailable", describe(exc))
        if spec is None:
            return await refuse(
                scope, "unknown_agent",
                f"no agent {name!r} is defined (the [[agents]] of the configuration; "
                "`loopmesh agents` lists them)",
            )  # fmt: skip
        agent = self.agent_for(spec)
        snapshot = stored or SessionSnapshot(tenant=turn.tenant, session=turn.session, agent=name)
        fallbacks = TURN_FALLBACKS.set(agent.fallbacks)
        tenant = TURN_TENANT.set(turn.tenant)  # the rate limits' ([llm.limits])
        try:
            return await TurnRun(self, scope, snapshot, agent).run()
        finally:
            TURN_TENANT.reset(tenant)
            TURN_FALLBACKS.reset(fallbacks)


async def refuse(scope: TurnScope, code: str, message: str) -> LoopEnd:
    """End a turn that cannot start: an ``error`` event and its ``loop_end``, nothing
    checkpointed, so the session keeps what it had."""
    await scope.emit(Error, code=code, message=message, fatal=True)
    return await scope.emit(LoopEnd, reason="error", error=f"{code}: {message}")
