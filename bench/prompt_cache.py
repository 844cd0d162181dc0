"""The share of prompt tokens a provider's prompt cache can serve over one session.

    python -m bench.prompt_cache [--turns 10] [--calls 2] [--format native|text]

One session of ``--turns`` turns, each ``--calls`` echo calls and then
``task_completion``, run by the engine with the real ``openai``-based LLM client over
HTTP against the fake OpenAI-compatible server with its prompt cache on: it reports as
``cached_tokens`` the tokens of the longest run of leading messages (under the same model
and tools) that an earlier request began with, as providers' prefix caches do (without
their minimum length). Prints, per turn and in all, the prompt tokens sent and the share
of them cached, read from the ``llm_response`` events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop_worker.engine import Engine
from loop_worker.engine.inmemory import InMemoryEvents, InMemoryStore, LocalTools
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings, LoopSettings
from loopmesh.testing.fake_llm import FakeLLM, Reply, text, tool_calls
from schemas import Turn
from schemas.events import LLMResponse


async def echo(text: str) -> str:
    """Return the text."""
    return text


async def session(turns: int, calls: int, text_format: bool) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per turn."""
    tools = LocalTools()
    tools.add(echo)
    events = InMemoryEvents()
    async with FakeLLM(prompt_cache=True) as fake:
        llm = OpenAILLM(LLMSettings(base_url=fake.base_url, api_key="bench", model="fake-model"))
        engine = Engine(
            settings=LoopSettings(
                max_iterations=calls + 2, tool_format="text" if text_format else "native"
            ),
            llm=llm,
            tools=tools,
            events=events,
            store=InMemoryStore(),
        )
        figures = []
        try:
            for n in range(1, turns + 1):
                for c in range(calls):
                    fake.script(reply(text_format, "local", "echo", {"text": f"step {c} " * 40}))
                fake.script(reply(text_format, "loop", "task_completion", {"result": f"done {n}"}))
                turn = Turn(
                    id=f"t{n}", tenant="bench", session="s1", input=f"Echo the steps, take {n}."
                )
                end = await engine.run(turn)
                assert end is not None and end.reason == "task_completion", end
                usage = [
                    e.usage
                    for e in events.of(LLMResponse)
                    if e.turn_id == turn.id and e.usage is not None
                ]
                figures.append(
                    (sum(u.prompt_tokens for u in usage), sum(u.cached_tokens for u in usage))
                )
        finally:
            await llm.aclose()
    return figures


def reply(text_format: bool, server: str, tool: str, arguments: dict[str, str]) -> Reply:
    """A call of ``tool``, natively or in the text format."""
    if not text_format:
        name = tool if server == "loop" else f"{server}__{tool}"
        return tool_calls((name, arguments))
    body = json.dumps({"server_name": server, "tool_name": tool, "arguments": arguments})
    return text(f"Calling it. <tool>{body}</tool>")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_cache", description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--calls", type=int, default=2, help="echo calls per turn")
    parser.add_argument("--format", choices=("native", "text"), default="native")
    args = parser.parse_args()
    figures = asyncio.run(session(args.turns, args.calls, args.format == "text"))
    print(f"prompt cache over one session ({args.format} tools, {args.calls} calls a turn)")
    for n, (prompt, cached) in enumerate(figures, 1):
        print(f"  turn {n:>3}: {prompt:>7} prompt tokens, {cached / prompt:6.1%} cached")
    prompt = sum(p for p, _ in figures)
    cached = sum(c for _, c in figures)
    print(f"  all turns: {prompt} prompt tokens, {cached} cached: {cached / prompt:.1%}")


if __name__ == "__main__":
    main()
