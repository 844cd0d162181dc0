"""``loopmesh cancel --session S``: stop a session's running turn."""

from __future__ import annotations

import argparse

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own line, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Cancel a session's running turn (or, with --turn, that turn only).

The turn stops at its next step and ends with loop_end reason "cancelled". The cancel
is recorded, so a turn that resumes on another worker still sees it; turns posted
after it are not affected."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    parser.add_argument("--turn", type=token("turn"), help="only this turn (NATS only)")
    parser.add_argument("--reason", default="", help="why (recorded with the cancel)")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    async with open_client(args) as client:
        await client.cancel(args.session, turn_id=args.turn, reason=args.reason)
    print(f"cancel sent to session {args.session}")
    return 0
