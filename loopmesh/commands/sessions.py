"""``loopmesh sessions``: the tenant's sessions, filtered and paged."""

from __future__ import annotations

import argparse
import time

import msgspec

from loopmesh.sessions import DEFAULT_PAGE, MAX_PAGE

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """List the tenant's sessions, most recently active first.

Each line: the session, its status, agent, turns, tokens, when it was last active, and
its title and labels. --label KEY=VALUE (or KEY: any value) may be repeated; every one
must match. When there is another page, the last line says the --cursor to ask for it.
--json prints each session as a JSON line, then the cursor as {"next_cursor": ...}."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agent", type=token("agent"), help="only this agent's sessions")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE, or KEY")
    parser.add_argument("--idle-for", type=float, metavar="S",
                        help="only sessions not active for S seconds")  # fmt: skip
    parser.add_argument("--active-within", type=float, metavar="S",
                        help="only sessions active in the last S seconds")  # fmt: skip
    parser.add_argument("--limit", type=int, default=DEFAULT_PAGE,
                        help=f"sessions on a page (1 to {MAX_PAGE})")  # fmt: skip
    parser.add_argument("--cursor", help="the next page, as the last list said")
    parser.add_argument("--json", action="store_true", help="JSON lines")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    labels: dict[str, str | None] = {}
    for raw in args.label:
        key, sep, value = raw.partition("=")
        labels[key] = value if sep else None
    now = time.time()
    async with open_client(args) as client:
        found = await client.sessions(
            agent=args.agent, labels=labels,
            active_after=now - args.active_within if args.active_within is not None else None,
            active_before=now - args.idle_for if args.idle_for is not None else None,
            limit=args.limit, cursor=args.cursor,
        )  # fmt: skip
    if args.json:
        for s in found.sessions:
            print(msgspec.json.encode(s).decode())
        print(msgspec.json.encode({"next_cursor": found.next_cursor}).decode())
        return 0
    if not found.sessions:
        print("no sessions")
    for s in found.sessions:
        shown = [s.session, s.status, f"agent {s.agent}", f"{s.turns} turns",
                 f"{s.tokens} tokens", _ago(now - s.updated_at)]  # fmt: skip
        if s.expired:
            shown.append("expired (snapshot only)")
        if s.title:
            shown.append(repr(s.title))
        shown += [f"{k}={v}" for k, v in sorted(s.labels.items())]
        print("  ".join(shown))
    if found.next_cursor:
        print(f"more: --cursor {found.next_cursor}")
    return 0


def _ago(seconds: float) -> str:
    if seconds < 60:
        return "active just now"
    if seconds < 3600:
        return f"active {int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"active {int(seconds // 3600)} h ago"
    return f"active {int(seconds // 86400)} d ago"
