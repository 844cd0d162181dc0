"""The engine's own cost per iteration, with a zero-latency LLM and an echo tool.

    python bench/engine.py [--iterations 200] [--turns 5] [--format native|text]

Everything runs in one process: a scripted LLM that answers at once (one echo call per
iteration, then ``task_completion``), ``LocalTools`` with an async echo, in-memory
events and store. The time between consecutive ``loop_iteration`` events is one
iteration: prompt assembly, the budget gate (token counting), the LLM call's events,
the tool call and its events, the checkpoint. Prints p50 / mean / p95 in µs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop_worker.engine import Engine
from loop_worker.engine.inmemory import InMemoryStore, LocalTools
from loop_worker.engine.protocols import Completion, OnDelta, OnRetry
from loop_worker.engine.settings import LoopSettings
from schemas import ChatMessage, ToolCall, Turn
from schemas.events import Event, LoopIteration


class InstantLLM:
    """Calls echo ``n`` times (one call per reply), then ``task_completion``."""

    def __init__(self, n: int, text_format: bool) -> None:
        self.n = n
        self.text_format = text_format
        self.calls = 0

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
    ) -> Completion:
        self.calls += 1
        done = self.calls > self.n
        name, args = ("task_completion", {"result": "ok"}) if done else ("echo", {"text": "hi"})
        if self.text_format:
            server = "loop" if done else "local"
            body = json.dumps({"server_name": server, "tool_name": name, "arguments": args})
            content = f"<thinking>next step</thinking>Calling it. <tool>{body}</tool>"
            if on_delta is not None:
                for i in range(0, len(content), 16):
                    await on_delta(content[i : i + 16])
            return Completion(content=content, finish_reason="stop")
        if on_delta is not None:
            await on_delta("Calling it.")
        function = name if done else f"local__{name}"
        call = ToolCall(id=f"c{self.calls}", name=function, arguments=json.dumps(args))
        return Completion(content="Calling it.", tool_calls=(call,), finish_reason="tool_calls")


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    async def emit(self, event: Event) -> None:
        self.events.append(event)


async def echo(text: str) -> str:
    return text


async def one_turn(iterations: int, text_format: bool, session: str) -> list[float]:
    tools = LocalTools()
    tools.add(echo)
    sink = ListSink()
    engine = Engine(
        settings=LoopSettings(
            max_iterations=iterations + 1,
            tool_format="text" if text_format else "native",
            context_budget_tokens=10_000_000,
        ),
        llm=InstantLLM(iterations, text_format),
        tools=tools,
        events=sink,
        store=InMemoryStore(),
        clock=time.perf_counter,
    )
    turn = Turn(id=f"t-{session}", tenant="bench", session=session, input="Echo hi many times.")
    end = await engine.run(turn)
    assert end is not None and end.reason == "task_completion", end
    stamps = [e.ts for e in sink.events if isinstance(e, LoopIteration)]
    return [(b - a) * 1e6 for a, b in itertools.pairwise(stamps)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--format", choices=("native", "text"), default="native")
    args = parser.parse_args()
    await one_turn(5, args.format == "text", "warmup")
    samples: list[float] = []
    for n in range(args.turns):
        samples += await one_turn(args.iterations, args.format == "text", f"s{n}")
    samples.sort()
    p95 = samples[int(len(samples) * 0.95)]
    print(
        f"engine ({args.format} tools), {len(samples)} iterations: "
        f"p50 {statistics.median(samples):.0f} µs, mean {statistics.fmean(samples):.0f} µs, "
        f"p95 {p95:.0f} µs per iteration"
    )


if __name__ == "__main__":
    asyncio.run(main())
