"""Child processes that never outlive the process that started them.

The embedded nats-server and llama.cpp server run in their own session, so a
terminal's Ctrl-C reaches only loopmesh, which stops them in order. If loopmesh is
killed outright (SIGKILL, OOM), the kernel sends them SIGTERM: on Linux, via
``prctl(PR_SET_PDEATHSIG)`` set in the child before it executes the binary.
:func:`terminate` stops one in order: SIGTERM, then SIGKILL if it does not exit in time.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:  # runs in the child, between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies (Linux);
    ``None`` elsewhere."""
    return _term_with_parent if sys.platform.startswith("linux") else None


async def terminate(proc: asyncio.subprocess.Process, timeout: float) -> int:
    """SIGTERM ``proc`` (unless it has exited), SIGKILL it if it has not exited after
    ``timeout`` seconds; its exit code."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        return await proc.wait()
