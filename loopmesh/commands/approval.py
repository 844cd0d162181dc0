"""``loopmesh approve|deny --session S CALL_ID``: decide a tool call waiting for approval."""

from __future__ import annotations

import argparse

from .options import add_remote_options, open_client, token

#: Quiet at a terminal: only its own line, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Approve (`loopmesh approve`) or deny (`loopmesh deny`) a tool call waiting for a person.

The call is named by its call id (shown by `loopmesh run` and `loopmesh events` in the
approval_required event). The decision is recorded, so a turn that resumes on another
worker still sees it. A denied call returns an error to the model instead of running."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("call_id", type=token("call"), help="the call id to decide")
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    parser.add_argument("--reason", default="", help="why (the model sees it on a deny)")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    approved = args.command == "approve"
    async with open_client(args) as client:
        decide = client.approve if approved else client.deny
        await decide(args.session, args.call_id, reason=args.reason)
    print(f"{'approved' if approved else 'denied'} call {args.call_id} in session {args.session}")
    return 0
