import asyncio
import os
import signal

import pytest

from loopmesh.shutdown import drain_within, shutdown_on_signals


async def test_sigterm_sets_the_stop_event_and_the_handler_is_removed_after():
    before = signal.getsignal(signal.SIGTERM)
    async with shutdown_on_signals() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
    assert signal.getsignal(signal.SIGTERM) == before


async def test_a_second_signal_cancels_the_task_that_is_stopping():
    entered = asyncio.Event()

    async def service() -> None:
        async with shutdown_on_signals((signal.SIGUSR1,)) as stop:
            entered.set()
            await stop.wait()
            await asyncio.Event().wait()  # a drain that never ends

    task = asyncio.create_task(service())
    await asyncio.wait_for(entered.wait(), 5)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


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
