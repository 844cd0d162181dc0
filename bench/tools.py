"""The tools ``bench/distributed.py``'s tool worker serves: ``echo``, ``async`` like the
in-process engine's echo (a plain ``def`` tool would run on a thread, a hop the
in-process side does not pay), and ``count``, a slow tool whose calls can be counted
(the memory and kill -9 sections)."""

from __future__ import annotations

import asyncio

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


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{line}\n")
