"""Graceful shutdown: SIGTERM or SIGINT sets an event; the service then drains within a
deadline (the shape of nats.py's ``examples/micro/service.py``)::

    async with shutdown_on_signals() as stop:
        nc = await connect(settings.nats)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run(stop))
            await stop.wait()
        await drain_within(10.0, worker.finish_in_flight, nc.drain)

A second signal while stopping cancels the task that entered the block, for the person
who presses Ctrl-C twice; the block then raises :class:`~loopmesh.errors.StoppedAtOnce`
(the command line exits 128 + the signal's number, with one line and no traceback). A
repeat within :data:`REPEAT_S` of the first is the same press delivered twice, and is
ignored: a terminal's Ctrl-C reaches the whole process group, and a shell that traps it
(``make run``) passes it on again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from .errors import StoppedAtOnce

log = logging.getLogger("loopmesh.shutdown")

#: Seconds after the first signal within which a repeat is the same request delivered twice.
REPEAT_S = 1.0

#: A drain step: an awaitable, or a callable returning an awaitable (or nothing).
Step = Awaitable[Any] | Callable[[], Any]


@asynccontextmanager
async def shutdown_on_signals(
    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> AsyncIterator[asyncio.Event]:
    """Yield an event that the first of ``signals`` sets; restore the handlers on exit."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.current_task()
    installed: list[signal.Signals] = []
    first_at: float | None = None
    forced: signal.Signals | None = None

    def on_signal(sig: signal.Signals) -> None:
        nonlocal first_at, forced
        now = time.monotonic()
        if not stop.is_set():
            log.info("stopping on %s", sig.name)
            first_at = now
            stop.set()
        elif first_at is not None and now - first_at < REPEAT_S:
            log.debug("%s again %.3f s after the first: the same request", sig.name, now - first_at)
        elif task is not None and forced is None:
            log.warning("second %s: stopping now", sig.name)
            forced = sig
            task.cancel()

    try:
        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        yield stop
    except asyncio.CancelledError:
        if forced is None or task is None:
            raise
        task.uncancel()
        raise StoppedAtOnce(forced) from None
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def drain_within(deadline_s: float, *steps: Step) -> bool:
    """Run ``steps`` in order, all within ``deadline_s`` seconds.

    A step that fails is logged and the next one runs; when the deadline passes the
    step in progress is cancelled and the rest are skipped. Returns True when every
    step finished cleanly in time.
    """
    end = time.monotonic() + deadline_s
    clean = True
    for step in steps:
        remaining = end - time.monotonic()
        name = _name(step)
        if remaining <= 0:
            log.warning("drain deadline of %ss passed; skipped %s", deadline_s, name)
            _discard(step)
            clean = False
            continue
        try:
            async with asyncio.timeout(remaining):
                result = step() if callable(step) else step
                if inspect.isawaitable(result):
                    await result
        except TimeoutError:
            log.warning("drain deadline of %ss passed during %s", deadline_s, name)
            clean = False
        except Exception:
            log.exception("drain step %s failed", name)
            clean = False
    return clean


def _name(step: Step) -> str:
    return getattr(step, "__qualname__", None) or type(step).__name__


def _discard(step: Step) -> None:
    """Close a coroutine that will not run, so it does not warn 'never awaited'."""
    if inspect.iscoroutine(step):
        step.close()
