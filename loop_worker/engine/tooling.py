"""Tool calls of one iteration: read them, run them, report them.

:func:`native_calls` and :func:`text_calls` turn a reply into :class:`Call` values
(refused calls carry their error), :class:`ToolRunner` runs them — hooks, approval,
the dispatcher, concurrently — and emits ``tool_call`` before and
``tool_result`` / ``tool_error`` / ``tool_timeout`` after each. :class:`CircuitBreaker`
notices the same error repeating.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas import (
    AGENTS_SERVER,
    DEFAULT_AGENT,
    MEMORY_SERVER,
    Parent,
    ToolCall,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    Turn,
    WireError,
    call_id,
)
from schemas.events import (
    ANSWERED,
    ApprovalDecided,
    ApprovalRequired,
    Event,
    ToolCallEvent,
    ToolErrorEvent,
    ToolResultEvent,
    ToolTimeout,
)
from schemas.messages import PendingCall

from .approvals import Approvals
from .errors import ToolFormatError
from .hooks import SKIP, Hooks
from .memory import truncate
from .parser import ToolNames, parse_arguments, parse_text_calls, safe_function_name
from .prompt import BUILTIN_SERVER, Prompts
from .protocols import AgentCalls, ToolDispatcher
from .recall import Recall
from .scope import TurnScope
from .settings import LoopSettings


@dataclass
class Call:
    index: int
    call_id: str
    name: str  # as the model wrote it
    server: str = ""
    tool: str = ""
    arguments: dict[str, Any] | None = None
    spec: ToolSpec | None = None
    error: WireError | None = None  # refused before it could run

    @property
    def builtin(self) -> bool:
        return self.error is None and self.server == BUILTIN_SERVER

    def history_call(self) -> ToolCall:
        """How the call appears in the stored assistant message."""
        args = msgspec.json.encode(self.arguments).decode() if self.arguments is not None else "{}"
        return ToolCall(id=self.call_id, name=safe_function_name(self.name), arguments=args)

    def pending(self) -> PendingCall:
        """How the call is stored before it runs (see :meth:`restore`)."""
        return PendingCall(
            id=self.call_id,
            name=self.name,
            server=self.server,
            tool=self.tool,
            arguments=self.arguments,
            error=self.error,
        )

    @classmethod
    def restore(cls, index: int, stored: PendingCall, names: ToolNames | None = None) -> Call:
        """The call :meth:`pending` stored, its tool looked up again in ``names``."""
        call = cls(
            index=index,
            call_id=stored.id,
            name=stored.name,
            server=stored.server,
            tool=stored.tool,
            arguments=stored.arguments,
            error=stored.error,
        )
        if call.error is None and names is not None:
            call.spec = names.find(call.server, call.tool)
            if call.spec is None:
                _refuse(call, "unknown_tool", f"no tool {call.tool!r} on server {call.server!r}")
        return call


@dataclass
class Outcome:
    call: Call
    result: ToolResult
    text: str  # what the model reads


def _refuse(call: Call, code: str, message: str) -> Call:
    call.error = WireError(code=code, message=message)
    return call


def _known(names: ToolNames) -> str:
    return ", ".join(sorted(n for n, _ in names.items())) or "(none)"


def _call_id(turn: Turn, iteration: int, index: int) -> str:
    return call_id(turn.tenant, turn.session, turn.id, iteration, index)


def native_calls(
    tool_calls: Sequence[ToolCall], names: ToolNames, turn: Turn, iteration: int
) -> list[Call]:
    calls = []
    for index, tc in enumerate(tool_calls):
        call = Call(index=index, call_id=_call_id(turn, iteration, index), name=tc.name)
        calls.append(call)
        spec = names.resolve(tc.name)
        if spec is None:
            _refuse(call, "unknown_tool", f"no tool named {tc.name!r}; tools: {_known(names)}")
            continue
        call.spec, call.server, call.tool = spec, spec.server, spec.name
        try:
            call.arguments = parse_arguments(tc.arguments)
        except ToolFormatError as exc:
            _refuse(call, "invalid_arguments", f"{tc.name}: {exc}")
    return calls


def text_calls(
    content: str, names: ToolNames, turn: Turn, iteration: int, prompts: Prompts
) -> list[Call]:
    calls = []
    for index, item in enumerate(parse_text_calls(content)):
        call = Call(index=index, call_id=_call_id(turn, iteration, index), name="unreadable")
        calls.append(call)
        if isinstance(item, ToolFormatError):
            text = prompts.nudges.tool_format_error.strip().format(index=index + 1, error=item)
            _refuse(call, "invalid_arguments", text)
            continue
        call.name = f"{item.server}.{item.tool}"
        spec = names.find(item.server, item.tool)
        if spec is None:
            msg = f"no tool {item.tool!r} on server {item.server!r}"
            _refuse(call, "unknown_tool", msg)
            continue
        call.spec, call.server, call.tool, call.arguments = (
            spec,
            spec.server,
            spec.name,
            item.arguments,
        )
    return calls


class ToolRunner:
    """Runs one iteration's calls. Built-in calls go to ``builtin`` (in order, after
    the others); refused calls become error results; the rest run concurrently."""

    def __init__(
        self,
        *,
        scope: TurnScope,
        settings: LoopSettings,
        tools: ToolDispatcher,
        hooks: Hooks,
        builtin: Callable[[Call], Awaitable[ToolResult]],
        parallel: int | None = None,
        agent: str = DEFAULT_AGENT,
        agent_calls: AgentCalls | None = None,
        memory: Recall | None = None,
    ) -> None:
        self.agent = agent  # the turn's: who calls, when a call is an agent's
        self.agent_calls = agent_calls
        self.memory = memory  # the memory tools' (``None``: not offered)
        self.scope = scope
        self.settings = settings
        self.tools = tools
        self.hooks = hooks
        self.builtin = builtin
        self.approvals = Approvals(settings.approval_tools)
        self.parallel = parallel or settings.max_parallel_tools  # calls at once; the rest queue

    async def run(self, calls: Sequence[Call]) -> list[Outcome]:
        for call in calls:
            await self.scope.emit(
                ToolCallEvent,
                call_id=call.call_id,
                server=call.server,
                tool=call.tool or call.name,
                arguments=call.arguments or {},
            )
        results: dict[int, ToolResult] = {}
        remote = [call for call in calls if not call.builtin]
        if len(remote) == 1:  # the usual case: no task needed
            await self._one(remote[0], results)
        elif remote:
            slots = asyncio.Semaphore(self.parallel)

            async def queued(call: Call) -> None:
                async with slots:
                    await self._one(call, results)

            async with asyncio.TaskGroup() as group:
                for call in remote:
                    group.create_task(queued(call))
        for call in calls:
            if call.builtin:
                results[call.index] = await self.builtin(call)
        outcomes = []
        for call in calls:
            outcomes.append(await self._report(call, results[call.index]))
        return outcomes

    async def _one(self, call: Call, results: dict[int, ToolResult]) -> None:
        if call.error is not None:
            results[call.index] = self._result(call, "error", error=call.error)
            return
        assert call.spec is not None
        request = ToolCallRequest(
            call_id=call.call_id,
            tenant=self.scope.turn.tenant,
            session=self.scope.turn.session,
            turn_id=self.scope.turn.id,
            iteration=self.scope.iteration,
            server=call.server,
            tool=call.tool,
            arguments=call.arguments or {},
            timeout_s=(
                self.settings.agent_timeout_s
                if call.server == AGENTS_SERVER
                else min(call.spec.timeout_s, self.settings.tool_timeout_s)
            ),
            created_at=self.scope.clock(),
        )
        try:
            result = await self._dispatch(call, request)
        except Exception as exc:  # a hook or a dispatcher broke its contract
            msg = f"{type(exc).__name__}: {exc}"
            result = self._result(
                call, "error", error=WireError(code="tool_exception", message=msg)
            )
        results[call.index] = result

    async def _dispatch(self, call: Call, request: ToolCallRequest) -> ToolResult:
        out = await self.hooks.before_tool(request)
        if isinstance(out, ToolResult):
            return out
        if out is SKIP:
            return self._rejected(call, "the call was skipped by a hook")
        assert isinstance(out, ToolCallRequest)
        request = out
        approved, reason = await self.hooks.approve_tool(request)
        if not approved:
            return self._rejected(call, reason)
        if await self._needs_approval(call):
            refusal = await self._ask_person(call, request)
            if refusal is not None:
                return await self.hooks.after_tool(request, refusal)
        if request.server == AGENTS_SERVER:
            result = await self._call_agent(call, request)
        elif request.server == MEMORY_SERVER and self.memory is not None:
            result = await self.memory.call(request)
        else:
            result = await self.tools.call(request)
        return await self.hooks.after_tool(request, result)

    async def _call_agent(self, call: Call, request: ToolCallRequest) -> ToolResult:
        """Run the called agent's turn (a child turn, its id and session the call's id)
        and answer with how it ended; refuse a cycle, a chain past ``agent_max_depth``
        and arguments without an ``input``."""
        turn, callee = self.scope.turn, call.tool
        chain = (*turn.chain, self.agent)
        if self.agent_calls is None:
            return self._refused(call, "unavailable", "agents cannot be called here")
        if callee in chain:
            path = " → ".join((*chain, callee))
            return self._refused(call, "cycle", f"calling agent {callee} would be a cycle: {path}")
        if len(chain) > self.settings.agent_max_depth:
            return self._refused(
                call, "too_deep",
                f"calling agent {callee} would make a chain of {len(chain) + 1} agents "
                f"({' → '.join(chain)} → {callee}); at most {self.settings.agent_max_depth} "
                "calls deep ([loop] agent_max_depth)",
            )  # fmt: skip
        text = request.arguments.get("input")
        if not isinstance(text, str) or not text.strip():
            return self._refused(
                call, "invalid_arguments", "`input` must be a non-empty string: what to ask"
            )
        child = Turn(
            id=call.call_id, tenant=turn.tenant, session=call.call_id, input=text,
            created_at=self.scope.clock(), agent=callee,
            parent=Parent(session=turn.session, turn=turn.id, call=call.call_id), chain=chain,
            priority=turn.priority,  # its caller holds a place while it waits for it
        )  # fmt: skip
        started = time.monotonic()
        try:
            end = await self.agent_calls.call(
                child, timeout_s=request.timeout_s or self.settings.agent_timeout_s,
                relay=self._relay,
            )  # fmt: skip
        except TimeoutError:
            return self._result(call, "timeout")
        except asyncio.CancelledError:
            control = self.scope.control
            if control.cancelled.is_set():  # this turn was cancelled: so is its child
                reason = f"the calling turn {turn.id} was cancelled: {control.cancel_reason}"
                await self.agent_calls.cancel(child, reason)
            raise  # else a worker stopping: the turn resumes elsewhere and waits on
        ok = end.reason in ANSWERED
        error = None if ok else WireError(code=end.reason, message=end.error or end.content)
        return ToolResult(
            call_id=call.call_id, status="ok" if ok else "error", content=end.content,
            error=error, server=AGENTS_SERVER, tool=callee,
            duration_ms=(time.monotonic() - started) * 1000, worker=f"agent {callee}",
            finished_at=time.time(),
        )  # fmt: skip

    async def _relay(self, event: Event) -> None:
        """A called agent's approval request, announced in this turn's session too (the
        decision goes to the session of the turn that asked: ``call_session``)."""
        if isinstance(event, ApprovalRequired):
            await self.scope.emit(
                ApprovalRequired, call_id=event.call_id, server=event.server, tool=event.tool,
                arguments=event.arguments, timeout_s=event.timeout_s,
                call_session=event.call_session or event.session,
            )  # fmt: skip

    def _refused(self, call: Call, code: str, message: str) -> ToolResult:
        return self._result(call, "error", error=WireError(code=code, message=message))

    async def _needs_approval(self, call: Call) -> bool:
        """See :mod:`loop_worker.engine.approvals` (a name that matches no tool fails closed)."""
        assert call.spec is not None
        if call.spec.needs_approval:
            return True
        if not self.approvals:
            return False
        specs = await self.tools.tools()
        return self.approvals.reason(call.spec, specs, call.name) is not None

    async def _ask_person(self, call: Call, request: ToolCallRequest) -> ToolResult | None:
        """``None`` when a person approved; otherwise the refusal to give the model."""
        timeout = self.settings.approval_timeout_s
        await self.scope.emit(
            ApprovalRequired,
            call_id=call.call_id,
            server=call.server,
            tool=call.tool,
            arguments=request.arguments,
            timeout_s=timeout,
        )
        decision = await self.scope.control.wait_decision(call.call_id, timeout)
        if decision is None:
            interrupted = self.scope.control.interruption
            reason = (
                f"no decision within {timeout:g} s"
                if interrupted is None
                else f"the turn was interrupted by turn {interrupted.by} before a decision"
            )
            await self.scope.emit(ApprovalDecided, call_id=call.call_id, reason=reason)
            return self._rejected(call, reason)
        await self.scope.emit(
            ApprovalDecided,
            call_id=call.call_id,
            approved=decision.approved,
            reason=decision.reason,
        )
        if decision.approved:
            return None
        return self._rejected(call, f"rejected by a person: {decision.reason or 'no reason given'}")

    def _rejected(self, call: Call, message: str) -> ToolResult:
        return self._result(call, "error", error=WireError(code="rejected", message=message))

    def _result(self, call: Call, status: Any, *, error: WireError | None = None) -> ToolResult:
        return ToolResult(
            call_id=call.call_id,
            status=status,
            error=error,
            server=call.server,
            tool=call.tool,
            finished_at=time.time(),
        )

    async def _report(self, call: Call, result: ToolResult) -> Outcome:
        emit, tool = self.scope.emit, call.tool or call.name
        if result.status == "ok":
            content, cut = truncate(result.content, self.settings.tool_result_max_chars)
            await emit(
                ToolResultEvent,
                call_id=call.call_id,
                server=call.server,
                tool=tool,
                content=content,
                truncated=cut,
                duration_ms=result.duration_ms,
                worker=result.worker,
            )
            return Outcome(call, result, content)
        error = result.error or WireError(code=result.status, message="the tool failed")
        if result.status == "timeout":
            timeout = call.spec.timeout_s if call.spec else self.settings.tool_timeout_s
            await emit(
                ToolTimeout, call_id=call.call_id, server=call.server, tool=tool, timeout_s=timeout
            )
        else:
            await emit(
                ToolErrorEvent,
                call_id=call.call_id,
                server=call.server,
                tool=tool,
                code=error.code,
                message=error.message,
                worker=result.worker,
            )
        text, _ = truncate(
            f"Error ({error.code}): {error.message}", self.settings.tool_result_max_chars
        )
        return Outcome(call, result, text)


class CircuitBreaker:
    """Counts repeats of the same error of the same tool; a success clears a tool."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self._counts: dict[tuple[str, str, str], int] = {}

    def record(self, outcome: Outcome) -> int:
        """The repeat count of this outcome's error (0 for a success)."""
        call, result = outcome.call, outcome.result
        tool = (call.server, call.tool or call.name)
        if result.status == "ok":
            for key in [k for k in self._counts if k[:2] == tool]:
                del self._counts[key]
            return 0
        message = result.error.message if result.error else result.status
        key = (*tool, message)
        self._counts[key] = self._counts.get(key, 0) + 1
        return self._counts[key]

    def tripped(self, count: int) -> bool:
        return count >= self.threshold
