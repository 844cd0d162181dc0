"""kill -9 of a real loop-worker process in the middle of an orchestrated turn: loop
workers and a tool worker as ``python -m`` processes on one real nats-server, the fake
OpenAI-compatible server (a planner and an executor model) in the test."""

import json
import time

import pytest

from loopmesh.testing.durable import Proc, connect_fast, provision_short, stream_events, worker_env
from loopmesh.testing.fake_llm import FakeLLM, text, tool_calls
from schemas import Turn
from tests.loop_worker.durable import Watch, send_turn

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ORCHESTRATOR = {
    "LOOPMESH_LOOP__MODE": "orchestrator",
    "LOOPMESH_LOOP__PLANNER_MODEL": "planner",
    "LOOPMESH_LOOP__EXECUTOR_MODEL": "executor",
    # the plan, two executor calls for each of three steps, the synthesis: 8 LLM calls
    "LOOPMESH_LOOP__MAX_ITERATIONS": "12",
}


def count(path: str, label: str, seconds: float = 0.0) -> tuple[str, dict[str, object]]:
    return ("local__count", {"path": path, "label": label, "seconds": seconds})


async def test_kill_9_mid_step_resumes_at_that_step_and_runs_each_tool_once(nats_server, tmp_path):
    counter = tmp_path / "count"
    path = str(counter)
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    started: list[Proc] = []

    async def start(*args: str, ready: str, **env: str) -> Proc:
        proc = Proc(*args, env=env)
        started.append(proc)
        return await proc.start(ready)

    steps = {"steps": [{"id": s, "description": f"count {s}"} for s in ("one", "two", "three")]}
    try:
        async with FakeLLM() as llm:
            llm.script_for("planner", text(json.dumps(steps)), text("Counted one, two and three."))
            llm.script_for(
                "executor",
                tool_calls(count(path, "1")),
                text("one is counted"),
                tool_calls(count(path, "2", seconds=5.0)),  # the worker dies while this runs
                text("two is counted"),
                tool_calls(count(path, "3")),
                text("three is counted"),
            )

            async def loop_worker(name: str) -> Proc:
                env = {**worker_env(nats_server.url, llm.base_url, name=name), **ORCHESTRATOR}
                return await start("-m", "loop_worker", ready="loop worker ready", **env)

            await start(
                "-m", "tool_worker", "--nats-url", nats_server.url, "--no-provision",
                "--module", "tests.loop_worker.tools", ready="serving pool=default",
                LOOPMESH_TOOL_WORKER__ACK_WAIT_S="2",
            )  # fmt: skip
            first = await loop_worker("w1")
            async with Watch(nc) as watch:
                turn = Turn(
                    id="t1", tenant="acme", session="s1", input="count to three",
                    created_at=time.time(),
                )  # fmt: skip
                await send_turn(nc, turn)
                step_two = await watch.wait("tool_call", "t1", count=2, timeout=30)
                first.kill()  # kill -9 while step two's slow tool runs
                await loop_worker("w2")
                end = await watch.wait("loop_end", "t1", timeout=60)
            stored = [e for e, _ in await stream_events(nc, "acme", "s1")]
    finally:
        for proc in reversed(started):
            await proc.close()
        await nc.close()

    assert (end.reason, end.content) == ("task_completion", "Counted one, two and three.")
    assert counter.read_text() == "1\n2\n3\n"  # each tool ran once
    starts = [(e.resumed, e.worker) for e in stored if e.type == "loop_start"]
    assert starts == [(False, "w1"), (True, "w2")]
    # the resumed turn goes on at step two, from its pending call (whose replayed
    # tool_call event the stream deduplicates), then asks the executor for its result
    resumed_at = next(i for i, e in enumerate(stored) if e.type == "loop_start" and e.resumed)
    assert stored[resumed_at].iteration == step_two.iteration - 1
    asked = next(e for e in stored[resumed_at:] if e.type == "llm_request")
    assert (asked.iteration, asked.model) == (step_two.iteration + 1, "executor")
    results = [e.call_id for e in stored if e.type == "tool_result"]
    assert len(results) == len(set(results)) == 3 and step_two.call_id in results
    # neither model was asked again for what it had already answered
    assert len(llm.requests_for("planner")) == 2
    assert len(llm.requests_for("executor")) == 6
    plan = [e for e in stored if e.type == "plan_update"][-1].plan
    assert [(s.id, s.status, s.result) for s in plan] == [
        ("one", "done", "one is counted"),
        ("two", "done", "two is counted"),
        ("three", "done", "three is counted"),
    ]
    assert [e.type for e in stored].count("loop_end") == 1
