"""``loopmesh run "task"``: run a turn with :class:`loopmesh.Client` (over NATS, or
``--gateway URL``) and print its events.

It prints each event of the turn as it arrives: iteration k of N, tool calls and their
results, and the final answer. It exits 0 when the turn ended with ``task_completion``,
``converse`` or ``ask_question``, 1 when it ended otherwise or was refused, 3 on
``--timeout``. :class:`Printer` is how ``run`` and ``events`` print events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncGenerator
from typing import Any, TextIO

import msgspec

from loopmesh.client import TurnOptions, TurnRefused
from schemas import WEBHOOK_EVENTS, Webhook, encode, new_id
from schemas.events import (
    ANSWERED,
    ApprovalDecided,
    ApprovalRequired,
    ContentDelta,
    Error,
    Event,
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
    RolledBack,
    ToolCallEvent,
    ToolErrorEvent,
    ToolResultEvent,
    ToolTimeout,
)

from .remote import add_remote_options, open_client, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Run one turn: publish it to NATS and print its events until it ends.

Exits 0 when the agent completed the task, answered or asked a question; 1 when the
turn failed (max iterations, error, cancelled...); 3 when --timeout passed first."""

SUCCESS = ANSWERED
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 3
#: Said of a turn that ended by ``converse`` with no tool run: if the task needed one,
#: it was not done.
NO_TOOL_RAN = "the model only talked: no tool ran, so a task that needed one was not done"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task", help="what the agent should do")
    parser.add_argument("--session", type=token("session"), help="session id (default: a new one)")
    parser.add_argument("--turn-id", type=token("turn"), help="turn id (default: a new one)")
    parser.add_argument("--max-iterations", type=int, help="overrides [loop] max_iterations")
    parser.add_argument("--model", help="overrides [llm] model for this turn")
    parser.add_argument(
        "--on-busy",
        choices=("enqueue", "reject", "interrupt", "rollback"),
        help="when an earlier turn of the session has not ended: wait for it (enqueue), "
        "be refused (reject), stop it (interrupt), or stop it and undo it (rollback); "
        "default: [loop] on_busy",
    )
    parser.add_argument(
        "--agent", type=token("agent"),
        help="the named agent that runs the turn (default: the session's; `loopmesh agents` "
        "lists them)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="give up after this many seconds (600)"
    )
    parser.add_argument(
        "--webhook", metavar="URL",
        help="POST the turn's events to URL, signed with [webhooks] secret (the loopmesh "
        "webhooks service delivers them; docs/WEBHOOKS.md)",
    )  # fmt: skip
    parser.add_argument(
        "--webhook-event", dest="webhook_events", action="append", choices=WEBHOOK_EVENTS,
        help="an event type to POST (repeatable; default: loop_end)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print events as JSON lines")
    parser.add_argument("--deltas", action="store_true", help="print streamed text as it comes")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    turn_id, session = args.turn_id or new_id(), args.session or new_id()
    options = TurnOptions(
        session=session, turn_id=turn_id, max_iterations=args.max_iterations,
        model=args.model, on_busy=args.on_busy, agent=args.agent, webhook=webhook_of(args),
    )  # fmt: skip
    printer = Printer(sys.stdout, as_json=args.json, deltas=args.deltas)
    async with open_client(args) as client:
        print(f"turn {turn_id} · session {session} · {client.where}", file=sys.stderr)
        try:
            async with asyncio.timeout(args.timeout):
                end = await _follow(client.run(args.task, **options), printer)
        except TimeoutError:
            print(
                f"\nno end of turn {turn_id} within {args.timeout:g}s "
                "(is a loop worker running? `loopmesh up` starts one)",
                file=sys.stderr,
            )
            return EXIT_TIMEOUT
        except TurnRefused as refused:
            if refused.event is None:
                raise  # the gateway's answer: said as an error
            for event in (refused.event, refused.end):  # the loop worker's events
                if event is not None:
                    printer.show(event)
            return EXIT_FAILED
    return EXIT_OK if end.reason in SUCCESS else EXIT_FAILED


async def _follow(events: AsyncGenerator[Event, None], printer: Printer) -> LoopEnd:
    async with contextlib.aclosing(events):
        async for event in events:
            printer.show(event)
            if isinstance(event, LoopEnd):
                return event
    raise AssertionError("the event stream ended before the turn did")  # pragma: no cover


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


def webhook_of(args: argparse.Namespace) -> Webhook | None:
    """``--webhook`` and ``--webhook-event`` as a turn's webhook (checked as the wire
    type checks it: a bad URL exits with the field named)."""
    url = getattr(args, "webhook", None)
    events = getattr(args, "webhook_events", None)
    if url is None:
        if events:
            raise SystemExit("loopmesh run: --webhook-event needs --webhook URL")
        return None
    body: dict[str, Any] = {"url": url}
    if events:
        body["events"] = list(dict.fromkeys(events))
    try:
        return msgspec.convert(body, Webhook)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"loopmesh run: --webhook: {exc}") from None
