"""The model's side of an iteration: the prompt, the budget gate, the LLM call and
what to do with a reply that calls no tool.

``Inference`` belongs to one turn. Per iteration the engine calls :meth:`begin`
(``loop_iteration``, prompt, ``context_budget``, pruning), then :meth:`reply` (the
streamed call with its deltas as events; empty replies retried, then a forced summary
with tools withheld; a static message when every model fails), and, for a reply that
calls no tool, :meth:`without_tools` (``no_tool_call`` and a bounded nudge).

It is given what it uses explicitly: the model, hooks, settings and prompts at
construction, and per call the turn's :class:`Conversation` (its messages, its
snapshot's summary and plan, its iteration limit), which it reads and extends. It
knows nothing of the engine that calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas import ChatMessage, SessionSnapshot, ToolSpec
from schemas.events import (
    ContentDelta,
    ContextBudget,
    Error,
    LLMRequest,
    LLMResponse,
    LoopIteration,
    MemoryPruned,
    Message,
    NoToolCall,
    Paused,
    Resumed,
    Retract,
    Retry,
    ThinkingDelta,
    ThinkingEnd,
    ThinkingStart,
)

from .errors import LLMError
from .hooks import Hooks
from .memory import prune, summarize
from .nudges import Nudger, echoes_loop
from .parser import ToolNames
from .prefilter import Prefilter, Selection
from .prompt import (
    Prompts,
    assemble,
    iteration_warning,
    loop_message,
    plan_section,
    system_message,
    tools_section,
    turn_message,
)
from .protocols import LLM, Completion
from .ratelimit import PROMPT_TOKENS
from .scope import End, TurnScope
from .settings import LoopSettings
from .thinking import Piece, ThinkingSplitter, split_thinking
from .tokens import TokenCounter


@dataclass(slots=True)
class Conversation:
    """A turn's state that inference reads and extends: the messages so far (it appends
    replies and nudges; pruning replaces them), the session snapshot (its summary and
    plan are read; pruning replaces the summary) and the turn's iteration limit. The
    engine owns it and hands it in on every call."""

    messages: list[ChatMessage]
    snapshot: SessionSnapshot
    limit: int


class _Stream:
    def __init__(self) -> None:
        self.splitter = ThinkingSplitter()
        self.streamed = False
        self.chars = 0  # content characters streamed by this attempt


#: The end of a turn whose last reply only repeated the loop's reminders.
ECHO_MESSAGE = (
    "The model gave no answer: its replies only repeated the loop's own reminder. A small "
    'model does this; set [loop] tool_choice_strategy = "constrained" or use a larger one.'
)

#: Room left for the summary when pruning (the summary is at most ~2,000 characters).
SUMMARY_RESERVE_TOKENS = 600


class Inference:
    def __init__(
        self,
        *,
        llm: LLM,
        hooks: Hooks,
        settings: LoopSettings,
        prompts: Prompts,
        model: str,
        fallback_message: str,
        scope: TurnScope,
        names: ToolNames,
        context: Sequence[str],
        counter: TokenCounter,
        offered: Callable[[ToolSpec], bool] | None = None,
        prefilter: Prefilter | None = None,
    ) -> None:
        self.llm = llm
        self.hooks = hooks
        self.scope = scope
        self.settings = settings
        self.prompts = prompts
        self.fallback_message = fallback_message
        self.context = list(context)
        self.counter = counter
        self.model = scope.turn.model or model
        self.nudger = Nudger(self.settings, self.prompts)
        self.candidates = [
            (n, spec) for n, spec in names.items() if offered is None or offered(spec)
        ]
        self.prefilter = prefilter
        self.selection: Selection | None = None
        self._ranked_for: str | None = None  # the query of :attr:`selection`
        self._offer(self.candidates)
        self.prompt: list[ChatMessage] = []
        self.tokens = 0
        self.streamed_chars = 0  # content streamed in this iteration, for ``retract``

    def _offer(self, items: Sequence[tuple[str, ToolSpec]]) -> None:
        """Offer ``items`` ((function name, spec) pairs) to the model from now on."""
        text_format = self.settings.tool_format == "text"
        self.offered = tuple(name for name, _ in items)
        self.tools_text = tools_section(self.prompts, items, text_format=text_format)
        self.tools_param: list[dict[str, Any]] = (
            []
            if text_format
            else [
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": spec.description,
                        "parameters": spec.input_schema,
                    },
                }
                for name, spec in items
            ]
        )
        tools_json = msgspec.json.encode(self.tools_param).decode()
        self.tools_tokens = self.counter.count_text_cached(tools_json)

    def query(self, run: Conversation) -> str:
        """What the pre-filter ranks tools against: the request and the plan's step in
        progress (if any)."""
        steps = [s.title for s in run.snapshot.plan if s.status == "in_progress"]
        return "\n".join([self.scope.turn.input, *steps])

    async def narrow(self, run: Conversation) -> None:
        """Re-rank the tools when the query changed (see :mod:`.prefilter`)."""
        if self.prefilter is None:
            return
        query = self.query(run)
        if query == self._ranked_for:
            return
        specs = [spec for _, spec in self.candidates]
        selection = await self.scope.race(self.prefilter.select(query, specs))
        by_key = {(spec.server, spec.name): (n, spec) for n, spec in self.candidates}
        self._offer([by_key[(t.server, t.name)] for t in selection.tools])
        self.selection, self._ranked_for = selection, query

    async def pause(self) -> None:
        await self.scope.emit(Paused)
        await self.scope.race(self.scope.control.wait_running())
        self.scope.check()
        await self.scope.emit(Resumed)

    # -- the prompt and the budget gate ----------------------------------------------

    def build(self, run: Conversation) -> list[ChatMessage]:
        p, turn = self.prompts, self.scope.turn
        system = system_message(
            p,
            instructions=[self.settings.instructions, turn.instructions or ""],
            tools=self.tools_text,
            summary=run.snapshot.summary,
        )
        current = turn_message(
            p,
            plan=plan_section(p, run.snapshot.plan),
            context=self.context,
            user_input=turn.input,
            parts=turn.parts,
        )
        warning = iteration_warning(
            p,
            iteration=self.scope.iteration,
            limit=run.limit,
            warn_at=self.settings.iteration_warning_at,
        )
        return assemble(
            system=system,
            history=run.messages,
            current=current,
            user_input=turn.input,
            warning=warning,
        )

    async def _count(self, prompt: Sequence[ChatMessage]) -> int:
        return await self.counter.count_all(prompt) + self.tools_tokens

    async def begin(self, run: Conversation) -> End | None:
        """Emit ``loop_iteration``, build the prompt and keep it within the budget."""
        scope, s = self.scope, self.settings
        budget = s.context_budget_tokens - s.reply_reserve_tokens  # room kept for the reply
        await scope.emit(LoopIteration, max_iterations=run.limit)
        self.streamed_chars = 0
        await self.narrow(run)
        self.prompt = self.build(run)
        self.tokens = await self._count(self.prompt)
        await scope.emit(
            ContextBudget,
            tokens=self.tokens,
            budget=budget,
            messages=len(self.prompt),
            reply_reserve=s.reply_reserve_tokens,
        )
        if self.tokens <= budget:
            return None
        overhead = self.tokens - await self.counter.count_all(run.messages)
        # Prune below the budget, so that the next iterations fit without pruning (and
        # summarising, an LLM call) again at once.
        low_water = int(budget * self.settings.prune_target_ratio)
        target = max(low_water - overhead - SUMMARY_RESERVE_TOKENS, 0)
        pruned = await prune(run.messages, target, self.counter)
        if pruned.evicted:
            llm = self.llm if self.settings.summarize_with_llm else None
            summary = await scope.race(
                summarize(pruned.evicted, previous=run.snapshot.summary, llm=llm)
            )
            run.messages = list(pruned.kept)
            run.snapshot = msgspec.structs.replace(run.snapshot, summary=summary)
            before = self.tokens
            self.prompt = self.build(run)
            self.tokens = await self._count(self.prompt)
            await scope.emit(
                MemoryPruned,
                removed=len(pruned.evicted),
                tokens_before=before,
                tokens_after=self.tokens,
                summary=summary,
            )
        if self.tokens <= budget:
            return None
        text = self.prompts.nudges.budget_exceeded.strip().format(tokens=self.tokens, budget=budget)
        await scope.emit(Error, code="budget_exceeded", message=text, fatal=True)
        return End("budget_exceeded", content=text)

    # -- the LLM call -----------------------------------------------------------------

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        *,
        model: str | None = None,
    ) -> tuple[Completion, str]:
        """One streamed call (to ``model``, else the turn's); returns the completion
        and its content without thinking."""
        scope = self.scope
        model = model or self.model
        stream = _Stream()

        async def on_delta(text: str) -> None:
            stream.streamed = True
            stream.chars += await self._pieces(stream.splitter.feed(text))

        async def on_retry(attempt: int, reason: str, delay_s: float, model: str) -> None:
            if stream.streamed:  # what the failed attempt streamed is not the reply
                self.streamed_chars += stream.chars
                await self.retract("retry")
            await scope.emit(
                Retry, what="llm", attempt=attempt, reason=reason, delay_s=delay_s, model=model
            )
            stream.splitter = ThinkingSplitter()  # the next attempt streams from the start
            stream.streamed, stream.chars = False, 0

        prepared = await self.hooks.before_llm(list(messages))
        by_hook = isinstance(prepared, Completion)
        if isinstance(prepared, Completion):  # a hook answered: the model is not asked
            completion = prepared
        else:
            if scope.meter is not None:  # a call that would pass a ceiling is not made
                await scope.meter.before(model or "", self.tokens)
            await scope.emit(
                LLMRequest,
                model=model or "",
                messages=len(prepared),
                tokens=self.tokens,
                tools=len(tools),
                **self._offered_fields(tools),
            )
            counted = PROMPT_TOKENS.set(self.tokens)  # the rate limits' estimate
            try:
                completion = await scope.race(
                    self.llm.complete(
                        prepared,
                        tools=tools,
                        model=model or None,
                        on_delta=on_delta,
                        on_retry=on_retry,
                    )
                )
            finally:
                PROMPT_TOKENS.reset(counted)
        splitter = stream.splitter
        if not stream.streamed:  # a model that did not stream: report the whole text
            stream.chars += await self._pieces(splitter.feed(completion.content))
        stream.chars += await self._pieces(splitter.close())
        self.streamed_chars += stream.chars
        if scope.meter is not None and not by_hook:
            scope.meter.after(model or "", completion.usage)
        completion = await self.hooks.after_llm(completion)
        content, _ = split_thinking(completion.content)
        await scope.emit(
            LLMResponse,
            model=completion.model or model or "",
            content=content[: self.settings.message_max_chars],
            tool_calls=len(completion.tool_calls),
            finish_reason=completion.finish_reason,
            usage=completion.usage,
            latency_ms=completion.latency_ms,
            by_hook=by_hook,
        )
        return completion, content

    def _offered_fields(self, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
        sel = self.selection
        if sel is None or (not tools and self.tools_param):  # no pre-filter, or tools withheld
            return {}
        return {
            "offered": self.offered,
            "selection": sel.report(),
        }

    async def retract(self, reason: str) -> None:
        """Take back the deltas this iteration streamed so far (see ``Retract``)."""
        await self.scope.emit(Retract, reason=reason, chars=self.streamed_chars)
        self.streamed_chars = 0

    async def _pieces(self, pieces: list[Piece]) -> int:
        """Emit the pieces; return the characters of content among them."""
        chars = 0
        for piece in pieces:
            match piece.kind:
                case "content":
                    chars += len(piece.text)
                    await self.scope.emit_text(ContentDelta, piece.text)
                case "thinking":
                    await self.scope.emit_text(ThinkingDelta, piece.text)
                case "thinking_start":
                    await self.scope.emit(ThinkingStart)
                case "thinking_end":
                    limit = self.settings.message_max_chars
                    await self.scope.emit(ThinkingEnd, text=piece.text[:limit])
        return chars

    async def reply(self, run: Conversation) -> tuple[Completion, str] | End:
        """The model's reply to :attr:`prompt`; an :class:`End` when there is none."""
        retries = self.settings.empty_response_retries
        try:
            for attempt in range(retries + 1):
                if attempt:
                    if self.streamed_chars:  # whitespace the empty reply streamed
                        await self.retract("retry")
                    await self.scope.emit(
                        Retry, what="empty_response", attempt=attempt, reason="empty response"
                    )
                completion, content = await self.complete(self.prompt, self.tools_param)
                if content.strip() or completion.tool_calls:
                    return completion, content
            forced = [*self.prompt, loop_message(self.prompts.nudges.forced_summary.strip())]
            _, content = await self.complete(forced, ())
        except LLMError as exc:
            return await self._llm_failed(exc)
        content = content.strip()[: self.settings.message_max_chars]
        content = content or self.prompts.nudges.empty_fallback.strip()
        run.messages.append(ChatMessage(role="assistant", content=content))
        await self.scope.emit(Message, content=content)
        return End("forced_summary", content=content)

    async def _llm_failed(self, exc: LLMError) -> End:
        text = self.fallback_message
        await self.scope.emit(Error, code="llm_failed", message=str(exc), fatal=True)
        await self.scope.emit(Message, content=text)
        return End("llm_failed", content=text, error=str(exc))

    # -- a reply that calls no tool -----------------------------------------------------

    async def without_tools(self, run: Conversation, content: str) -> End | None:
        content = content.strip()[: self.settings.message_max_chars]
        await self.scope.emit(NoToolCall, content=content)
        run.messages.append(ChatMessage(role="assistant", content=content))
        _, nudge = self.nudger.nudge(content)
        if nudge is not None:
            run.messages.append(loop_message(nudge))
            await self.retract("nudge")  # the streamed reply is not the answer
            return None
        if echoes_loop(content, self.prompts):
            await self.retract("echo")
            text = ECHO_MESSAGE
            await self.scope.emit(Error, code="no_answer", message=text, fatal=True)
            return End("error", content=text, error=text)
        await self.scope.emit(Message, content=content)
        return End("converse", content=content)
