import asyncio
import os
import subprocess
import sys

import pytest

from loopmesh.aio import both, raise_if_cancelled, unless


async def test_a_cancel_that_a_library_swallowed_is_raised_again() -> None:
    swallowed = asyncio.Event()

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:  # what nats-py's flush does
                swallowed.set()
            raise_if_cancelled()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):
            await task
    assert swallowed.is_set()


async def test_without_a_cancel_nothing_is_raised() -> None:
    raise_if_cancelled()


async def test_both_returns_both_results_and_overlaps_them() -> None:
    a_started, b_started = asyncio.Event(), asyncio.Event()

    async def side(mine: asyncio.Event, other: asyncio.Event, value: str) -> str:
        mine.set()
        await other.wait()  # returns only while the other side runs too
        return value

    async with asyncio.timeout(10):  # run one after the other, neither would return
        a, b = await both(side(a_started, b_started, "a"), side(b_started, a_started, "b"))
    assert (a, b) == ("a", "b")


async def test_both_cancels_the_second_when_the_first_fails() -> None:
    unwound = []

    async def second() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            unwound.append(True)

    async def first() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("first failed")

    with pytest.raises(ValueError, match="first failed"):
        await both(first(), second())
    assert unwound == [True]


async def test_both_raises_what_the_second_raised() -> None:
    async def second() -> None:
        raise KeyError("second failed")

    with pytest.raises(KeyError):
        await both(_later(0.01, "a"), second())


async def test_unless_gives_up_work_once_the_event_is_set_and_otherwise_finishes_it() -> None:
    event = asyncio.Event()
    asyncio.get_running_loop().call_soon(event.set)
    assert await unless(event, asyncio.Event().wait()) is False  # cancelled and awaited
    assert await unless(asyncio.Event(), _later(0, "done")) is True
    with pytest.raises(KeyError):
        await unless(asyncio.Event(), _raises(KeyError("work failed")))


async def _raises(exc: Exception) -> None:
    raise exc


async def _later(delay: float, value: str) -> str:
    await asyncio.sleep(delay)
    return value


RUN_PROBE = """
import asyncio, gc, sys
from loopmesh.aio import GC_YOUNG, run
from loopmesh.settings import RuntimeConfig, load

async def probe():
    return type(asyncio.get_running_loop()).__module__, gc.get_threshold()[0]

loop, young = run(probe(), event_loop=load(RuntimeConfig).runtime.event_loop)
print(loop.split(".")[0], young == GC_YOUNG, gc.get_freeze_count() > 1000)
"""


@pytest.mark.parametrize(
    ("choice", "loop"), [(None, "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_run_picks_uvloop_unless_the_setting_says_asyncio_and_sets_the_collector_for_a_service(
    choice: str | None, loop: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LOOPMESH_RUNTIME__EVENT_LOOP"}
    if choice is not None:
        env["LOOPMESH_RUNTIME__EVENT_LOOP"] = choice
    out = subprocess.run(
        [sys.executable, "-c", RUN_PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [loop, "True", "True"]
