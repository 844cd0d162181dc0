"""``loopmesh fork|rewind --session S``: a new session as S was at a turn, or S itself
taken back to a turn."""

from __future__ import annotations

import argparse

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Fork (`loopmesh fork`) a session into a new one as it was at a turn, or rewind
(`loopmesh rewind`) the session itself back to a turn: the next turn starts from there.

Name the point with --at-turn T (the session as it was at the end of turn T) or
--before-turn T (as it was before T began); `loopmesh events --json` shows turn ids. A fork
leaves the session as it is; a rewind undoes the turns after the point: their events
stay, after them a `rewound` event names them. Tool calls that ran are not undone: the
rewind lists them. Both are refused while a turn of the session runs or waits."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    point = parser.add_mutually_exclusive_group(required=True)
    point.add_argument(
        "--at-turn", type=token("turn"), help="the session as it was at the end of this turn"
    )
    point.add_argument(
        "--before-turn", type=token("turn"), help="the session as it was before this turn began"
    )
    if parser.prog.split()[-1] == "fork":
        parser.add_argument(
            "--into", type=token("session"), help="the new session's id (default: a new one)"
        )
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    at, before = args.at_turn, args.before_turn
    async with open_client(args) as client:
        if args.command == "fork":
            fork = await client.fork(args.session, at_turn=at, before_turn=before, into=args.into)
            held = f"{len(fork.turns)} turn{'' if len(fork.turns) == 1 else 's'}"
            print(f"forked session {fork.source} into {fork.session} ({held})")
            return 0
        rewind = await client.rewind(args.session, at_turn=at, before_turn=before)
    where = f"the end of turn {rewind.to_turn}" if rewind.to_turn else "its start"
    print(f"rewound session {rewind.session} to {where}")
    print(f"undone: {', '.join(rewind.undone)}")
    for call in rewind.calls:
        name = f"{call.server}.{call.tool}" if call.server else call.tool
        print(f"ran, not undone: {name} ({call.call_id}, {call.status})")
    return 0
