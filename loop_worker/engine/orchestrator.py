"""The dual-model orchestrator: plan → execute → synthesize (``mode = "orchestrator"``).

1. **Plan.** The planner model, offered no tools, breaks the request into steps: a
   JSON plan (``response_format`` ``json_schema`` where the LLM takes it; read
   tolerantly by :func:`~loop_worker.engine.plan.parse_plan`), shown as ``plan_update``.
2. **Execute.** Each step goes to the executor model with its description, the earlier
   steps' results and the tools a :class:`~loop_worker.engine.protocols.ToolSelector`
   picks for it (all of them by default). Its calls go through the turn's
   :class:`~loop_worker.engine.tooling.ToolRunner`, like the ordinary loop's; a reply
   without calls (or a ``task_completion`` call) is the step's result, kept in the
   plan (``PlanStep.result``). A step that fails (no model answered, no result within
   ``step_max_iterations`` calls) is tried again ``step_retries`` times.
3. **Synthesize.** The planner writes the answer from the results, streamed.

Every LLM call is an iteration of the turn (its number is in the call ids, so they
are unique per step), at most ``max_iterations`` of them (past it the turn ends with
reason ``max_iterations``, as the ordinary loop's does), each checkpointed: the plan and
:class:`~schemas.messages.OrchestratorState` (the step in progress, its executor's
conversation) are in the snapshot, and a step's calls are stored before they run, so
a worker that resumes goes on at the step it was on and re-issues only the calls
that had not returned (same call ids: finished ones return their recorded result).

**Fallback.** When the plan cannot be read, the planner cannot be reached, a step
fails past its retries or the synthesis fails, :meth:`Orchestrator.run` adds what was
learnt (the finished steps' results) to the conversation, emits
``orchestrator_fallback`` and returns ``None``: the ordinary single-model loop takes
the turn from there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas import ChatMessage, PlanStep, ToolSpec
from schemas.events import (
    Error,
    LLMRequest,
    LLMResponse,
    LoopIteration,
    Message,
    OrchestratorFallback,
    PlanUpdate,
    Retry,
)
from schemas.messages import OrchestratorState

from .errors import LLMError, PlanError
from .hooks import Hooks
from .inference import Conversation, Inference
from .limits import Limits
from .memory import truncate
from .parser import ToolNames
from .plan import json_schema, parse_plan
from .prefilter import Prefilter, Selection
from .prompt import BUILTIN_SERVER, Prompts, loop_message
from .protocols import LLM, Completion, ToolSelector
from .scope import End, TurnScope
from .settings import LoopSettings
from .thinking import split_thinking
from .tooling import Call, Outcome, ToolRunner, native_calls

#: ``save(iteration)``: checkpoint the conversation, as the last completed iteration.
Save = Callable[[int], Awaitable[None]]


@dataclass
class _Failed:
    """Why the orchestrator gives the turn to the ordinary loop."""

    reason: str
    message: str
    step: str = ""


class Orchestrator:
    def __init__(
        self,
        *,
        llm: LLM,
        hooks: Hooks,
        settings: LoopSettings,
        prompts: Prompts,
        scope: TurnScope,
        names: ToolNames,
        runner: ToolRunner,
        limits: Limits,
        run: Conversation,
        inference: Inference,
        select_tools: ToolSelector,
        planner: str,
        executor: str,
        save: Save,
    ) -> None:
        self.llm = llm
        self.hooks = hooks
        self.settings = settings
        self.p = prompts.orchestrator
        self.prompts = prompts
        self.scope = scope
        self.turn = scope.turn
        self.names = names
        self.runner = runner
        self.limits = limits
        self.run_ = run
        self.inference = inference
        self.select_tools = select_tools
        self.planner = planner
        self.executor = executor
        self.save = save

    # -- state in the snapshot --------------------------------------------------------

    @property
    def plan(self) -> tuple[PlanStep, ...]:
        return self.run_.snapshot.plan

    @property
    def state(self) -> OrchestratorState:
        return self.run_.snapshot.orchestrator or OrchestratorState()

    def _set(self, **fields: Any) -> None:
        """Replace fields of the snapshot (``plan``, ``pending``...) and of its
        orchestrator state (``state=`` a dict of them)."""
        state = fields.pop("state", None)
        if state is not None:
            fields["orchestrator"] = msgspec.structs.replace(self.state, **state)
        self.run_.snapshot = msgspec.structs.replace(self.run_.snapshot, **fields)

    def _set_step(self, index: int, **fields: Any) -> None:
        plan = list(self.plan)
        plan[index] = msgspec.structs.replace(plan[index], **fields)
        self._set(plan=tuple(plan))

    # -- the story ----------------------------------------------------------------------

    async def run(self) -> End | None:
        """The turn's end, or ``None`` when it fell back to the ordinary loop."""
        try:
            return await self._run()
        except _OutOfIterations:
            text = self.prompts.nudges.max_iterations.strip().format(iterations=self.run_.limit)
            await self.scope.emit(Error, code="max_iterations", message=text, fatal=False)
            return End("max_iterations", content=text)

    async def _run(self) -> End | None:
        if self.run_.snapshot.orchestrator is None:  # not planned yet (or not stored)
            failed = await self._plan()
            if failed is not None:
                await self._fall_back(failed)
                return None
        while self.state.phase == "execute" and self.state.step < len(self.plan):
            stopped = await self._execute(self.state.step)
            if isinstance(stopped, End):
                return stopped
            if stopped is not None:
                await self._fall_back(stopped)
                return None
        return await self._synthesize()

    async def _plan(self) -> _Failed | None:
        await self._next()
        tools = [
            f"- {name}: {' '.join(spec.description.split())[:200]}"
            for name, spec in self._offered()
        ]
        max_steps = self.settings.plan_max_steps
        system = self._system(
            self.p.planner.strip().format(max_steps=max_steps, tools="\n".join(tools) or "(none)")
        )
        messages = [system, *self.run_.messages]
        schema = json_schema(max_steps) if getattr(self.llm, "accepts_response_format", 0) else None
        try:
            try:
                completion = await self._ask(messages, (), self.planner, schema)
            except LLMError:
                if schema is None:
                    raise
                # a server that refuses response_format: ask again without it
                completion = await self._ask(messages, (), self.planner)
        except LLMError as exc:
            return _Failed("plan_failed", f"the planner model failed: {exc}")
        content, _ = split_thinking(completion.content)
        try:
            plan = parse_plan(content, max_steps)
        except PlanError as exc:
            return _Failed("plan_unparseable", f"the planner's reply is not a plan: {exc}")
        self._set(plan=plan.plan_steps(), pending=(), orchestrator=OrchestratorState())
        await self.save(self.scope.iteration)
        await self.scope.emit(PlanUpdate, plan=self.plan)
        return None

    async def _execute(self, index: int) -> End | _Failed | None:
        """Run step ``index`` to its result (retrying it), or say why it failed."""
        step = self.plan[index]
        if step.status != "in_progress":
            self._set_step(index, status="in_progress")
            await self.scope.emit(PlanUpdate, plan=self.plan)
        specs = [spec for _, spec in self._offered()]
        selection: Selection | None = None
        if isinstance(self.select_tools, Prefilter):  # it says why it chose: reported
            selection = await self.scope.race(self.select_tools.select(step.title, specs))
            picked: Sequence[ToolSpec] = selection.tools
        else:
            picked = await self.scope.race(self.select_tools(step.title, specs))
        keys = {(s.server, s.name) for s in specs}  # a selector only narrows
        names = ToolNames([s for s in picked if (s.server, s.name) in keys])
        tools = _tools_param(names)
        report: dict[str, Any] = {}
        if selection is not None:
            report = {
                "offered": tuple(n for n, _ in names.items()),
                "selection": selection.report(),
            }
        while True:
            outcome = await self._attempt(index, names, tools, report)
            if isinstance(outcome, End):
                return outcome
            if not isinstance(outcome, _Why):
                result, _ = truncate(outcome.strip(), self.settings.tool_result_max_chars)
                self._set_step(index, status="done", result=result)
                self._set(state={"step": index + 1, "messages": (), "attempt": 0})
                await self.save(self.scope.iteration)
                await self.scope.emit(PlanUpdate, plan=self.plan)
                return None
            attempt = self.state.attempt + 1
            if attempt > self.settings.step_retries:
                text = f"step {step.id} failed after {attempt} attempts: {outcome.message}"
                return _Failed("step_failed", text, step=step.id)
            self._set(state={"messages": (), "attempt": attempt})
            await self.save(self.scope.iteration)
            await self.scope.emit(Retry, what="step", attempt=attempt, reason=outcome.message)

    async def _attempt(
        self,
        index: int,
        names: ToolNames,
        tools: list[dict[str, Any]],
        report: dict[str, Any],
    ) -> str | _Why | End:
        """One attempt at a step: its result, why it failed, or the turn's
        :class:`End` (a limit was hit). ``report``: the pre-filter's choice, for
        ``llm_request``."""
        messages = list(self.state.messages) or self._step_prompt(index)
        if self.run_.snapshot.pending:  # the executor asked before the last worker stopped
            self.scope.iteration = self.run_.snapshot.iteration + 1
            calls = [
                Call.restore(i, c, self.names) for i, c in enumerate(self.run_.snapshot.pending)
            ]
            end = await self._run_calls(calls, messages)
            if end is not None:
                return end
        made = sum(1 for m in messages if m.role == "assistant")
        for _ in range(made, self.settings.step_max_iterations):
            await self._next()
            try:
                completion = await self._ask(messages, tools, self.executor, report=report)
            except LLMError as exc:
                return _Why(f"the executor model failed: {exc}")
            content, _ = split_thinking(completion.content)
            if not completion.tool_calls:
                if content.strip():
                    return content
                continue  # an empty reply: ask again, within the step's calls
            calls = native_calls(
                completion.tool_calls, self._with_done(names), self.turn, self.scope.iteration
            )
            done = [c for c in calls if c.builtin and c.tool == "task_completion"]
            calls = [c for c in calls if not c.builtin]
            used = self.limits.police(calls, self.run_.snapshot.turn_tool_calls)
            history = tuple(c.history_call() for c in calls)
            messages.append(ChatMessage(role="assistant", content=content, tool_calls=history))
            self._set(
                pending=tuple(c.pending() for c in calls),
                turn_tool_calls=used,
                state={"messages": tuple(messages)},
            )
            await self.save(self.scope.iteration - 1)  # before the calls run
            end = await self._run_calls(calls, messages)
            if end is not None:
                return end
            if done:
                result = (done[0].arguments or {}).get("result")
                if isinstance(result, str) and result.strip():
                    return result
        return _Why(f"no result within {self.settings.step_max_iterations} executor calls")

    async def _run_calls(self, calls: list[Call], messages: list[ChatMessage]) -> End | None:
        outcomes: list[Outcome] = (  # an interruption waits for the calls' records
            await self.scope.race(self.runner.run(calls), interruptible=False) if calls else []
        )
        for o in outcomes:
            messages.append(ChatMessage(role="tool", content=o.text, tool_call_id=o.call.call_id))
        self._set(pending=(), state={"messages": tuple(messages)})
        await self.save(self.scope.iteration)
        if (end := self.limits.end_after(calls, outcomes)) is not None:
            await self.scope.emit(Error, code=end.reason, message=end.content, fatal=True)
        return end

    async def _synthesize(self) -> End | None:
        self._set(state={"phase": "synthesize"})
        await self._next()
        system = self._system(self.p.synthesis.strip())
        results = loop_message(self.p.results.strip().format(results=self._results()))
        messages = [system, *self.run_.messages, results]
        try:
            _, content = await self.inference.complete(messages, (), model=self.planner)
        except LLMError as exc:
            await self._fall_back(_Failed("synthesis_failed", f"the planner failed: {exc}"))
            return None
        content = content.strip()[: self.settings.message_max_chars]
        if not content:
            await self.inference.retract("retry")
            await self._fall_back(_Failed("synthesis_failed", "the planner wrote an empty answer"))
            return None
        self.run_.messages.append(ChatMessage(role="assistant", content=content))
        self._set(orchestrator=None)
        await self.scope.emit(Message, content=content)
        return End("task_completion", content=content)

    async def _fall_back(self, failed: _Failed) -> None:
        finished = sum(1 for s in self.plan if s.status == "done")
        text = self.p.fallback.strip().format(why=failed.message, results=self._results())
        self.run_.messages.append(loop_message(text))
        self._set(
            pending=(),
            orchestrator=OrchestratorState(phase="fallback", offset=self.scope.iteration),
        )
        await self.scope.emit(
            OrchestratorFallback,
            reason=failed.reason,
            message=failed.message,
            step=failed.step,
            finished=finished,
        )
        await self.save(self.scope.iteration)

    # -- pieces -------------------------------------------------------------------------

    async def _next(self) -> None:
        """Start the next iteration (one LLM call); raises :class:`_OutOfIterations`
        when the turn has had ``max_iterations`` of them."""
        scope = self.scope
        scope.check()
        if scope.control.paused:
            await self.inference.pause()
        if scope.iteration >= self.run_.limit:
            raise _OutOfIterations
        scope.iteration += 1
        await scope.emit(LoopIteration, max_iterations=self.run_.limit)

    async def _ask(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        model: str,
        response_format: dict[str, Any] | None = None,
        report: dict[str, Any] | None = None,
    ) -> Completion:
        """One call, not streamed as the answer (a plan, a step's work). ``report``:
        the ``offered`` and ``selection`` fields of its ``llm_request``."""
        scope = self.scope
        prepared = await self.hooks.before_llm(list(messages))

        async def on_retry(attempt: int, reason: str, delay_s: float, model: str) -> None:
            await scope.emit(
                Retry, what="llm", attempt=attempt, reason=reason, delay_s=delay_s, model=model
            )

        by_hook = isinstance(prepared, Completion)
        if isinstance(prepared, Completion):  # a before_llm hook answered in the model's place
            completion = prepared
        else:
            if scope.meter is not None:  # a call that would pass a ceiling is not made
                await scope.meter.before(model, 0)
            await scope.emit(
                LLMRequest, model=model, messages=len(prepared), tools=len(tools), **(report or {})
            )
            extra: dict[str, Any] = {"response_format": response_format} if response_format else {}
            completion = await scope.race(
                self.llm.complete(
                    prepared, tools=tools, model=model or None, on_retry=on_retry, **extra
                )
            )
        if scope.meter is not None and not by_hook:
            scope.meter.after(model, completion.usage)
        completion = await self.hooks.after_llm(completion)
        content, _ = split_thinking(completion.content)
        await scope.emit(
            LLMResponse,
            model=completion.model or model,
            content=content[: self.settings.message_max_chars],
            tool_calls=len(completion.tool_calls),
            finish_reason=completion.finish_reason,
            usage=completion.usage,
            latency_ms=completion.latency_ms,
            by_hook=by_hook,
        )
        return completion

    def _offered(self) -> list[tuple[str, ToolSpec]]:
        """The turn's tools for executors: the catalog's, within the turn's allowlist."""
        return [
            (name, spec)
            for name, spec in self.names.items()
            if spec.server != BUILTIN_SERVER and self.limits.allows(spec)
        ]

    def _with_done(self, names: ToolNames) -> ToolNames:
        """``names`` and ``task_completion``, which a step's executor may call to
        give its result (small models do)."""
        done = self.names.resolve("task_completion")
        return ToolNames([*names.specs(), *([done] if done else [])], builtin_server=BUILTIN_SERVER)

    def _system(self, job: str) -> ChatMessage:
        """The planner's system message: the instructions, the summary, its job."""
        parts = [self.settings.instructions, self.turn.instructions or ""]
        summary = self.run_.snapshot.summary
        if summary:
            parts.append(self.prompts.system.summary.strip().format(summary=summary))
        parts.append(job)
        return ChatMessage(role="system", content="\n\n".join(p.strip() for p in parts if p))

    def _step_prompt(self, index: int) -> list[ChatMessage]:
        step = self.plan[index]
        user = self.p.step.strip().format(
            request=self.turn.input,
            results=self._results(),
            number=index + 1,
            total=len(self.plan),
            description=step.title,
        )
        system = ChatMessage(
            role="system",
            content="\n\n".join(
                x.strip()
                for x in (self.settings.instructions, self.turn.instructions or "", self.p.executor)
                if x and x.strip()
            ),
        )
        return [system, ChatMessage(role="user", content=user)]

    def _results(self) -> str:
        lines = [
            self.p.result_line.format(id=s.id, description=s.title, result=s.result)
            for s in self.plan
            if s.status == "done"
        ]
        return "\n".join(lines) or self.p.no_results


class _OutOfIterations(Exception):
    """The turn's ``max_iterations`` LLM calls are spent (the plan, the steps' calls
    and the synthesis each count)."""


@dataclass
class _Why:
    """Why one attempt at a step failed."""

    message: str


def _tools_param(names: ToolNames) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": spec.description,
                "parameters": spec.input_schema,
            },
        }
        for name, spec in names.items()
    ]
