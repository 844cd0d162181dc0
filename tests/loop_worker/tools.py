"""Tools for the durable loop-worker tests, served by real tool workers
(``loopmesh tool-worker --module tests.loop_worker.tools``)."""

from __future__ import annotations

import asyncio

from tool_worker.local import tool


@tool(timeout_s=60)
async def count(path: str, seconds: float = 0.0, label: str = "") -> str:
    """Append a line to the file at ``path`` (a side effect a test counts), then wait."""
    await asyncio.to_thread(_append, path, label)
    await asyncio.sleep(seconds)
    return f"counted {label}".strip()


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{line}\n")


@tool
def echo(text: str) -> str:
    """Return the text."""
    return text


@tool(needs_approval=True)
def guarded(path: str, label: str = "") -> str:
    """Append to a file, once a person approved."""
    _append(path, label)
    return "written"
