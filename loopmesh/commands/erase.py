"""``loopmesh erase --session S``: erase a session everywhere loopmesh keeps it."""

from __future__ import annotations

import argparse

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Erase a session everywhere loopmesh keeps it.

Its running turn is cancelled first; then its events, snapshot, leases, tool effects,
controls, A2A tasks and the sessions of the agents it called are removed. The usage
ledger keeps its totals (no content). The erase is recorded on the tenant's audit
subject. It cannot be undone."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    async with open_client(args) as client:
        erased = await client.delete_session(args.session)
    removed = ", ".join(f"{where} {n}" for where, n in erased.removed.items() if n)
    print(f"session {erased.session} erased ({removed or 'nothing stored'})")
    for child in erased.children:
        print(f"  with session {child} (an agent it called)")
    return 0
