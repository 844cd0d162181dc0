"""Waiting on a condition with a deadline, for state that offers no event to await."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(
    condition: Callable[[], object], timeout: float = 10.0, what: str = ""
) -> None:
    """Return once ``condition()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        await asyncio.sleep(0.01)
