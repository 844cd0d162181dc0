"""The echo tool ``bench/distributed.py``'s tool worker serves: ``async``, like the
in-process engine's echo (a plain ``def`` tool would run on a thread, a hop the
in-process side does not pay)."""

from __future__ import annotations

from tool_worker.local import tool


@tool
async def echo(text: str) -> str:
    """Return the text."""
    return text
