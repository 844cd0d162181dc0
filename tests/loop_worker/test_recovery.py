"""Recovery with the default settings: real ``python -m loop_worker`` processes with the
default AckWait and lease TTL, one of them killed with SIGKILL mid-turn, on one
nats-server and on a 3-node cluster with R3 streams and buckets."""

import asyncio
import contextlib
import signal
import time

import pytest

from loop_worker.config import ServiceSettings
from loopmesh.testing.durable import (
    Proc,
    connect_fast,
    provision_short,
    stream_events,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import tool_calls
from schemas import Turn
from schemas.streams import LEASE_TTL_S
from tests.conftest import BOTH
from tests.loop_worker.durable import Watch, send_turn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.parametrize("durable", BOTH, indirect=True),
]

DEFAULTS = ServiceSettings()
TURNS = 8
#: A turn on a killed worker ends at most this long after it would have without the kill.
RECOVERY_S = 5.0
#: Each turn is one model reply streamed over about 4 s, then the loop's own
#: ``task_completion``.
REPLY = tool_calls(
    ("task_completion", {"result": "done"}), content="." * 40, chunk_size=1, delay_s=0.1
)


def turn(session: str) -> Turn:
    return Turn(
        id=f"t-{session}", tenant="acme", session=session, input="go", created_at=time.time()
    )


async def test_a_turn_on_a_worker_killed_with_sigkill_ends_within_five_seconds_of_its_time(
    durable,
):
    """Two loop workers with the default timers (AckWait, lease TTL, the scans for
    turns) run 8 turns of about 4 s; one worker gets SIGKILL a second into them. Its
    turns are redelivered, their leases lapse, and the live worker runs them again: each
    ends once, after a ``loop_start`` of the live worker that says ``resumed``, at most
    ``RECOVERY_S`` after the turns that ran through ended (or, if none did, after the
    time a turn took on the same mesh before)."""
    nc = await connect_fast(durable.url)
    procs: list[Proc] = []
    try:
        await provision_short(nc, lease_ttl_s=LEASE_TTL_S, replicas=durable.replicas)
        async with FakeLLM(default=REPLY) as llm:

            async def loop_worker(name: str) -> Proc:
                env = worker_env(
                    durable.url, llm.base_url, name=name, replicas=durable.replicas,
                    ack_wait_s=DEFAULTS.ack_wait_s, lease_ttl_s=DEFAULTS.lease_ttl_s,
                    rescan_s=DEFAULTS.rescan_s, fetch_timeout_s=DEFAULTS.fetch_timeout_s,
                )  # fmt: skip
                proc = Proc("-m", "loop_worker", env=env)
                procs.append(proc)
                return await proc.start("loop worker ready")

            workers = {"w1": await loop_worker("w1"), "w2": await loop_worker("w2")}
            # What a turn takes on this mesh, on this machine, without a kill.
            async with Watch(nc, session="warm") as watch:
                sent = time.monotonic()
                await send_turn(nc, turn("warm"))
                await watch.wait("loop_end", "t-warm", timeout=60)
                usual = time.monotonic() - sent

            sessions = [f"s{i}" for i in range(TURNS)]
            async with contextlib.AsyncExitStack() as stack:
                watches = {
                    s: await stack.enter_async_context(Watch(nc, session=s)) for s in sessions
                }
                sent = time.monotonic()
                for s in sessions:
                    await send_turn(nc, turn(s))
                first = await watches[sessions[0]].wait("loop_start", "t-s0", timeout=60)
                await asyncio.sleep(max(0.0, sent + 1.0 - time.monotonic()))
                victim = first.worker
                workers[victim].kill()

                async def ended(s: str) -> float:
                    await watches[s].wait("loop_end", f"t-{s}", timeout=60)
                    return time.monotonic() - sent

                ends = dict(zip(sessions, await asyncio.gather(*map(ended, sessions)), strict=True))
        recovered, through = [], []
        for s in sessions:
            stored = [e for e, _ in await stream_events(nc, "acme", s)]
            runs = [(e.worker, e.resumed) for e in stored if e.type == "loop_start"]
            assert [e.type for e in stored].count("loop_end") == 1, s
            if runs[0][0] == victim and len(runs) > 1:  # it ran when the kill came
                assert runs[-1][0] != victim and runs[-1][1], (s, runs)
                recovered.append(s)
            else:
                through.append(s)
        assert recovered, "no turn ran on the killed worker when it died"
        # What a turn took without the kill: the turns that ran through beside them.
        usual = max([usual, *(ends[s] for s in through)])
        late = {s: round(ends[s] - usual, 2) for s in recovered}
        assert max(late.values()) <= RECOVERY_S, f"seconds past a turn's time: {late}"
    finally:
        for proc in reversed(procs):
            await proc.close()
        await nc.close()


async def test_a_worker_paused_past_its_lease_writes_nothing_for_the_turn_after(durable):
    """A loop worker with the default timers is stopped (SIGSTOP) mid-turn until
    another worker has taken the turn over and ended it. When the paused worker goes
    on, its lease renewal fails and it gives the turn up: the session's stream holds one
    ``loop_end``, the last event, and the paused worker stored nothing after it."""
    nc = await connect_fast(durable.url)
    procs: list[Proc] = []
    try:
        await provision_short(nc, lease_ttl_s=LEASE_TTL_S, replicas=durable.replicas)
        async with FakeLLM(default=REPLY) as llm:

            async def loop_worker(name: str) -> Proc:
                env = worker_env(
                    durable.url, llm.base_url, name=name, replicas=durable.replicas,
                    ack_wait_s=DEFAULTS.ack_wait_s, lease_ttl_s=DEFAULTS.lease_ttl_s,
                    rescan_s=DEFAULTS.rescan_s, fetch_timeout_s=DEFAULTS.fetch_timeout_s,
                )  # fmt: skip
                proc = Proc("-m", "loop_worker", env=env)
                procs.append(proc)
                return await proc.start("loop worker ready")

            paused = await loop_worker("w1")
            async with Watch(nc) as watch:
                await send_turn(nc, turn("s1"))
                await watch.wait("content_delta", "t-s1", count=5, timeout=60)
                assert paused.proc is not None
                paused.proc.send_signal(signal.SIGSTOP)
                try:
                    await loop_worker("w2")
                    await watch.wait("loop_end", "t-s1", timeout=60)
                finally:
                    paused.proc.send_signal(signal.SIGCONT)
                await paused.wait_line("another worker took over turn=t-s1", 30)
        stored = [e for e, _ in await stream_events(nc, "acme", "s1")]
        runs = [e.worker for e in stored if e.type == "loop_start"]
        assert runs[0] == "w1" and runs[-1] == "w2", runs
        assert [e.type for e in stored].count("loop_end") == 1
        assert stored[-1].type == "loop_end", [e.type for e in stored[-5:]]
    finally:
        for proc in reversed(procs):
            await proc.close()
        await nc.close()
