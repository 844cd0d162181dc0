"""Discover loopmesh's agents and prompt one, over the NATS Agent Protocol, with its
client (``pip install synadia-ai-agents``; loopmesh's dev extra has it).

    .venv/bin/python examples/nats_agent.py                         # the agents
    .venv/bin/python examples/nats_agent.py default "What is 17 * 23?"
    .venv/bin/python examples/nats_agent.py --session c1 default "And 391 / 17?"

Runs against ``loopmesh up`` (its agents are served in tenant ``local``; ``default`` is
always one, ``[[agents]]`` adds more) or any mesh where ``loopmesh nats-agents`` runs.
``--url`` defaults to ``$LOOPMESH_NATS__URL``, as for ``loopmesh`` commands, else
nats://127.0.0.1:4222. The answer is printed as it streams; a turn that
fails is the protocol's error (exit 1). ``--session`` continues a conversation: prompts
that name the same session are turns of one loopmesh session.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import nats
from synadia_ai.agents import Agents, Envelope, ProtocolError, ResponseChunk


async def main(url: str, name: str | None, text: str, session: str | None) -> int:
    nc = await nats.connect(url)
    agents = Agents(nc=nc)
    try:
        found = {a.session_name: a for a in await agents.discover() if a.agent == "loopmesh"}
        if name is None:
            for agent in sorted(found.values(), key=lambda a: a.session_name):
                print(f"{agent.session_name:16} {agent.owner:10} {agent.description}")
            return 0
        if name not in found:
            print(f"no agent {name!r}; the agents: {', '.join(sorted(found))}", file=sys.stderr)
            return 1
        prompt = Envelope(prompt=text, session=session) if session else text
        try:
            async for chunk in found[name].prompt(prompt):
                if isinstance(chunk, ResponseChunk):
                    print(chunk.text, end="", flush=True)
        except ProtocolError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return 1
        print()
        return 0
    finally:
        await agents.close()
        await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("LOOPMESH_NATS__URL", "nats://127.0.0.1:4222")
    )
    parser.add_argument("--session", help="continue this conversation (a loopmesh session)")
    parser.add_argument("agent", nargs="?", help="the agent to prompt (none: list them)")
    parser.add_argument("text", nargs="?", default="", help="the prompt")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.url, args.agent, args.text, args.session)))
