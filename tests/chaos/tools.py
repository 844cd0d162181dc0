"""The chaos suite's tool: each execution appends one JSON line to a ledger, its side
effect, after its work (so an execution killed before the line has no effect)."""

from __future__ import annotations

import asyncio
import json
import os
import time

from tool_worker.local import tool


@tool(timeout_s=60)
async def record(ledger: str, label: str, seconds: float = 0.0) -> str:
    """Work for ``seconds``, then append ``label`` to the ledger at ``ledger``."""
    started = time.time()
    await asyncio.sleep(seconds)
    line = {"label": label, "pid": os.getpid(), "start": started, "end": time.time()}
    await asyncio.to_thread(_append, ledger, json.dumps(line))
    return f"recorded {label}"


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
