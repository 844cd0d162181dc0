"""The tool ``bench/recovery.py``'s loop-worker runs call: ``hold``, which notes that it
started and waits until the bench releases it (right after its kill -9), and the wait
the peers' held tools share. Served alone, so that the other benches' tool catalogs
stay as they are."""

from __future__ import annotations

import asyncio
import os

from tool_worker.local import tool


@tool(timeout_s=120)
async def hold(path: str, release: str) -> str:
    """Append a line to the file at ``path``, then wait until the file ``release``
    exists."""
    await asyncio.to_thread(mark, path)
    await released(release)
    return "released"


async def released(path: str, timeout: float = 120) -> None:
    """Return once the file at ``path`` exists (polled every 10 ms)."""
    async with asyncio.timeout(timeout):
        while True:
            if os.path.exists(path):  # noqa: ASYNC240  (a stat: no thread hop in the loop)
                return
            await asyncio.sleep(0.01)


def mark(path: str) -> None:
    """A line in the file at ``path``: the bench sees the tool start."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
