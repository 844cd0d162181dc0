"""Asyncio helpers that the services share.

:func:`run` runs a service's main coroutine on uvloop where it is installed (Linux and
macOS: it is a dependency there), else on the standard loop. A loop worker's turn is
dozens of small NATS messages, timers and task switches, and uvloop's C event loop
and transports take about a tenth off the CPU those cost (``bench/floor.py``, run
with ``[runtime] event_loop = "uvloop"`` and ``"asyncio"``, the standard loop; the
command line reads that setting before the loop starts and passes it here).
It also sets the cyclic garbage collector for a long-running service: what is loaded
before the service starts (every import) is frozen out of collections, and the
youngest generation is collected every :data:`GC_YOUNG` allocations instead of 700.
With the defaults a loop worker under load spent about 9% of its CPU in collections,
mostly rescanning its imports; with these about 2.5% (each young collection then takes
a few milliseconds).

:func:`both` awaits two things at once with one task instead of ``gather``'s two (a
task costs more than the request it waits for on a loop worker's hot path).

nats-py catches ``CancelledError`` when a cancel lands while it flushes
(``Client._send_command`` → ``_flush_pending``) and returns normally, so a task cancelled
during a NATS call can carry on as if nothing happened. Loops that run until cancelled
call :func:`raise_if_cancelled` after their NATS calls, so a cancel is never lost.

:func:`unless` awaits work that an event makes pointless (a stop, a failure).

:func:`quietly` awaits an ack, nak or flush whose failure changes nothing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("loopmesh.aio")

A = TypeVar("A")
B = TypeVar("B")
T = TypeVar("T")


def loop_factory(event_loop: str = "uvloop") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` if ``event_loop`` is ``"uvloop"`` and uvloop is
    installed, else ``None`` (the standard loop)."""
    if event_loop != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


#: Allocations between collections of the youngest generation (CPython's default: 700).
GC_YOUNG = 10_000


def run(main: Coroutine[Any, Any, T], *, event_loop: str = "uvloop") -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks, with the garbage
    collector set for a service."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        return runner.run(main)


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


async def unless(event: asyncio.Event, work: Coroutine[Any, Any, object]) -> bool:
    """Await ``work`` unless ``event`` is set first: then ``work`` is cancelled (and
    awaited) and the answer is False. True when ``work`` finished; what it raised
    propagates."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return False
    task.result()
    return True


async def quietly(op: Awaitable[object]) -> None:
    """``await op``, logging (at debug) instead of raising what it raises: for acks,
    naks and flushes whose failure the protocol already covers (a redelivery)."""
    try:
        await op
    except Exception as exc:
        log.debug("ignored error=%r", exc)
