"""What the turns of one :class:`~.engine.Engine` share: the Protocols' implementations
(the LLM, the tools, the event sink, the session store, the agents), the settings, the
hooks and prompts, and the caches every turn reuses (token counters, resolved agents).
A turn's :class:`~.run.TurnRun` reads them from here; the engine adds the entry point."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from loopmesh.settings import Price
from schemas import AgentSpec

from .agents import Agent, StaticAgents, resolve
from .budget import UsageToday
from .hooks import Hooks, Retriever
from .prefilter import Prefilter
from .prompt import load_prompts
from .protocols import (
    LLM,
    AgentCalls,
    Agents,
    EventSink,
    Memories,
    SessionStore,
    ToolDispatcher,
    ToolSelector,
    all_tools,
)
from .settings import LLMSettings, LoopSettings
from .tokens import TokenCounter


class TurnKit:
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
        memories: Memories | None = None,
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
        #: The tenants' memories across sessions (``None``: ``[loop.memory]`` is unserved).
        self.memories = memories
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
