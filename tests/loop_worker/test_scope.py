"""TurnScope.race: a turn's cancel interrupts what the loop awaits, in its own task."""

from __future__ import annotations

import asyncio
import time

import pytest

from loop_worker.engine.control import TurnControl
from loop_worker.engine.inmemory import InMemoryEvents
from loop_worker.engine.scope import TurnCancelled, TurnScope
from schemas import Turn


def scope() -> TurnScope:
    turn = Turn(id="t1", tenant="acme", session="s1", input="go")
    return TurnScope(turn, TurnControl(), InMemoryEvents(), time.time)


async def test_returns_what_it_awaits() -> None:
    s = scope()

    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await s.race(work()) == 7
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancel_interrupts_the_wait_and_is_taken_back() -> None:
    s = scope()
    reached = asyncio.Event()
    unwound = []

    async def slow() -> None:
        reached.set()
        try:
            await asyncio.sleep(30)
        finally:
            unwound.append(True)

    async def cancel_later() -> None:
        await reached.wait()
        s.control.cancel("user asked")
        s.control.cancel("twice")  # a second cancel changes nothing

    canceller = asyncio.create_task(cancel_later())
    with pytest.raises(TurnCancelled, match="user asked"):
        await s.race(slow())
    await canceller
    assert unwound == [True]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation is left pending for the next await


async def test_an_already_cancelled_turn_does_not_start_the_work() -> None:
    s = scope()
    s.control.cancel("stop")
    started = []

    async def work() -> None:
        started.append(True)

    with pytest.raises(TurnCancelled):
        await s.race(work())
    assert started == []


async def test_a_swallowed_cancel_still_ends_the_turn() -> None:
    s = scope()
    reached = asyncio.Event()

    async def stubborn() -> str:
        reached.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # as nats-py does while it flushes
        return "finished anyway"

    async def cancel_later() -> None:
        await reached.wait()
        s.control.cancel("stop")

    canceller = asyncio.create_task(cancel_later())
    with pytest.raises(TurnCancelled):
        await s.race(stubborn())
    await canceller
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_cancelling_the_task_itself_still_propagates() -> None:
    s = scope()
    reached = asyncio.Event()

    async def racer() -> None:
        await s.race(asyncio.sleep(30))

    async def body() -> None:
        reached.set()
        await racer()

    task = asyncio.create_task(body())
    await reached.wait()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not s.control.cancelled.is_set()


async def test_both_cancels_at_once_propagate_the_task_cancel() -> None:
    s = scope()
    reached = asyncio.Event()

    async def body() -> None:
        reached.set()
        await s.race(asyncio.sleep(30))

    task = asyncio.create_task(body())
    await reached.wait()
    await asyncio.sleep(0)
    task.cancel()  # the service hands the turn back...
    s.control.cancel("stop")  # ...while the user cancels it
    with pytest.raises(asyncio.CancelledError):
        await task
