"""Per-iteration token counting cost of the agent loop, against history length.

Each iteration appends an assistant message (with a tool call) and its tool result to a
history of N messages and calls ``TokenCounter.count_all(history)``, as the engine does
before every LLM round. Counting is incremental when the cost does not grow with N:
the target is cost(1000) / cost(10) <= 1.2.

    python bench/token_counting.py [--iterations 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop_worker.engine.tokens import TokenCounter
from schemas import ChatMessage, ToolCall

SIZES = (10, 100, 1000)
VOCABULARY = [
    "the",
    "agent",
    "reads",
    "files",
    "runs",
    "tools",
    "and",
    "answers",
    "questions",
    "about",
    "nats",
    "jetstream",
    "streams",
    "consumers",
    "subjects",
    "kv",
    "buckets",
    "leases",
    "error",
    "retry",
    "timeout",
    "path",
    "config",
    "value",
    "result",
    "function",
    "class",
    "import",
    "return",
    "async",
    "await",
    "def",
    "self",
    "None",
    "True",
    "False",
    "0",
    "1",
    "42",
    "200",
    "404",
]


def prose(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(VOCABULARY)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def exchange(rng: random.Random, n: int) -> list[ChatMessage]:
    """An assistant message calling a tool, and the tool's result (up to a few KB)."""
    call = ToolCall(id=f"call_{n}", name="read_file", arguments=f'{{"path": "src/m{n}.py"}}')
    return [
        ChatMessage(role="assistant", content=prose(rng, rng.randint(0, 600)), tool_calls=(call,)),
        ChatMessage(role="tool", content=prose(rng, rng.randint(100, 4_000)), tool_call_id=call.id),
    ]


def history(rng: random.Random, n: int) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=prose(rng, 2_000))]
    while len(messages) < n:
        if rng.random() < 0.2:
            messages.append(ChatMessage(role="user", content=prose(rng, rng.randint(20, 500))))
        else:
            messages.extend(exchange(rng, len(messages)))
    return messages[:n]


async def per_iteration(n: int, iterations: int) -> tuple[float, float]:
    """Mean seconds of count_all per iteration: incremental, and after a reordering."""
    rng = random.Random(n)
    messages = history(rng, n)
    new = [exchange(random.Random(i), i) for i in range(iterations)]  # same for every n
    counter = TokenCounter()
    await counter.count_all(messages)  # what earlier iterations already counted
    elapsed = 0.0
    for pair in new:
        messages.extend(pair)
        start = time.perf_counter()
        await counter.count_all(messages)
        elapsed += time.perf_counter() - start
    # The slow path: a history that is not an extension of the last one (e.g. pruned).
    start = time.perf_counter()
    await counter.count_all(messages[1:])
    resum = time.perf_counter() - start
    return elapsed / iterations, resum


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    TokenCounter()  # load the encoding once, outside the measurements
    costs: dict[int, float] = {}
    print(f"{'N':>6} {'per iteration':>14} {'re-sum, cached':>15}")
    for n in SIZES:
        runs = [await per_iteration(n, args.iterations) for _ in range(args.repeats)]
        costs[n] = statistics.median(r[0] for r in runs)
        resum = statistics.median(r[1] for r in runs)
        print(f"{n:>6} {costs[n] * 1e6:>11.1f} us {resum * 1e6:>12.1f} us")
    ratio = costs[1000] / costs[10]
    verdict = "incremental" if ratio <= 1.2 else "NOT incremental"
    print(f"cost(1000) / cost(10) = {ratio:.3f} ({verdict}; target <= 1.2)")


if __name__ == "__main__":
    asyncio.run(main())
