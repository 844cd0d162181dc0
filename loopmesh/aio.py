"""Asyncio helpers that the services share.

:func:`both` awaits two things at once with one task instead of ``gather``'s two (a
task costs more than the request it waits for on a loop worker's hot path).

nats-py catches ``CancelledError`` when a cancel lands while it flushes
(``Client._send_command`` → ``_flush_pending``) and returns normally, so a task cancelled
during a NATS call can carry on as if nothing happened. Loops that run until cancelled
call :func:`raise_if_cancelled` after their NATS calls, so a cancel is never lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

A = TypeVar("A")
B = TypeVar("B")


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if someone asked to cancel the current task."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def both(first: Awaitable[A], second: Coroutine[Any, Any, B]) -> tuple[A, B]:
    """``first`` and ``second`` concurrently: ``second`` in a task, ``first`` in this
    one. If ``first`` raises, ``second`` is cancelled (and awaited) before it propagates;
    if ``second`` raises, that propagates once ``first`` is done."""
    task = asyncio.ensure_future(second)
    try:
        a = await first
    except BaseException:
        task.cancel()
        await asyncio.wait((task,))
        if not task.cancelled():
            task.exception()  # retrieved: its failure is not the one that matters
        raise
    return a, await task
