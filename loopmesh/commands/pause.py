"""``loopmesh pause|resume --session S``: hold a session's running turn, then let it go on."""

from __future__ import annotations

import argparse

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own line, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Pause (`loopmesh pause`) a session's running turn, or resume (`loopmesh resume`) it.

A paused turn stops at its next step (a `paused` event) and waits, holding its place,
until it is resumed (a `resumed` event) or cancelled. The pause is recorded, so a turn
that resumes on another worker still sees it."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    pausing = args.command == "pause"
    async with open_client(args) as client:
        await (client.pause if pausing else client.resume)(args.session)
    print(f"{'pause' if pausing else 'resume'} sent to session {args.session}")
    return 0
