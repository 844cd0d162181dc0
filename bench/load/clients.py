"""The load of ``python -m bench.load``: ``sessions`` clients at once, each running its
share of the turns in sessions of ``per_session`` turns, one turn after another: the next
is published the moment the last one's ``loop_end`` arrives (back to back) or
``think_s`` later (think time). Client ``i`` starts ``i / sessions`` of a turn's nominal
model time after the first, so that the sessions do not stream in lockstep. The first
``watched`` clients' sessions are watched by SSE clients of the gateway
(:class:`~bench.load.watch.Watch`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bench.harness import Ends, turn
from bench.load.watch import Watch

TENANT = "local"  # the gateway's tenant without auth: every session can be watched


@dataclass(frozen=True)
class Shape:
    """One load: ``think_s`` 0 is back to back."""

    sessions: int
    per_session: int
    turns: int
    think_s: float = 0.0
    echo: int = 1  # echo calls per turn: echo + 1 model replies
    watched: int = 0

    @property
    def name(self) -> str:
        return "back-to-back" if not self.think_s else f"think {self.think_s:g} s"


@dataclass
class Turned:
    """One turn as the load generator saw it."""

    turn_id: str
    latency_s: float  # its publish (before the ack) to its loop_end's arrival
    reason: str
    watched: bool


@dataclass
class Load:
    ends: Ends
    watch: Watch
    shape: Shape
    tag: str  # makes every session and turn id of this run new
    stagger_s: float  # spread of the clients' first turns
    timeout_s: float  # a turn without its loop_end after this fails the run
    done: list[Turned] = field(default_factory=list)

    async def run(self) -> float:
        """Run every turn; the wall time from the first publish to the last loop_end."""
        share, extra = divmod(self.shape.turns, self.shape.sessions)
        started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for i in range(self.shape.sessions):
                tg.create_task(self._client(i, share + (i < extra)))
        return time.perf_counter() - started

    async def _client(self, i: int, count: int) -> None:
        # the shape of the load (when each client begins), not a wait for something
        await asyncio.sleep(self.stagger_s * i / self.shape.sessions)
        per, watched = self.shape.per_session, i < self.shape.watched
        for k in range(0, count, per):
            session = f"{self.tag}c{i}s{k // per}"
            async with self._session(session, watched) as ran:
                for n in range(k, min(count, k + per)):
                    if n and self.shape.think_s:
                        await asyncio.sleep(self.shape.think_s)  # the user thinks
                    ran.append(await self._turn(f"{self.tag}c{i}t{n}", session, watched))

    @contextlib.asynccontextmanager
    async def _session(self, session: str, watched: bool) -> AsyncIterator[list[str]]:
        if watched:
            async with self.watch.session(session) as ran:
                yield ran
        else:
            yield []

    async def _turn(self, turn_id: str, session: str, watched: bool) -> str:
        text = f"bench-turn={turn_id}\necho {self.shape.echo}"
        t = turn(turn_id, session, text, tenant=TENANT)
        started = time.perf_counter()
        try:
            end = await self.ends.run(t, self.timeout_s)
        except TimeoutError:
            why = f"turn {turn_id} had no loop_end within {self.timeout_s:g} s"
            raise RuntimeError(why) from None
        self.done.append(Turned(turn_id, time.perf_counter() - started, end.reason, watched))
        return turn_id
