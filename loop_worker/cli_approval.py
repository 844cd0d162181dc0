"""``loopmesh approve|deny --session S CALL_ID``: decide a tool call waiting for approval."""

from __future__ import annotations

import argparse
import time

from schemas import ApprovalDecision

from .remote import add_remote_options, client_config, open_remote, token

#: Quiet at a terminal: only its own line, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """Approve (`loopmesh approve`) or deny (`loopmesh deny`) a tool call that waits for a
person's decision, by its call id (shown by `loopmesh run` and `loopmesh events` in the
approval_required event). The decision is recorded, so a turn that resumes on another
worker still sees it. A denied call returns an error to the model instead of running."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("call_id", type=token("call"), help="the call id to decide")
    parser.add_argument("--session", required=True, type=token("session"), help="session id")
    parser.add_argument("--reason", default="", help="why (the model sees it on a deny)")
    add_remote_options(parser)


async def main(args: argparse.Namespace) -> int:
    approved = args.command == "approve"
    decision = ApprovalDecision(
        tenant=client_config(args).client.tenant, session=args.session, call_id=args.call_id,
        approved=approved, reason=args.reason, at=time.time(),
    )  # fmt: skip
    async with open_remote(args) as remote:
        await remote.send(decision)
    print(f"{'approved' if approved else 'denied'} call {args.call_id} in session {args.session}")
    return 0
