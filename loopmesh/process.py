"""Child processes that never outlive the process that started them, and are watched.

The embedded nats-server and llama.cpp server run in their own session, so a
terminal's Ctrl-C reaches only loopmesh, which stops them in order. If loopmesh is
killed outright (SIGKILL, OOM), the kernel sends them SIGTERM: on Linux, via
``prctl(PR_SET_PDEATHSIG)`` set in the child before it executes the binary.
:func:`terminate` stops one in order: SIGTERM, then SIGKILL if it does not exit in time.

:func:`keep_running` watches one child until a stop: a child that dies is reported
(its exit status and the last lines of its log) and started again, on the same port,
after 1, 2, then 4 seconds; a child that dies a fourth time without having run
:data:`STEADY_S` seconds since it was last started raises :class:`ChildDied`, and the
process that started it stops rather than run on without it.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
import time
from collections.abc import Callable
from typing import Protocol

from .aio import unless
from .errors import LoopmeshError

#: Restarts in a row before a child that keeps dying is given up on.
MAX_RESTARTS = 3
#: Seconds before the first restart; doubled for each one after it.
BACKOFF_S = 1.0
#: A child that ran this long since it was last started is well again: its count restarts.
STEADY_S = 60.0

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


class Child(Protocol):
    """A supervised child process (``NatsServer``, ``LlamaServer``)."""

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> None: ...

    async def wait(self) -> int:
        """Until the process exits; its exit code."""
        ...

    def log_tail(self) -> str:
        """The last lines it logged, for a person to read why it exited."""
        ...


class ChildDied(LoopmeshError):
    """A child process kept dying: it was restarted :data:`MAX_RESTARTS` times in a row."""

    def __init__(self, name: str, code: int, tail: str) -> None:
        self.name, self.code, self.tail = name, code, tail
        super().__init__(f"{name} {exit_status(code)}, {MAX_RESTARTS} restarts in a row")


def exit_status(code: int) -> str:
    """``exited with code 1``, or ``was killed by SIGKILL`` for a negative code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def keep_running(
    name: str, child: Child, stop: asyncio.Event, say: Callable[[str], None]
) -> None:
    """Watch ``child`` (started) until ``stop`` is set: restart it when it dies, saying so
    with its exit status and log tail; raise :class:`ChildDied` when it keeps dying."""
    restarts = 0
    started = time.monotonic()
    codes: list[int] = []

    async def exited() -> None:
        codes.append(await child.wait())

    while True:
        if not await unless(stop, exited()):
            return
        code = codes.pop()
        if time.monotonic() - started >= STEADY_S:
            restarts = 0
        tail = child.log_tail()
        say(f"error     {name} {exit_status(code)}" + ("; the end of its log:" if tail else ""))
        for line in tail.splitlines():
            say(f"          | {line}")
        if restarts == MAX_RESTARTS:
            raise ChildDied(name, code, tail)
        delay = BACKOFF_S * 2**restarts
        restarts += 1
        say(f"restart   {name} in {delay:g} s ({restarts} of {MAX_RESTARTS} in a row)")
        if not await unless(stop, asyncio.sleep(delay)):
            return
        await child.start()
        started = time.monotonic()
        say(f"restart   {name} is back (pid {child.pid}, restart {restarts} of {MAX_RESTARTS})")
