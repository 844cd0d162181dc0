"""Crashes with real processes: loop workers and a tool worker as ``python -m``
processes on one real nats-server, and again on a 3-node cluster with R3 streams and
buckets; the fake OpenAI-compatible server in the test."""

import asyncio
import json
import time

import pytest

from loop_worker.controls import send_control
from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    provision_short,
    stream_events,
    wait_for,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import ApprovalDecision, Turn
from tests.conftest import BOTH
from tests.loop_worker.durable import Watch, send_turn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.parametrize("durable", BOTH, indirect=True),
]

READY = "loop worker ready"


@pytest.fixture
async def procs(durable):
    nc = await connect_fast(durable.url)
    await provision_short(nc, replicas=durable.replicas)
    started: list[Proc] = []
    async with FakeLLM(default=auto()) as llm:

        async def start(*args: str, ready: str, **env) -> Proc:
            proc = Proc(*args, env=env)
            started.append(proc)
            return await proc.start(ready)

        async def loop_worker(name: str, **service) -> Proc:
            env = worker_env(
                durable.url, llm.base_url, name=name, replicas=durable.replicas, **service
            )
            return await start("-m", "loop_worker", ready=READY, **env)

        async def tool_worker(**env: str) -> Proc:
            return await start(
                "-m", "tool_worker", "--nats-url", durable.url, "--no-provision",
                "--module", "tests.loop_worker.tools", ready="serving pool=default",
                LOOPMESH_TOOL_WORKER__ACK_WAIT_S="2", **env,
            )  # fmt: skip

        class P:
            pass

        p = P()
        p.nc, p.llm, p.loop_worker, p.tool_worker = nc, llm, loop_worker, tool_worker
        try:
            yield p
        finally:
            for proc in reversed(started):
                await proc.close()
            await nc.close()


def turn(turn_id: str, task: str) -> Turn:
    return Turn(id=turn_id, tenant="acme", session="s1", input=task, created_at=time.time())


def call(tool: str, **args) -> str:
    return f"call local__{tool} {json.dumps(args)}"


async def test_kill_9_mid_turn_resumes_on_another_worker_with_the_side_effect_once(procs, tmp_path):
    counter = tmp_path / "count"
    await procs.tool_worker()
    first = await procs.loop_worker("w1")
    async with Watch(procs.nc) as watch:
        await send_turn(procs.nc, turn("t1", call("count", path=str(counter), seconds=2.0)))
        await watch.wait("tool_call", "t1")
        first.kill()  # kill -9 while the slow tool runs
        await procs.loop_worker("w2")
        end = await watch.wait("loop_end", "t1", timeout=20)
    assert end.reason == "task_completion"
    assert counter.read_text() == "\n"  # the tool ran once
    stored = [e for e, _ in await stream_events(procs.nc, "acme", "s1")]
    types = [e.type for e in stored]
    assert types.count("loop_end") == 1 and types[-1] == "loop_end"
    starts = [(e.resumed, e.worker) for e in stored if e.type == "loop_start"]
    # w1 started it, w2 resumed it (again, if a stall of a loaded machine cost w2 its
    # 2 s lease: a takeover, which must still run the tool once and end the turn once).
    # On a loaded cluster w1 may die before its first checkpoint is stored: then w2
    # starts the turn afresh, and its loop_start is w1's, stored once by its msg id
    assert starts[0] == (False, "w1") and set(starts[1:]) <= {(True, "w2")}, starts
    # nothing missing: each iteration's request, response, call and result are there
    for k in (1, 2):
        of_k = [e.type for e in stored if e.iteration == k]
        for needed in ("loop_iteration", "llm_request", "llm_response", "tool_call", "tool_result"):
            assert needed in of_k, (k, needed, of_k)
    assert types.count("tool_result") == 2


