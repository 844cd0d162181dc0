"""One turn's run of the agent loop (:class:`TurnRun`), made by :class:`~.engine.Engine`
on what its turns share (:class:`~.kit.TurnKit`): its iterations, the orchestrated mode's
hand-over, tool calls and their results, the loop-breaking tools, and the checkpoints.
``engine.py`` describes the loop.
"""

from __future__ import annotations

from typing import cast

import msgspec

from schemas import ChatMessage, Passage, SessionSnapshot, ToolResult, ToolSpec, TurnEnd
from schemas.events import (
    BudgetReached,
    EndReason,
    Error,
    HookErrorEvent,
    LoopEnd,
    LoopStart,
    Message,
    PlanUpdate,
    Question,
    RanCall,
    RolledBack,
    TurnAccepted,
)

from .agents import Agent
from .budget import BudgetExceeded, Meter
from .context import bound, passage_text
from .inference import Conversation, Inference
from .kit import TurnKit
from .limits import Limits
from .loop_tools import LOOP_BREAKING, NOT_AN_ANSWER, callee_spec, error_result, failed, plan_steps
from .nudges import echoes_loop
from .orchestrator import Orchestrator
from .parser import ToolNames, has_text_call
from .prompt import BUILTIN_SERVER, builtin_specs
from .recall import Recall, memory_specs
from .scope import End, TurnCancelled, TurnDeadline, TurnInterrupted, TurnScope
from .tokens import TokenCounter
from .tooling import Call, CircuitBreaker, Outcome, ToolRunner, native_calls, text_calls
from .transcript import add_results, before_turn


