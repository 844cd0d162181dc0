"""``loopmesh run "task"``: publish a turn (to NATS, or ``--gateway URL``) and print its events.

Over NATS the command subscribes to the session's events first (an ordered consumer on
the events stream, from "new"), then publishes the :class:`~schemas.Turn`; through the
gateway it posts the turn and reads its ``events_url`` (see ``remote.py``). It prints each
event of that turn as it arrives: iteration k of N, tool calls and their results, and
the final answer. It exits 0 when the turn ended with ``task_completion``,
``converse`` or ``ask_question``, 1 when it ended otherwise, 3 on ``--timeout``.

:func:`publish_turn`, :class:`Follower` and :func:`run_turn` are the same steps for programs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, TextIO

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api

from loopmesh.aio import quietly
from loopmesh.jetstream import ordered_subscribe
from schemas import DecodeError, Subjects, Turn, encode, new_id
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
    decode_event,
)

from .remote import Item, add_remote_options, client_config, open_remote, token

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
    parser.add_argument("--json", action="store_true", help="print events as JSON lines")
    parser.add_argument("--deltas", action="store_true", help="print streamed text as it comes")
    add_remote_options(parser)


async def publish_turn(js: JetStreamContext, subjects: Subjects, turn: Turn) -> int:
    """Publish ``turn``; return its stream sequence. Its ``Nats-Msg-Id`` is
    ``<tenant>.<session>.<id>`` (:attr:`Turn.msg_id`): publishing it twice is
    deduplicated, another tenant's or session's turn of the same id is not, and a
    worker refuses a turn published under another id."""
    ack = await js.publish(
        subjects.turn(turn.tenant, turn.session),
        encode(turn),
        headers={"Nats-Msg-Id": turn.msg_id},
    )
    return ack.seq


class Follower:
    """An ordered consumer on one session's events: ``async with Follower(...) as f``,
    then publish, then ``async for event in f``."""

    def __init__(
        self, nc: Client, subjects: Subjects, tenant: str, session: str, *, start_seq: int = 0
    ) -> None:
        self._nc = nc
        self._subject = subjects.session_events(tenant, session)
        self._start_seq = start_seq
        self._sub: JetStreamContext.PushSubscription | None = None

    async def __aenter__(self) -> Follower:
        kwargs: dict[str, Any] = {"deliver_policy": js_api.DeliverPolicy.NEW}
        if self._start_seq:
            kwargs = {
                "deliver_policy": js_api.DeliverPolicy.BY_START_SEQUENCE,
                "config": js_api.ConsumerConfig(opt_start_seq=self._start_seq),
            }
        self._sub = await ordered_subscribe(self._nc, self._subject, **kwargs)
        return self

    async def __aexit__(self, *exc: object) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await quietly(sub.unsubscribe())

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        assert self._sub is not None
        while True:
            msg = await self._sub.next_msg(timeout=None)
            try:
                yield decode_event(msg.data)
            except DecodeError:
                continue  # not an event at all (newer ones decode to a generic form)


async def run_turn(
    nc: Client,
    subjects: Subjects,
    turn: Turn,
    *,
    out: TextIO = sys.stdout,
    as_json: bool = False,
    deltas: bool = False,
) -> LoopEnd:
    """Publish ``turn``, print its events to ``out``, return its ``loop_end``."""
    printer = Printer(out, as_json=as_json, deltas=deltas)
    async with Follower(nc, subjects, turn.tenant, turn.session) as events:
        await publish_turn(nc.jetstream(), subjects, turn)
        async for event in events:
            if event.turn_id != turn.id:
                continue
            printer.show(event)
            if isinstance(event, LoopEnd):
                return event
    raise AssertionError("unreachable")  # pragma: no cover


async def main(args: argparse.Namespace) -> int:
    config = client_config(args)
    turn = Turn(
        id=args.turn_id or new_id(),
        tenant=config.client.tenant,
        session=args.session or new_id(),
        input=args.task,
        created_at=time.time(),
        max_iterations=args.max_iterations,
        model=args.model,
        on_busy=args.on_busy,
        agent=args.agent,
    )
    printer = Printer(sys.stdout, as_json=args.json, deltas=args.deltas)
    async with open_remote(args) as remote:
        print(f"turn {turn.id} · session {turn.session} · {remote.where}", file=sys.stderr)
        try:
            async with asyncio.timeout(args.timeout):
                end = await _follow(remote.run(turn), printer)
        except TimeoutError:
            print(
                f"\nno end of turn {turn.id} within {args.timeout:g}s "
                "(is a loop worker running? `loopmesh up` starts one)",
                file=sys.stderr,
            )
            return EXIT_TIMEOUT
    return EXIT_OK if end.reason in SUCCESS else EXIT_FAILED


async def _follow(items: AsyncIterator[Item], printer: Printer) -> LoopEnd:
    async with contextlib.aclosing(items):  # type: ignore[type-var]
        async for item in items:
            event = item.event()
            if event is not None:
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
            self._line(encode(event).decode())
            return
        if isinstance(event, Retract):
            self._streamed.clear()  # not the answer: a message equal to it still prints
            if self._retractable:  # text streamed above was discarded: say so
                self._retractable = False
                if self._in_delta:
                    self.out.write("\n")
                    self._in_delta = False
                why = event.reason or "discarded"
                self._line(f"  ↶ the text above was taken back ({why}); it is not the answer")
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
            self._line(line)

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

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def _tool(server: str, tool: str) -> str:
    return f"{server}.{tool}" if server else tool


def _short(text: str, limit: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
