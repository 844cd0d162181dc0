"""Run one turn with loopmesh's Python client and print its events until it ends.

    .venv/bin/python examples/run_turn.py "What is 17 * 23?"
    .venv/bin/python examples/run_turn.py --gateway http://127.0.0.1:8080 --session s1 \\
        "What is 17 * 23?"
    .venv/bin/python examples/run_turn.py --agent calc --approve "What is 2 ** 10?"

Straight to NATS (``--url``, default nats://127.0.0.1:4222, as tenant ``--tenant``), or
through the HTTP gateway (``--gateway URL``, with ``--api-key`` where it has keys): the
same code either way (docs/CLIENT.md). A tool call that waits for a person's approval
is approved with ``--approve`` and denied without it. Exits 0 when the turn completed,
1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio

from loopmesh import Client
from loopmesh.client import ClientError, TurnRefused
from schemas.events import ApprovalRequired, LoopEnd, Message, ToolCallEvent, ToolResultEvent


async def run(client: Client, text: str, session: str, agent: str | None, approve: bool) -> int:
    async for event in client.run(text, session=session, agent=agent):
        match event:
            case ToolCallEvent(server=server, tool=tool, arguments=arguments):
                print(f"tool_call {server}.{tool} {arguments}")
            case ToolResultEvent(content=content):
                print(f"tool_result {content[:200]}")
            case ApprovalRequired(call_id=call_id, tool=tool):
                print(f"approval_required {tool}: {'approving' if approve else 'denying'}")
                decide = client.approve if approve else client.deny
                await decide(session, call_id, reason="decided by examples/run_turn.py")
            case Message(content=content):
                print(f"message {content[:200]}")
            case LoopEnd(reason=reason, content=content):
                print(f"loop_end {reason}: {content}")
                return 0 if reason in ("task_completion", "converse", "ask_question") else 1
            case _:
                print(event.type)
    return 1  # (never: a turn's events end with its loop_end)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", help="the task")
    parser.add_argument("--url", default="nats://127.0.0.1:4222", help="NATS")
    parser.add_argument("--tenant", default="local", help="the tenant, over NATS")
    parser.add_argument("--gateway", help="the gateway's URL, instead of NATS")
    parser.add_argument("--api-key", help="the gateway's API key")
    parser.add_argument("--session", default="s1")
    parser.add_argument("--agent", help="the named agent that runs the turn")
    parser.add_argument("--approve", action="store_true", help="approve calls that ask")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.gateway:
        client = Client(gateway=args.gateway, api_key=args.api_key)
    else:
        client = Client(nats_url=args.url, tenant=args.tenant)
    try:
        async with client, asyncio.timeout(args.timeout):
            return await run(client, args.text, args.session, args.agent, args.approve)
    except TurnRefused as refused:
        print(f"refused: {refused}")
    except ClientError as exc:  # unreachable, unauthorized, not set up...
        print(f"error: {exc}")
    except TimeoutError:
        print(f"no loop_end within {args.timeout:g}s: is a loop worker running (`loopmesh up`)?")
    return 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
