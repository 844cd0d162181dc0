"""A real loop-worker process whose LLM answers at once, for ``bench/distributed.py``.

    python -m bench.instant_worker [--config PATH] [--nats-url URL] [--log-level LEVEL]
    python bench/instant_worker.py ...      (the same, from the repository root or not)

It is ``loopmesh loop-worker`` with the OpenAI client swapped for :class:`InstantLLM`,
in this process: a :class:`~loop_worker.service.LoopWorker` on the shared turns
consumer, configured from the same TOML file and ``LOOPMESH_NATS__*``,
``LOOPMESH_LOOP__*`` and ``LOOPMESH_LOOP_WORKER__*`` variables, logging "loop worker
ready" once it pulls, and stopping gracefully on SIGTERM. The in-process side of the
benchmark imports :class:`InstantLLM` from here, so both paths run the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.protocols import Completion, OnDelta, OnRetry
from loop_worker.service import LoopWorker
from loopmesh import tracing
from loopmesh.aio import run
from loopmesh.cli import add_common_options, config_from_args
from loopmesh.log import setup_logging
from loopmesh.nats import connect
from loopmesh.provision import provision_all
from loopmesh.shutdown import shutdown_on_signals
from schemas import ChatMessage, ToolCall

#: "echo N" as the last line of a turn's input: the turn makes N echo calls.
ECHO_COUNT = re.compile(r"echo (\d+)")


def echo_plan(messages: Sequence[ChatMessage]) -> tuple[int, int]:
    """(echo calls this turn asks for, echo results it has): the turn's input is the
    last user message the loop did not add (``name`` unset); "echo N" as its last line
    asks for N, anything else for one."""
    results = 0
    for m in reversed(messages):
        if m.role == "tool":
            results += 1
        elif m.role == "user" and m.name is None:
            # the engine puts the input last, after the tools and rules: read only that
            found = ECHO_COUNT.fullmatch(m.content.rstrip().rpartition("\n")[2].strip())
            return (int(found.group(1)) if found else 1), results
    return 1, results


class InstantLLM:
    """A zero-latency model: calls echo until the turn has as many results as its input
    asks for (see :func:`echo_plan`), then ``task_completion``. Stateless (it reads the
    messages), so every session of a worker shares one."""

    def __init__(self, echo_name: str = "local__echo") -> None:
        self.echo_name = echo_name
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
        wanted, results = echo_plan(messages)
        name, args = (
            ("task_completion", {"result": "ok"})
            if results >= wanted
            else (self.echo_name, {"text": "hi"})
        )
        call = ToolCall(id=f"c{self.calls}", name=name, arguments=json.dumps(args))
        return Completion(
            content="", tool_calls=(call,), finish_reason="tool_calls", model="instant"
        )


async def serve(config: LoopWorkerConfig, stop: asyncio.Event) -> None:
    """Connect, provision (unless ``[loop_worker] provision`` is false) and run a loop
    worker with :class:`InstantLLM` until ``stop`` is set."""
    nc = await connect(config.nats, name="instant-loop-worker")
    try:
        if config.loop_worker.provision:
            await provision_all(nc, config.nats)
        await LoopWorker(nc, config, llm=InstantLLM()).run(stop)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()


async def main(args: argparse.Namespace) -> None:
    config = config_from_args(LoopWorkerConfig, args)
    stop_tracing = tracing.setup("loopmesh-loop-worker")  # as the CLI does: OTEL_*, else off
    try:
        async with shutdown_on_signals() as stop:
            await serve(config, stop)
    finally:
        stop_tracing()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_options(parser)
    arguments = parser.parse_args()
    setup_logging(arguments.log_level or "INFO", arguments.log_json)
    with contextlib.suppress(KeyboardInterrupt):
        run(main(arguments))
