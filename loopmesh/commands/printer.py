"""How ``loopmesh run`` and ``loopmesh events`` print a turn's events: a line a person
reads for each (or the event's JSON line).

It shows iteration k of N, tool calls and their results, approvals waiting, and the
final answer once, in full."""

from __future__ import annotations

import json
from typing import TextIO

from schemas import encode
from schemas.events import (
    ANSWERED,
    ApprovalDecided,
    ApprovalRequired,
    ContentDelta,
    Error,
    Event,
    Forked,
    HookErrorEvent,
    LLMResponse,
    LoopEnd,
    LoopIteration,
    LoopStart,
    Message,
    NoToolCall,
    OrchestratorFallback,
    Paused,
    PlanUpdate,
    Question,
    Resumed,
    Retract,
    Retry,
    Rewound,
    RolledBack,
    ToolCallEvent,
    ToolErrorEvent,
    ToolResultEvent,
    ToolTimeout,
)

#: The ends of a turn that did what was asked.
SUCCESS = ANSWERED
#: Said of a turn that ended by ``converse`` with no tool run: if the task needed one,
#: it was not done.
NO_TOOL_RAN = "the model only talked: no tool ran, so a task that needed one was not done"


class Printer:
    """Events as lines a person reads (or JSON lines).

    The final answer arrives twice (a ``message`` or ``question`` event, then the
    ``loop_end`` that carries it): it is printed once, in full."""

    def __init__(self, out: TextIO, *, as_json: bool = False, deltas: bool = False) -> None:
        self.out = out
        self.as_json = as_json
        self.deltas = deltas
        self.max_iterations = 0
        self._in_delta = False
        self._streamed: list[str] = []  # content deltas since the last line
        self._said: set[str] = set()  # answers and questions printed in full
        self._retractable = False  # deltas shown since the last retract
        self._tools_ran = 0  # calls of the deployment's tools (not the loop's own)

    def show(self, event: Event) -> None:
        if self.as_json:
            self.line(encode(event).decode())
            return
        if isinstance(event, Retract):
            self._streamed.clear()  # not the answer: a message equal to it still prints
            if self._retractable:  # text streamed above was discarded: say so
                self._retractable = False
                if self._in_delta:
                    self.out.write("\n")
                    self._in_delta = False
                why = event.reason or "discarded"
                self.line(f"  ↶ the text above was taken back ({why}); it is not the answer")
            return
        if isinstance(event, ContentDelta) and self.deltas:
            self.out.write(event.text)
            self.out.flush()
            self._streamed.append(event.text)
            self._in_delta = self._retractable = True
            return
        line = self.describe(event)
        if self._in_delta:
            self.out.write("\n")
            self._in_delta = False
        if line is not None:
            self.line(line)

    def describe(self, event: Event) -> str | None:
        match event:
            case LoopStart(max_iterations=n, model=model, resumed=resumed, worker=worker):
                self.max_iterations = n
                how = "resumed" if resumed else "started"
                where = worker or "a worker"
                agent = "" if event.agent == "default" else f" · agent {event.agent}"
                return (
                    f"▶ turn {how} on {where}{agent} · model {model or '?'} · up to {n} iterations"
                )
            case LoopIteration(iteration=k, max_iterations=n):
                self._streamed.clear()
                return f"── iteration {k} of {n or self.max_iterations}"
            case ToolCallEvent(server="loop") | ToolResultEvent(server="loop"):
                return None  # the loop's own tools: their message, question or plan shows
            case ToolCallEvent(server=server, tool=tool, arguments=arguments):
                self._tools_ran += 1
                return f"  → {_tool(server, tool)}({_short(json.dumps(arguments), 200)})"
            case ToolResultEvent(server=server, tool=tool, content=content, duration_ms=ms):
                return f"  ← {_tool(server, tool)} ({ms:.0f} ms): {_short(content, 300)}"
            case ToolErrorEvent(server=server, tool=tool, code=code, message=message):
                return f"  ✗ {_tool(server, tool)} {code}: {_short(message, 300)}"
            case ToolTimeout(server=server, tool=tool, timeout_s=timeout):
                return f"  ✗ {_tool(server, tool)} timed out after {timeout:g}s"
            case ApprovalRequired(call_id=call_id, server=server, tool=tool, session=session):
                return (
                    f"  ? {_tool(server, tool)} needs approval: "
                    f"loopmesh approve --session {session} {call_id}  (or deny)"
                )
            case ApprovalDecided(call_id=call_id, approved=approved, reason=reason):
                how = "approved" if approved else "denied"
                return f"  {'✓' if approved else '✗'} call {call_id} {how}" + (
                    f": {_short(reason, 200)}" if reason else ""
                )
            case PlanUpdate(plan=plan):
                steps = "; ".join(f"[{s.status}] {_short(s.title, 60)}" for s in plan)
                return f"  ☰ plan: {steps}"
            case NoToolCall():
                return "  · the model answered without a tool call"
            case OrchestratorFallback(reason=reason, message=message):
                return (
                    f"  ↪ the plan was given up ({reason}); the single-model loop goes on: "
                    + _short(message, 300)
                )
            case Message(content=content) if content.strip():
                text = content.strip()
                self._said.add(text)
                if "".join(self._streamed).strip() == text:
                    return None  # it was just streamed
                return "  💬 " + text.replace("\n", "\n     ")
            case Question(text=text):
                self._said.add(text.strip())
                return f"  ? {text}"
            case Retry(what=what, attempt=attempt, reason=reason, delay_s=delay):
                return f"  … retrying {what} (attempt {attempt}, in {delay:.1f}s): {reason}"
            case RolledBack(by_turn=by, calls=calls):
                ran = ", ".join(_tool(c.server, c.tool) for c in calls) or "none"
                return (
                    f"  ↩ rolled back for turn {by}: the session is as before this turn "
                    f"(calls that ran: {ran})"
                )
            case Forked(source=source, at_turn=at):
                return f"⑂ forked from session {source} at the end of turn {at or '(none)'}"
            case Rewound(to_turn=to, turns=turns, calls=calls):
                ran = ", ".join(_tool(c.server, c.tool) for c in calls) or "none"
                where = f"the end of turn {to}" if to else "its start"
                return (
                    f"↩ rewound to {where}; undone: {', '.join(turns)} "
                    f"(calls that ran, not undone: {ran})"
                )
            case Paused():
                return "  ⏸ paused"
            case Resumed():
                return "  ▶ resumed"
            case HookErrorEvent(hook=hook, message=message, fatal=fatal):
                return f"  ! {'fatal ' if fatal else ''}hook {hook}: {_short(message, 300)}"
            case Error(code=code, message=message, fatal=fatal):
                return f"  ! {'fatal ' if fatal else ''}{code}: {_short(message, 300)}"
            case LLMResponse():
                return None
            case LoopEnd(reason=reason, content=content, iterations=k, error=error):
                mark = "✔" if reason in SUCCESS else "✘"
                said = content.strip() in self._said
                tail = f"\n{content}" if content and not said else ""
                err = f" ({error})" if error and reason not in SUCCESS else ""
                if reason == "converse" and not self._tools_ran:
                    mark, err = "⚠", f" ({NO_TOOL_RAN})"
                return f"{mark} {reason} after {k} iteration(s){err}{tail}"
        return None

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def _tool(server: str, tool: str) -> str:
    return f"{server}.{tool}" if server else tool


def _short(text: str, limit: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