async def test_an_approval_sent_while_the_worker_restarts_is_applied(procs, tmp_path):
    written = tmp_path / "written"
    await procs.tool_worker()
    first = await procs.loop_worker("w1")
    async with Watch(procs.nc) as watch:
        await send_turn(procs.nc, turn("t1", call("guarded", path=str(written))))
        asked = await watch.wait("approval_required", "t1")
        first.kill()
        decision = ApprovalDecision(
            tenant="acme", session="s1", call_id=asked.call_id, approved=True, reason="ok"
        )
        await send_control(procs.nc, SUBJECTS, decision)
        await procs.loop_worker("w2")
        end = await watch.wait("loop_end", "t1", timeout=20)
    assert end.reason == "task_completion"
    assert written.read_text() == "\n"
    decided = watch.of("approval_decision", "t1")
    assert decided and decided[0].approved


async def test_sigterm_lets_the_running_turn_finish_and_exits_cleanly(procs, tmp_path):
    await procs.tool_worker()
    worker = await procs.loop_worker("w1", drain_timeout_s=10)
    async with Watch(procs.nc) as watch:
        await send_turn(procs.nc, turn("t1", call("count", path=str(tmp_path / "n"), seconds=1)))
        await watch.wait("tool_call", "t1")
        code = await worker.terminate()
        end = await watch.wait("loop_end", "t1")
    assert code == 0
    assert end.reason == "task_completion"


async def test_sigterm_to_both_workers_mid_call_hands_the_turn_over_and_runs_the_tool_once(
    procs, tmp_path
):
    """SIGTERM lands on the loop worker and the tool worker while a tool runs. The tool
    worker finishes the call within its drain deadline and records it; the loop worker,
    whose deadline is shorter than the call, hands the turn back; both take no new work
    once stopping and exit 0. The turn then ends on another loop worker, which reads the
    recorded result instead of running the tool again."""
    counter = tmp_path / "count"
    tools = await procs.tool_worker(LOOPMESH_TOOL_WORKER__DRAIN_TIMEOUT_S="30")
    # Its turn must not come back to it while it runs: with the fixture's 2 s ack wait a
    # busy machine can delay the keepalive past it, and JetStream redelivers the turn to
    # this same worker (then holding two). The handover below is SIGTERM's, not a timeout.
    first = await procs.loop_worker("w1", drain_timeout_s=0.2, ack_wait_s=10, lease_ttl_s=10)
    async with Watch(procs.nc) as watch, Watch(procs.nc, session="s2") as watch2:
        await send_turn(procs.nc, turn("t1", call("count", path=str(counter), seconds=2.0)))
        await watch.wait("tool_call", "t1")
        await wait_for(counter.exists, timeout=30, what="the tool running")
        codes = asyncio.gather(tools.terminate(timeout=60), first.terminate(timeout=60))
        await first.wait_line("finishing 1 in-flight turns")  # its puller has stopped
        await tools.wait_line("finishing 1 in-flight calls")
        # Work that arrives now waits for the next workers.
        later = Turn(id="t2", tenant="acme", session="s2", input="hello", created_at=time.time())
        await send_turn(procs.nc, later)
        assert await codes == [0, 0]
        assert counter.read_text() == "\n"  # the call finished during the drain
        await procs.tool_worker()
        await procs.loop_worker("w2")
        end = await watch.wait("loop_end", "t1", timeout=30)
        other = await watch2.wait("loop_end", "t2", timeout=30)
    assert end.reason == "task_completion" and other.reason == "task_completion"
    assert counter.read_text() == "\n"  # the tool ran once
    stored = [e for e, _ in await stream_events(procs.nc, "acme", "s1")]
    starts = [(e.resumed, e.worker) for e in stored if e.type == "loop_start"]
    assert starts == [(False, "w1"), (True, "w2")]
    assert [e.type for e in stored].count("loop_end") == 1
    assert [e.worker for e in watch2.of("loop_start", "t2")] == ["w2"]
    assert any("handed_back': 1" in line for line in first.lines), first.output()
