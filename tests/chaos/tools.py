"""The chaos suite's tool: each execution appends one JSON line to a ledger, its side
effect, after its work (so an execution killed before the line has no effect), with the
call's idempotency key. Its start goes to ``<ledger>.started`` first (a partition run
cuts a tool worker off while it is in a call)."""

from __future__ import annotations

import asyncio
import json
import os
import time

from tool_worker.context import ToolContext
from tool_worker.local import tool


@tool(timeout_s=60)
async def record(
    ledger: str, label: str, seconds: float = 0.0, ctx: ToolContext | None = None
) -> str:
    """Work for ``seconds``, then append ``label`` to the ledger at ``ledger``."""
    started = time.time()
    line = {"label": label, "pid": os.getpid(), "start": started}
    await asyncio.to_thread(_append, ledger + ".started", json.dumps(line))
    await asyncio.sleep(seconds)
    line |= {"end": time.time(), "key": ctx.idempotency_key if ctx is not None else ""}
    await asyncio.to_thread(_append, ledger, json.dumps(line))
    return f"recorded {label}"


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