class TurnRun:
    """One turn's state between iterations."""

    def __init__(
        self, kit: TurnKit, scope: TurnScope, snapshot: SessionSnapshot, agent: Agent
    ) -> None:
        self.e = kit
        self.scope = scope
        self.turn = scope.turn
        self.agent = agent
        self.settings = agent.settings  # [loop], as the turn's agent sets it
        self.resumed = snapshot.turn_id == self.turn.id
        #: The session as it was before this turn began (a rollback's target), known
        #: when this run started the turn.
        self.before: SessionSnapshot | None = None if self.resumed else snapshot
        self.ran: dict[str, RanCall] = {}  # calls of this run that a tool worker ran
        self.limit = self.turn.max_iterations or self.settings.max_iterations
        self.conversation = Conversation(list(snapshot.messages), snapshot, self.limit)
        if not self.resumed:
            # a turn that never finished may have left calls without results
            self._close_pending("interrupted", "the turn was interrupted before it finished")
            self.messages.append(
                ChatMessage(role="user", content=self.turn.input, parts=self.turn.parts)
            )
            self.snapshot = msgspec.structs.replace(
                self.snapshot,
                status="running",
                turn_id=self.turn.id,
                iteration=0,
                turn_started_at=scope.clock(),
                turn_tool_calls=0,
                orchestrator=None,
            )
        self.limits = Limits.of(self.turn, self.settings, agent.tools)
        scope.meter = self.meter = Meter(
            kit.settings.budget, kit.prices, self.turn.tenant, kit.usage,
            tokens=self.snapshot.turn_tokens if self.resumed else 0,
            cost=self.snapshot.turn_cost if self.resumed else 0.0,
        )  # fmt: skip
        state = self.snapshot.orchestrator
        if state is not None and state.phase == "fallback":  # its iterations came first
            self.limit = self.conversation.limit = self.limit + state.offset
        if self.limits.deadline_s is not None:  # a resumed turn keeps its first start
            started = self.snapshot.turn_started_at or scope.clock()
            scope.deadline = started + self.limits.deadline_s
        self.model = self.turn.model or agent.model
        self.breaker = CircuitBreaker(self.settings.circuit_breaker_threshold)
        self.end: End | None = None

    @property
    def messages(self) -> list[ChatMessage]:
        return self.conversation.messages

    @messages.setter
    def messages(self, messages: list[ChatMessage]) -> None:
        self.conversation.messages = messages

    @property
    def snapshot(self) -> SessionSnapshot:
        return self.conversation.snapshot

    @snapshot.setter
    def snapshot(self, snapshot: SessionSnapshot) -> None:
        self.conversation.snapshot = snapshot

    async def run(self) -> LoopEnd:
        scope = self.scope
        try:
            self.end = await self._loop()
        except TurnCancelled as exc:
            self.end = End("cancelled", error=str(exc) or "cancelled")
            self._close_pending("cancelled", "the turn was cancelled")
        except BudgetExceeded as exc:
            await scope.emit(
                BudgetReached, ceiling=exc.ceiling, limit=exc.limit, spent=exc.spent,
                needed=exc.needed, over=exc.over, message=str(exc),
            )  # fmt: skip
            self.end = End("budget", error=str(exc))
            self._close_pending("budget", str(exc))
        except TurnInterrupted as exc:
            self.end = End("interrupted", error=str(exc))
            self._close_pending("interrupted", str(exc))
            if exc.interruption.rollback:
                await self._roll_back(exc.interruption.by)
        except TurnDeadline:
            text = self.limits.deadline_message()
            await scope.emit(Error, code="deadline", message=text, fatal=True)
            self.end = End("deadline", content=text, error=text)
            self._close_pending("deadline", text)
        except Exception as exc:
            await scope.emit(Error, code="internal", message=describe(exc), fatal=True)
            self.end = End("error", error=describe(exc))
            self._close_pending("interrupted", f"the turn ended with an error: {self.end.error}")
        end = self.end
        try:
            await self._checkpoint(status="idle", end=end)
        except Exception as exc:
            await scope.emit(Error, code="checkpoint", message=describe(exc), fatal=True)
            end.error = end.error or describe(exc)
        event = scope.make(
            LoopEnd,
            reason=end.reason,
            content=end.content,
            iterations=scope.iteration,
            error=end.error,
        )
        failed = await self.e.hooks.around_turn("after_turn", self.turn, event)
        if failed is not None:
            await scope.emit(HookErrorEvent, hook=failed[0], message=failed[1])
        await scope.sink.emit(event)
        return event

    async def _loop(self) -> End:
        scope, e = self.scope, self.e
        start = self.snapshot.iteration + 1 if self.resumed else 1
        scope.iteration = start - 1
        if not self.resumed:  # what was asked, for whoever watches only the events
            await scope.emit(TurnAccepted, input=self.turn.input)
        await scope.emit(
            LoopStart,
            max_iterations=self.limit,
            model=self.model or "",
            resumed=self.resumed,
            worker=e.worker,
            agent=self.agent.name,
            agent_revision=self.agent.revision,
            webhook=self.turn.webhook or self.agent.spec.webhook,
        )
        await self._checkpoint()
        if not self.resumed:
            failed = await e.hooks.around_turn("before_turn", self.turn)
            if failed is not None:
                hook, message = failed
                await scope.emit(HookErrorEvent, hook=hook, message=message, fatal=True)
                return End("error", error=f"the before_turn hook {hook} failed: {message}")
        callees = await self._callees()
        mode = self.settings.memory.mode
        recall = None
        if mode != "off" and e.memories is not None:
            recall = Recall(e.memories, self.settings.memory, self.turn, self.agent.name)
        specs = [
            *builtin_specs(e.prompts), *callees, *(memory_specs(mode) if recall else ()),
            *(await scope.race(e.tools.tools())),
        ]  # fmt: skip
        names = ToolNames(specs, builtin_server=BUILTIN_SERVER)
        context = await self._context(recall if mode == "auto" else None)
        inference = Inference(
            llm=e.llm,
            hooks=e.hooks,
            settings=self.settings,
            prompts=e.prompts,
            model=self.agent.model,
            fallback_message=e.fallback_message,
            scope=scope,
            names=names,
            context=context,
            counter=self._counter(),
            offered=self.limits.allows,
            prefilter=e.prefilter,
        )
        runner = ToolRunner(
            scope=scope,
            settings=self.settings,
            tools=e.tools,
            hooks=e.hooks,
            builtin=self._builtin,
            parallel=self.limits.max_parallel_tools,
            agent=self.agent.name,
            agent_calls=e.agent_calls,
            memory=recall,
        )
        if self._orchestrated():
            end = await self._orchestrate(inference, runner, names)
            if end is not None:
                return end
            # fell back: the ordinary loop goes on after the orchestrator's iterations
            self.limit = self.conversation.limit = self.limit + self.snapshot.iteration
            start = self.snapshot.iteration + 1
        if self.snapshot.pending:  # the model answered before the last worker stopped
            scope.check(interruptible=False)  # they may have run: they get their record
            if scope.control.paused:
                await inference.pause()
            scope.iteration = start
            calls = [Call.restore(i, c, names) for i, c in enumerate(self.snapshot.pending)]
            end = await self._run_calls(calls, runner)
            if end is not None:
                return end
            await self._checkpoint()
            start += 1
        for iteration in range(start, self.limit + 1):
            scope.check()
            if scope.control.paused:
                await inference.pause()
            scope.iteration = iteration
            end = await self._iteration(iteration, inference, runner, names)
            if end is not None:
                return end
            await self._checkpoint()
        text = e.prompts.nudges.max_iterations.strip().format(iterations=self.limit)
        await scope.emit(Error, code="max_iterations", message=text, fatal=False)
        return End("max_iterations", content=text)

    def _orchestrated(self) -> bool:
        """A turn in ``orchestrator`` mode that has not fallen back to this loop."""
        if (self.turn.mode or self.settings.mode) != "orchestrator":
            return False
        state = self.snapshot.orchestrator
        return state is None or state.phase != "fallback"

    async def _orchestrate(
        self, inference: Inference, runner: ToolRunner, names: ToolNames
    ) -> End | None:
        """Plan, execute, synthesize (see ``orchestrator.py``); ``None``: fell back."""
        e, s, turn = self.e, self.settings, self.turn
        model = self.model

        async def save(iteration: int) -> None:
            await self._checkpoint(iteration=iteration)

        return await Orchestrator(
            llm=e.llm,
            hooks=e.hooks,
            settings=s,
            prompts=e.prompts,
            scope=self.scope,
            names=names,
            runner=runner,
            limits=self.limits,
            run=self.conversation,
            inference=inference,
            select_tools=e.select_tools,
            planner=turn.planner_model or s.planner_model or model,
            executor=turn.executor_model or s.executor_model or model,
            save=save,
        ).run()

    async def _iteration(
        self, iteration: int, inference: Inference, runner: ToolRunner, names: ToolNames
    ) -> End | None:
        e, s = self.e, self.settings
        end = await inference.begin(self.conversation)
        if end is not None:
            return end
        reply = await inference.reply(self.conversation)
        if isinstance(reply, End):
            return reply
        completion, content = reply
        text_format = s.tool_format == "text" and not completion.tool_calls
        if completion.tool_calls:
            calls = native_calls(completion.tool_calls, names, self.turn, iteration)
        elif text_format and has_text_call(content):
            calls = text_calls(content, names, self.turn, iteration, e.prompts)
        else:
            return await inference.without_tools(self.conversation, content)
        used = self.limits.police(calls, self.snapshot.turn_tool_calls)
        self.messages.append(
            ChatMessage(
                role="assistant",
                content=content[: s.message_max_chars],
                tool_calls=() if text_format else tuple(c.history_call() for c in calls),
            )
        )
        pending = tuple(c.pending() for c in calls)
        self.snapshot = msgspec.structs.replace(
            self.snapshot, pending=pending, turn_tool_calls=used
        )
        await self._checkpoint(iteration=iteration - 1)  # before the calls: see the docstring
        return await self._run_calls(calls, runner)

    async def _run_calls(self, calls: list[Call], runner: ToolRunner) -> End | None:
        """Run the pending calls (the last message asked for them) and add their results."""
        # not interruptible: an interruption waits for the calls to end and be recorded
        outcomes = await self.scope.race(runner.run(calls), interruptible=False)
        self._note_ran(outcomes)
        self._add_results(outcomes)
        if self.end is None and (end := self.limits.end_after(calls, outcomes)) is not None:
            await self.scope.emit(Error, code=end.reason, message=end.content, fatal=True)
            return end
        for outcome in outcomes:
            count = self.breaker.record(outcome)
            if self.breaker.tripped(count):
                return await self._circuit_open(outcome, count)
        return self.end

    async def _callees(self) -> list[ToolSpec]:
        """The agents this turn's agent may call, as tools (``agents.<name>``, taking
        ``input``); a callee undefined since (the definitions changed) is left out."""
        out = []
        for name in self.agent.spec.agents:
            spec = await self.e.agents.agent(name)
            if spec is None:
                continue
            out.append(callee_spec(name, spec, self.settings.agent_timeout_s))
        return out

    def _note_ran(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            if o.result.worker:  # a tool worker ran it (not refused, not a loop tool)
                call = o.call
                self.ran[call.call_id] = RanCall(
                    call_id=call.call_id, server=call.server, tool=call.tool,
                    status=o.result.status,
                )  # fmt: skip

    async def _roll_back(self, by: str) -> None:
        """Return the session to its snapshot from before this turn began, and say so
        (``rolled_back``, with the calls that ran: their side effects stay). A run that
        resumed the turn after a crash kept no copy of that snapshot: its conversation
        is cut back to before the turn's input, its summary and plan stay as they are."""
        before, ran = self.before, list(self.ran.values())
        if before is None:
            before, ran = before_turn(self.snapshot, self.messages, self.turn.input)
        self.messages = list(before.messages)
        self.snapshot = msgspec.structs.replace(
            self.snapshot,
            messages=before.messages,
            summary=before.summary,
            plan=before.plan,
            pending=(),
            orchestrator=None,
        )
        previous = before.turn_id if before.turn_id != self.turn.id else None
        await self.scope.emit(RolledBack, by_turn=by, to_turn=previous, calls=tuple(ran))

    def _close_pending(self, code: str, message: str) -> None:
        """Answer calls that will never run, so the history has no call without a result."""
        if self.snapshot.pending:
            calls = [Call.restore(i, c) for i, c in enumerate(self.snapshot.pending)]
            self._add_results([failed(c, code, message) for c in calls])

    def _add_results(self, outcomes: list[Outcome]) -> None:
        """The results of the pending calls, after the assistant message that made them
        (in the text format, that message has no native ``tool_calls``)."""
        self.snapshot = msgspec.structs.replace(self.snapshot, pending=())
        add_results(self.messages, outcomes, self.e.prompts)

    async def _circuit_open(self, outcome: Outcome, count: int) -> End:
        call = outcome.call
        message = outcome.result.error.message if outcome.result.error else outcome.result.status
        text = self.e.prompts.nudges.circuit_open.strip().format(
            server=call.server or "?", tool=call.tool or call.name, count=count, message=message
        )
        await self.scope.emit(Error, code="circuit_open", message=text, fatal=True)
        return End("circuit_open", content=text, error=message)

    async def _builtin(self, call: Call) -> ToolResult:
        """The loop's own tools. Loop-breaking ones set :attr:`end` (the first wins)."""
        args = call.arguments or {}
        if call.tool == "update_plan":
            try:
                steps = plan_steps(args)
            except (msgspec.ValidationError, TypeError) as exc:
                return error_result(call, "invalid_arguments", f"update_plan: {exc}")
            self.snapshot = msgspec.structs.replace(self.snapshot, plan=steps)
            await self.scope.emit(PlanUpdate, plan=steps)
            return ToolResult(
                call_id=call.call_id,
                server=call.server,
                tool=call.tool,
                content=f"plan updated: {len(steps)} steps",
            )
        reason, field = LOOP_BREAKING[call.tool]
        value = args.get(field)
        if value is None or value == "":
            text = f"{call.tool} needs a {field!r} argument"
            return error_result(call, "invalid_arguments", text)
        text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
        if echoes_loop(text, self.e.prompts):
            return error_result(call, "invalid_arguments", f"{call.tool}: {NOT_AN_ANSWER}")
        if self.end is None:
            self.end = End(reason, content=text[: self.settings.message_max_chars])
            if call.tool == "ask_question":
                await self.scope.emit(Question, text=self.end.content)
            else:
                await self.scope.emit(Message, content=self.end.content)
        return ToolResult(
            call_id=call.call_id, server=call.server, tool=call.tool, content="delivered"
        )

    async def _context(self, recall: Recall | None) -> list[str]:
        """The retrieved-context section: the turn's passages, then the retrievers' and
        the memories ``recall`` finds (bounded in tokens). A retriever or a recall that
        fails is reported, and the turn goes on."""
        turn, scope = self.turn, self.scope
        own = list(turn.context)
        if legacy := turn.metadata.get("context"):
            own.insert(0, Passage(text=legacy))
        found: list[Passage] = []
        sources = [("retrieve", self.e.hooks.retrieve(turn))]
        if recall is not None:
            sources.append(("recall", recall.passages()))
        for hook, source in sources:
            try:
                found += await scope.race(source)
            except (TurnCancelled, TurnDeadline):
                raise
            except Exception as exc:
                await scope.emit(HookErrorEvent, hook=hook, message=describe(exc))
        counter = self._counter()
        kept = bound(found, self.settings.retrieved_max_tokens, counter.count_text_cached)
        return [passage_text(p) for p in [*own, *kept]]

    def _counter(self) -> TokenCounter:
        return self.e.counter_for(self.model or None)

    async def _checkpoint(
        self, status: str = "running", *, iteration: int | None = None, end: End | None = None
    ) -> None:
        snapshot = msgspec.structs.replace(
            self.snapshot,
            messages=tuple(self.messages),
            iteration=self.scope.iteration if iteration is None else iteration,
            updated_at=self.scope.clock(),
            last_end=None,
            turn_tokens=self.meter.tokens,
            turn_cost=self.meter.cost,
        )
        if status == "idle":
            last_end = None
            if end is not None:
                last_end = TurnEnd(
                    reason=end.reason,
                    content=end.content,
                    iterations=self.scope.iteration,
                    error=end.error,
                )
            snapshot = msgspec.structs.replace(
                snapshot, status="idle", turns=snapshot.turns + 1, last_end=last_end,
                tokens=snapshot.tokens + self.meter.tokens,
            )  # fmt: skip
        await self.e.store.save(snapshot)
        self.snapshot = snapshot


async def ended_again(scope: TurnScope, end: TurnEnd | None) -> LoopEnd | None:
    """A turn delivered again after it finished: its ``loop_end`` once more, since a
    crash between the last checkpoint and that event may have lost it (its fixed msg id
    makes the stream drop a second copy). Nothing else is emitted or asked. ``None``
    when the snapshot does not say how the turn ended."""
    if end is None:
        return None
    scope.iteration = end.iterations
    return await scope.emit(
        LoopEnd,
        reason=cast(EndReason, end.reason),
        content=end.content,
        iterations=end.iterations,
        error=end.error,
    )


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
