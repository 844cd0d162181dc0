"""The tools ``bench/distributed.py``'s tool worker serves: ``echo``, ``async`` like the
in-process engine's echo (a plain ``def`` tool would run on a thread, a hop the
in-process side does not pay), ``count``, a slow tool whose calls can be counted
(the memory section), and ``hold``, a call that waits until the bench releases it
(``bench/recovery.py``)."""

from __future__ import annotations

import asyncio
import os

from tool_worker.local import tool


@tool
async def echo(text: str) -> str:
    """Return the text."""
    return text


@tool(timeout_s=60)
async def count(path: str, seconds: float = 0.0, label: str = "") -> str:
    """Append a line to the file at ``path`` (a call the bench counts), then wait."""
    await asyncio.to_thread(_append, path, label)
    await asyncio.sleep(seconds)
    return f"counted {label}".strip()


@tool(timeout_s=120)
async def hold(path: str, release: str) -> str:
    """Append a line to the file at ``path``, then wait until the file ``release``
    exists (the recovery bench releases the call right after its kill -9)."""
    await asyncio.to_thread(_append, path, "")
    await released(release)
    return "released"


async def released(path: str, timeout: float = 120) -> None:
    """Return once the file at ``path`` exists (polled every 10 ms)."""
    async with asyncio.timeout(timeout):
        while True:
            if os.path.exists(path):  # noqa: ASYNC240  (a stat: no thread hop in the loop)
                return
            await asyncio.sleep(0.01)


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{line}\n")
