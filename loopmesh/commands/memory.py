"""``loopmesh memory``: list, add, forget and erase the memories agents keep of a user (or
of themselves) across sessions ([loop.memory]), over NATS or through the gateway."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

import msgspec

from loopmesh.client import MemoryItem

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """List, add, forget or erase the memories kept of a user (--user) or by an agent
(--agent), across sessions.

  loopmesh memory --user ada                      list them, oldest first
  loopmesh memory add "Ada keeps bees." --user ada
  loopmesh memory forget ID --user ada            delete one
  loopmesh memory erase --user ada                every memory of ada's, all trace of them

An agent with memory = "tools" or "auto" saves and recalls them itself; memories added
here are embedded by the loop workers as they load them."""

ACTIONS = ("list", "add", "forget", "erase")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=ACTIONS, default="list")
    parser.add_argument("target", nargs="?", help="add: the memory's text; forget: its id")
    parser.add_argument("--user", type=token("user"), help="the user's memories")
    parser.add_argument("--agent", type=token("agent"), help="the agent's own memories")
    parser.add_argument("--json", action="store_true", help="list: the memories as JSON lines")
    add_remote_options(parser)


def render(memories: list[MemoryItem]) -> str:
    if not memories:
        return "no memories\n"
    lines = []
    for m in memories:
        day = datetime.fromtimestamp(m.created_at, UTC).strftime("%Y-%m-%d")
        lines.append(f"{m.id}  {day}  {m.text}")
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> int:
    if (args.user is None) == (args.agent is None):
        print("loopmesh memory: give exactly one of --user and --agent", file=sys.stderr)
        return 2
    if args.action in ("add", "forget") and not args.target:
        what = "the memory's text" if args.action == "add" else "the memory's id"
        print(f"loopmesh memory {args.action}: give {what}", file=sys.stderr)
        return 2
    whose = {"user": args.user} if args.user is not None else {"agent": args.agent}
    async with open_client(args) as client:
        if args.action == "list":
            found = await client.memories(**whose)
            if args.json:
                for m in found:
                    sys.stdout.write(json.dumps(msgspec.to_builtins(m)) + "\n")
            else:
                sys.stdout.write(render(found))
        elif args.action == "add":
            added = await client.remember(args.target, **whose)
            print(f"remembered {added.id}")
        elif args.action == "forget":
            if not await client.forget(args.target, **whose):
                print(f"no memory {args.target}", file=sys.stderr)
                return 1
            print(f"forgot {args.target}")
        else:
            print(f"erased {await client.erase_memories(**whose)} memories")
    return 0
