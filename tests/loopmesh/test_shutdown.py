import asyncio
import logging
import os
import signal

import pytest

from loopmesh import shutdown
from loopmesh.errors import StoppedAtOnce
from loopmesh.shutdown import drain_within, shutdown_on_signals


async def test_sigterm_sets_the_stop_event_and_the_handler_is_removed_after():
    before = signal.getsignal(signal.SIGTERM)
    async with shutdown_on_signals() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
    assert signal.getsignal(signal.SIGTERM) == before


async def test_a_second_signal_stops_the_drain_at_once_and_says_so(monkeypatch):
    monkeypatch.setattr(shutdown, "REPEAT_S", 0.05)
    entered = asyncio.Event()
    draining = asyncio.Event()

    async def service() -> None:
        async with shutdown_on_signals((signal.SIGUSR1,)) as stop:
            entered.set()
            await stop.wait()
            draining.set()
            await asyncio.Event().wait()  # a drain that never ends

    task = asyncio.create_task(service())
    await asyncio.wait_for(entered.wait(), 5)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(draining.wait(), 5)
    await asyncio.sleep(0.1)  # past REPEAT_S: a second press, not the first one again
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(StoppedAtOnce, match="stopped at once on a second SIGUSR1") as caught:
        await asyncio.wait_for(task, 5)
    assert caught.value.signal == signal.SIGUSR1
    assert not task.cancelled() and task.cancelling() == 0


class _Repeats(logging.Handler):
    """Sets ``seen`` when the shutdown log says a signal came again for the same request."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "the same request" in record.getMessage():
            self.seen.set()


async def test_the_same_signal_again_at_once_is_one_request_and_the_drain_finishes():
    """A terminal's Ctrl-C reaches the whole process group, and ``make run``'s shell
    passes it on again: the repeat must not cut the drain short."""
    logger = logging.getLogger("loopmesh.shutdown")
    repeats, level = _Repeats(), logger.level
    logger.addHandler(repeats)
    logger.setLevel(logging.DEBUG)
    entered = asyncio.Event()

    async def service() -> str:
        async with shutdown_on_signals((signal.SIGUSR1,)) as stop:
            entered.set()
            await stop.wait()
            await repeats.seen.wait()  # the drain lasts until the repeat was handled
        return "drained"

    try:
        task = asyncio.create_task(service())
        await asyncio.wait_for(entered.wait(), 5)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert await asyncio.wait_for(task, 5) == "drained"
    finally:
        logger.removeHandler(repeats)
        logger.setLevel(level)


async def test_drain_runs_every_step_in_order_and_reports_success():
    done: list[str] = []

    async def flush() -> None:
        done.append("flush")

    assert await drain_within(5, flush, lambda: done.append("sync"), flush())
    assert done == ["flush", "sync", "flush"]


async def test_a_failing_step_is_logged_and_the_next_still_runs(caplog):
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("boom")

    assert not await drain_within(5, boom, lambda: done.append("after"))
    assert done == ["after"]
    assert "boom" in caplog.text


async def test_the_deadline_cancels_the_step_in_progress_and_skips_the_rest():
    cancelled = asyncio.Event()

    async def hang() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def never() -> None:
        raise AssertionError("ran after the deadline")

    assert not await drain_within(0.05, hang, never())
    assert cancelled.is_set()
