"""``loopmesh run "task"``: run a turn with :class:`loopmesh.Client` (over NATS, or
``--gateway URL``) and print its events (:class:`~loopmesh.commands.printer.Printer`).

It exits 0 when the turn ended with ``task_completion``, ``converse`` or
``ask_question``, 1 when it ended otherwise or was refused, 3 on ``--timeout``. Run
without ``--session``, it starts a new session and ends by saying how to continue it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from loopmesh.client import Client, TurnOptions, TurnRefused
from loopmesh.errors import LoopmeshError
from schemas import WEBHOOK_EVENTS, Webhook, new_id
from schemas.events import Event, LoopEnd

from .options import add_remote_options, open_client, token
from .printer import SUCCESS, Printer

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Run one turn: publish it to NATS and print its events until it ends.

Exits 0 when the agent completed the task, answered or asked a question; 1 when the
turn failed (max iterations, error, cancelled...); 3 when --timeout passed first."""

EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 3


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
        "--priority", choices=("interactive", "batch"),
        help="the turn's lane: loop workers take interactive turns (the default) before "
        "batch ones",
    )  # fmt: skip
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
        priority=args.priority,
    )  # fmt: skip
    printer = Printer(sys.stdout, as_json=args.json, deltas=args.deltas)
    async with open_client(args) as client:
        print(f"turn {turn_id} · session {session} · {client.where}", file=sys.stderr)
        code = await _turn(client, args, options, printer)
    if args.session is None:  # a new session: say how to go on with it
        print(f"continue this session with --session {session}", file=sys.stderr)
    return code


async def _turn(
    client: Client, args: argparse.Namespace, options: TurnOptions, printer: Printer
) -> int:
    """Run the turn and print its events; the exit code."""
    try:
        async with asyncio.timeout(args.timeout):
            end = await _follow(client.run(args.task, **options), printer)
    except TimeoutError:
        print(
            f"\nno end of turn {options['turn_id']} within {args.timeout:g}s "
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


def webhook_of(args: argparse.Namespace) -> Webhook | None:
    """``--webhook`` and ``--webhook-event`` as a turn's webhook (checked as the wire
    type checks it: a bad URL exits with the field named)."""
    url = getattr(args, "webhook", None)
    events = getattr(args, "webhook_events", None)
    if url is None:
        if events:
            raise LoopmeshError("--webhook-event needs --webhook URL")
        return None
    body: dict[str, Any] = {"url": url}
    if events:
        body["events"] = list(dict.fromkeys(events))
    try:
        return msgspec.convert(body, Webhook)
    except msgspec.ValidationError as exc:
        raise LoopmeshError(f"--webhook: {exc}") from None
