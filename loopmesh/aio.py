"""Asyncio helpers that the services share.

nats-py catches ``CancelledError`` when a cancel lands while it flushes
(``Client._send_command`` → ``_flush_pending``) and returns normally, so a task cancelled
during a NATS call can carry on as if nothing happened. Loops that run until cancelled
call :func:`raise_if_cancelled` after their NATS calls, so a cancel is never lost.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if someone asked to cancel the current task."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
