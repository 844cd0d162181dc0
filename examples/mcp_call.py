"""Call a loopmesh agent as an MCP tool, with the ``mcp`` SDK's client (docs/AGENTS.md).

    .venv/bin/python examples/mcp_call.py                      # list the agents (tools)
    .venv/bin/python examples/mcp_call.py default "What is 17 * 23?"
    .venv/bin/python examples/mcp_call.py default "And halve it" --session <session printed>
    LOOPMESH_API_KEY=... .venv/bin/python examples/mcp_call.py --url https://gw/mcp calc "..."

Each progress notification (the turn's iterations and tool calls) is printed as it
comes; then the answer, and the session that continues the conversation. Exits 0 when
the agent answered, 1 when its turn ended otherwise (the reason is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client


async def progress(done: float, total: float | None, message: str | None) -> None:
    print(f"  … {message}", file=sys.stderr)


async def run(url: str, key: str | None, agent: str | None, text: str, session: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # a call lasts as long as its turn: let the stream of progress stay open
    timeout = httpx2.Timeout(30.0, read=600.0)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        if agent is None:
            for tool in (await client.list_tools()).tools:
                print(f"{tool.name}: {tool.description}")
            return 0
        arguments = {"input": text} if session is None else {"input": text, "session": session}
        result = await client.call_tool(agent, arguments, progress_callback=progress)
    answer = result.structured_content or {}
    print("\n".join(c.text for c in result.content if c.type == "text"))
    print(f"session: {answer.get('session')} ({answer.get('reason')})", file=sys.stderr)
    return 1 if result.is_error else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("agent", nargs="?", help="the agent to call; none: list them")
    parser.add_argument("input", nargs="?", default="", help="what to ask it")
    parser.add_argument("--url", default="http://127.0.0.1:8080/mcp")
    parser.add_argument("--session", help="continue this conversation")
    args = parser.parse_args()
    key = os.environ.get("LOOPMESH_API_KEY")
    sys.exit(asyncio.run(run(args.url, key, args.agent, args.input, args.session)))


if __name__ == "__main__":
    main()
