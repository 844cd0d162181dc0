"""Stopping a worker at any moment of its start: the stop is never lost."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js import JetStreamContext

from tool_worker import Registry
from tool_worker.builtins import builtin_tools
from tool_worker.service import ToolWorker


async def test_a_worker_stopped_before_it_finished_starting_still_returns(
    nc: Client, js: JetStreamContext
) -> None:
    # The stop lands while the catalog task makes its first NATS calls; nats-py swallows
    # a cancel that arrives while it flushes, and the catalog loop used to run on.
    for _ in range(10):
        registry = Registry()
        for tool in builtin_tools():
            registry.add(tool)
        stop = asyncio.Event()
        stop.set()
        async with asyncio.timeout(15):
            await ToolWorker(nc, registry, pool="default").run(stop)
