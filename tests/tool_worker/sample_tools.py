"""Tools that the tests (and the benchmark) load by import path."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from tool_worker import ToolContext, ToolError, tool


@tool
async def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool(timeout_s=60)
async def sleep(seconds: float) -> str:
    """Sleep, then say for how long."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@tool(timeout_s=60)
def record(path: str, tag: str, seconds: float = 0.0) -> str:
    """Append a line to a file (so a test can count how often a call ran), after a pause."""
    with open(path, "a") as f:
        f.write(f"{tag} {os.getpid()} start\n")
    time.sleep(seconds)
    with open(path, "a") as f:
        f.write(f"{tag} {os.getpid()} done\n")
    return f"{tag} by {os.getpid()}"


@tool(timeout_s=0.2)
async def too_slow() -> str:
    """Never finishes within its timeout."""
    await asyncio.sleep(10)
    return "unreachable"


@tool
def explode(reason: str) -> str:
    """Raise an exception."""
    raise RuntimeError(f"exploded: {reason}")


@tool
def refuse() -> str:
    """Raise a ToolError with its own code."""
    raise ToolError("not today", code="rejected")


@tool(timeout_s=120)
def stall_first(path: str) -> str:
    """The first call (no file at ``path`` yet) creates the file and stalls for a minute;
    later calls return at once. For killing a worker in the middle of a call."""
    try:
        with open(path, "x") as f:
            f.write(f"{os.getpid()}\n")
    except FileExistsError:
        return f"finished by {os.getpid()}"
    print(f"stall_first: stalling in {os.getpid()}", file=sys.stderr, flush=True)
    time.sleep(60)
    return "the first call finished"


@tool(timeout_s=60)
async def nap(seconds: float) -> str:
    """Say on stderr that the nap started, then sleep."""
    print(f"nap: started in {os.getpid()}", file=sys.stderr, flush=True)
    await asyncio.sleep(seconds)
    return f"napped {seconds}"


@tool(timeout_s=120)
def keyed(path: str, stall: bool, ctx: ToolContext) -> str:
    """Append the call's idempotency key and attempt to a file; with ``stall``, the first
    run (the file did not exist) then stalls for a minute, for killing its worker."""
    first = not os.path.exists(path)
    with open(path, "a") as f:
        f.write(f"{ctx.idempotency_key} {ctx.attempt} {os.getpid()}\n")
    if stall and first:
        print(f"keyed: stalling in {os.getpid()}", file=sys.stderr, flush=True)
        time.sleep(60)
    return f"{ctx.idempotency_key} by {os.getpid()}"


@tool
async def maybe_keyed(ctx: ToolContext | None = None) -> str:
    """The idempotency key, or ``none`` outside a worker."""
    return ctx.idempotency_key if ctx is not None else "none"


@tool
def huge(path: str, size: int) -> str:
    """Append a line to a file (to count runs), then return ``size`` characters of text."""
    with open(path, "a") as f:
        f.write("ran\n")
    line = "the quick brown fox jumps over the lazy dog\n"
    return (line * (size // len(line) + 1))[:size]
