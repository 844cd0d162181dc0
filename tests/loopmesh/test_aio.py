import asyncio

import pytest

from loopmesh.aio import raise_if_cancelled


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
