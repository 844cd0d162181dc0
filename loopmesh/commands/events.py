"""``loopmesh events --session S``: a session's events, readable or as JSON lines."""

from __future__ import annotations

import argparse
import contextlib
import sys

from loopmesh.client import SessionEvent

from .options import add_remote_options, open_client, token
from .printer import Printer

#: Quiet at a terminal: only the events, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Print a session's events: those stored, then (with --follow) new ones as they come.

Straight from NATS (an ordered consumer on the events stream), or through the gateway
with --gateway URL. With --json each line is the event's JSON with its stream
sequence first ({"seq": 4711, "type": ...}); --since SEQ starts after that sequence,
so a reader that stopped resumes with nothing missed or repeated. Without --follow it
stops after the events that were stored when it started."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    parser.add_argument("--turn", type=token("turn"), help="only this turn's events")
    parser.add_argument(
        "--since", type=_sequence, metavar="SEQ",
        help="only events after this stream sequence (default: all that are kept)",
    )  # fmt: skip
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C"
    )
    parser.add_argument("--json", action="store_true", help="JSON lines, each with its seq")
    parser.add_argument("--deltas", action="store_true", help="print streamed text as it comes")
    add_remote_options(parser)


def _sequence(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"a stream sequence is a number ≥ 0, not {value!r}")
    return int(value)


async def main(args: argparse.Namespace) -> int:
    printer = Printer(sys.stdout, deltas=args.deltas)
    async with open_client(args) as client:
        items = client.events(
            args.session, since=args.since or 0, turn=args.turn, follow=args.follow
        )
        async with contextlib.aclosing(items):
            async for item in items:
                if args.json:
                    printer.line(json_line(item))
                else:
                    printer.show(item.event)
    return 0


def json_line(item: SessionEvent) -> str:
    """The event's JSON as stored, with ``"seq"`` first (resume with ``--since SEQ``)."""
    return f'{{"seq":{item.seq},{item.data.decode()[1:]}'
