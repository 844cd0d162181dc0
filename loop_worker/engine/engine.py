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

A cancelled ``run`` *task* (a worker shutting down) is not the end of the turn: it
leaves the snapshot "running" for another worker to resume. Cancelling the turn itself
goes through :class:`~loop_worker.engine.control.TurnControl`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from loopmesh.settings import Price
from schemas import SessionSnapshot, Turn
from schemas.events import Error, LoopEnd

from .budget import UsageToday
from .control import TurnControl
from .hooks import Hooks, Retriever
from .prefilter import Prefilter
from .prompt import load_prompts
from .protocols import LLM, EventSink, SessionStore, ToolDispatcher, ToolSelector, all_tools
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
    ) -> None:
        self.settings = settings
        #: What models' tokens cost ([prices]) and the tenants' spend today, for the
        #: budgets ([loop.budget]; without ``usage`` the daily ceilings are not checked).
        self.prices: Mapping[str, Price] = prices or {}
        self.usage = usage
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

    async def run(self, turn: Turn, control: TurnControl | None = None) -> LoopEnd | None:
        scope = TurnScope(turn, control or TurnControl(), self.events, self.clock)
        try:
            snapshot = await self.store.load(turn.tenant, turn.session)
        except Exception as exc:
            await scope.emit(Error, code="store", message=describe(exc), fatal=True)
            return await scope.emit(LoopEnd, reason="error", error=describe(exc))
        snapshot = snapshot or SessionSnapshot(tenant=turn.tenant, session=turn.session)
        if snapshot.turn_id == turn.id and snapshot.status == "idle":
            return await ended_again(scope, snapshot.last_end)
        return await TurnRun(self, scope, snapshot).run()
