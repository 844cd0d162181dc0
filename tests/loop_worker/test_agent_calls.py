"""Agents that call agents, durably, on real loop-worker and tool-worker processes: a
parent agent calls a child agent as a tool; the child's turn goes through the turns
stream like any turn. kill -9 of the worker running the parent while it waits and of
the one running the child leaves one child turn, whose tool ran once, and the parent
ends with the child's answer; cancelling a parent cancels its child."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from loop_worker.controls import send_control
from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    drained,
    provision_short,
    stream_events,
    wait_for,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import Cancel
from schemas.events import LoopEnd, LoopStart, ToolCallEvent
from tests.loop_worker.durable import Watch, send_turn, turn

pytestmark = pytest.mark.slow

READY = "loop worker ready"
AGENTS = """
[[agents]]
name = "boss"
description = "Delegates counting to calc."
agents = ["calc"]

[[agents]]
name = "calc"
description = "Counts, with the count tool."
tools = ["local.count"]
"""


def ask_calc(ledger: Path, seconds: float) -> str:
    """The boss's input: the fake model (``auto``) calls calc, whose input makes it call
    the count tool (which appends to ``ledger``, then waits ``seconds``)."""
    count = json.dumps({"path": str(ledger), "label": "a", "seconds": seconds})
    return "call agents__calc " + json.dumps({"input": f"call local__count {count}"})


@pytest.fixture
async def mesh(nats_server, tmp_path):
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    config = tmp_path / "loopmesh.toml"
    config.write_text(AGENTS)
    procs: list[Proc] = []
    async with FakeLLM(default=auto()) as llm:

        async def loop_worker(name: str) -> Proc:
            env = worker_env(nats_server.url, llm.base_url, name=name)
            proc = Proc("-m", "loop_worker", env={**env, "LOOPMESH_CONFIG": str(config)})
            procs.append(proc)
            return await proc.start(READY)

        tools = Proc(
            "-m", "tool_worker", "--nats-url", nats_server.url, "--no-provision",
            "--module", "tests.loop_worker.tools",
            env={"LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2"},
        )  # fmt: skip
        procs.append(tools)
        await tools.start("serving pool=default")

        class M:
            pass

        m = M()
        m.nc, m.llm, m.loop_worker, m.procs = nc, llm, loop_worker, procs
        try:
            yield m
        finally:
            for proc in reversed(procs):
                await proc.close()
            await nc.close()


async def child_call(watch: Watch) -> ToolCallEvent:
    call = await watch.wait("tool_call", timeout=30)
    assert isinstance(call, ToolCallEvent) and call.server == "agents", call
    return call


@pytest.mark.serial
async def test_killing_the_parents_and_the_childs_workers_leaves_one_child_and_one_run(
    mesh, tmp_path
):
    workers = {name: await mesh.loop_worker(name) for name in ("w1", "w2", "w3")}
    ledger = tmp_path / "count"
    async with Watch(mesh.nc, "acme", "s1") as parent:
        await send_turn(mesh.nc, turn("t1", ask_calc(ledger, seconds=3), agent="boss"))
        call = await child_call(parent)
        child_session = call.call_id
        # from the child session's first event: a loaded machine may start it before
        async with Watch(mesh.nc, "acme", child_session, since=0) as child:
            start = await child.wait("loop_start", timeout=30)
            await wait_for(ledger.exists, timeout=30, what="the child's tool to run")
            [parent_start] = parent.of("loop_start", "t1")
            assert isinstance(start, LoopStart) and isinstance(parent_start, LoopStart)
            assert start.parent is not None and start.parent.call == call.call_id
            killed = {parent_start.worker, start.worker}  # while the parent waits
            for name in killed:
                workers[name].proc.send_signal(signal.SIGKILL)
            for name in killed:
                await workers[name].proc.wait()
                workers[name] = await mesh.loop_worker(name + "b")
            end = await parent.wait("loop_end", "t1", timeout=90)
            child_end = await child.wait("loop_end", timeout=30)
    assert isinstance(end, LoopEnd) and end.reason == "task_completion", end
    assert isinstance(child_end, LoopEnd) and child_end.reason == "task_completion"
    assert "counted a" in end.content  # the child's answer, through the parent
    assert ledger.read_text() == "a\n"  # the child's tool ran once
    stored = [e for e, _ in await stream_events(mesh.nc, "acme", child_session)]
    assert {e.turn_id for e in stored} == {child_session}  # one child turn
    assert [e.type for e in stored].count("loop_end") == 1
    assert [e.type for e in stored].count("turn_accepted") == 1
    await drained(mesh.nc, SUBJECTS.turns_stream)  # the turn was acked


async def test_cancelling_a_parent_cancels_its_child(mesh, tmp_path):
    await mesh.loop_worker("w1")
    ledger = tmp_path / "count"
    async with Watch(mesh.nc, "acme", "s1") as parent:
        await send_turn(mesh.nc, turn("t1", ask_calc(ledger, seconds=60), agent="boss"))
        call = await child_call(parent)
        async with Watch(mesh.nc, "acme", call.call_id) as child:
            await wait_for(ledger.exists, timeout=30, what="the child's tool to run")
            await send_control(
                mesh.nc, SUBJECTS, Cancel(tenant="acme", session="s1", reason="enough")
            )
            end = await parent.wait("loop_end", "t1", timeout=30)
            child_end = await child.wait("loop_end", timeout=30)
    assert isinstance(end, LoopEnd) and end.reason == "cancelled"
    assert isinstance(child_end, LoopEnd) and child_end.reason == "cancelled"
    assert "the calling turn t1 was cancelled: enough" in (child_end.error or "")
