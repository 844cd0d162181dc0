"""Named agents on a real mesh: definitions provisioned to the agents bucket, watched by
the loop worker, each turn run by its agent's definition as the fake LLM server sees it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from loopmesh.agents import apply_agents, read_agents
from loopmesh.testing.durable import SUBJECTS, kv_read, wait_for
from schemas import AgentSpec, SessionSnapshot, decode, encode
from schemas.events import Error, LoopEnd, LoopStart
from tests.loop_worker.durable import Mesh, Watch, count_task, mesh_on, send_turn, turn

CALC = AgentSpec(
    name="calc",
    description="Counts things with the count tool.",
    instructions="You are a careful counter. Use the count tool for every count.",
    model="calc-model",
    tools=("local.count",),
)
WRITER = AgentSpec(
    name="writer",
    description="Echoes text.",
    instructions="You are a writer. Echo what you are given.",
    model="writer-model",
    tools=("local.echo",),
    agents=("calc",),
)


@pytest.fixture
async def mesh(nats_server: Any) -> Any:
    async with mesh_on(nats_server.url) as mesh:
        await apply_agents(mesh.nc.jetstream(), SUBJECTS, [CALC, WRITER])
        await mesh.tool_worker()
        await mesh.loop_worker()
        yield mesh


def system(request: dict[str, Any]) -> str:
    return str(request["messages"][0]["content"])


def offered(request: dict[str, Any]) -> set[str]:
    return {t["function"]["name"] for t in request.get("tools") or []}


async def test_two_agents_run_side_by_side_each_turn_with_its_own_definition(
    mesh: Mesh, tmp_path: Path
):
    assert mesh.fake is not None
    async with Watch(mesh.nc, "acme", "sc") as calc, Watch(mesh.nc, "acme", "sw") as writer:
        await asyncio.gather(
            send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n"), session="sc", agent="calc")),
            send_turn(
                mesh.nc,
                turn("t2", 'call local__echo {"text": "hi"}', session="sw", agent="writer"),
            ),
        )
        ends = [await calc.wait("loop_end", "t1"), await writer.wait("loop_end", "t2")]
    assert [e.reason for e in ends] == ["task_completion", "task_completion"]
    assert (tmp_path / "n").read_text() == "a\n"

    counted, written = mesh.fake.requests_for("calc-model"), mesh.fake.requests_for("writer-model")
    assert counted and written and len(counted) + len(written) == len(mesh.fake.requests)
    for request in counted:
        assert "You are a careful counter." in system(request)
        assert "local__count" in offered(request) and "local__echo" not in offered(request)
    for request in written:
        assert "You are a writer." in system(request)
        assert "local__echo" in offered(request) and "local__count" not in offered(request)

    stored = await read_agents(mesh.nc.jetstream(), SUBJECTS)
    starts = [calc.of("loop_start")[0], writer.of("loop_start")[0]]
    assert all(isinstance(s, LoopStart) for s in starts)
    assert [(s.agent, s.agent_revision) for s in starts] == [  # type: ignore[attr-defined]
        ("calc", stored["calc"].revision),
        ("writer", stored["writer"].revision),
    ]
    snapshot = decode(await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.sc"), SessionSnapshot)
    assert snapshot.agent == "calc"


async def test_a_definition_changed_in_kv_takes_effect_on_the_next_turn(mesh: Mesh):
    assert mesh.fake is not None
    book = mesh.running[-1].service.agents
    async with Watch(mesh.nc, "acme", "s1") as watch:
        await send_turn(mesh.nc, turn("t1", "count nothing", agent="calc"))
        await watch.wait("loop_end", "t1")

        kv = await mesh.nc.jetstream().key_value(SUBJECTS.agents_bucket)
        changed = AgentSpec(
            name="calc", instructions="You are terse now.", model="terse-model", tools=()
        )
        revision = await kv.put("calc", encode(changed))
        # the worker's watch has it (the put is live at once; the test waits for the watch)
        assert await book.wait_for(lambda b: b.get("calc").revision == revision, 10)

        await send_turn(mesh.nc, turn("t2", "count nothing again"))  # the session's agent
        await watch.wait("loop_end", "t2")
    [request, *_] = mesh.fake.requests_for("terse-model")
    assert "You are terse now." in system(request)
    assert not any(n.startswith("local__") for n in offered(request))  # allows no tool now
    start = watch.of("loop_start", "t2")[0]
    assert (start.agent, start.agent_revision) == ("calc", revision)  # type: ignore[attr-defined]


async def test_a_turn_for_another_agent_in_a_session_is_refused_with_an_error_event(mesh: Mesh):
    async with Watch(mesh.nc, "acme", "s1") as watch:
        await send_turn(mesh.nc, turn("t1", "count nothing", agent="calc"))
        await watch.wait("loop_end", "t1")

        async def stored() -> bool:  # the end's checkpoint may follow its loop_end
            value = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")
            return value is not None and decode(value, SessionSnapshot).status == "idle"

        await wait_for(stored, timeout=10, what="t1's last checkpoint")
        before = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")

        await send_turn(mesh.nc, turn("t2", "write something", agent="writer"))
        end = await watch.wait("loop_end", "t2")
        after_refusal = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")

        await send_turn(mesh.nc, turn("t4", "count once more", agent="calc"))
        last = await watch.wait("loop_end", "t4")
    assert isinstance(end, LoopEnd) and end.reason == "error"
    [error] = watch.of("error", "t2")
    assert isinstance(error, Error) and error.code == "agent_mismatch" and error.fatal
    assert "belongs to agent 'calc'" in error.message
    assert [e.type for e in watch.events if e.turn_id == "t2"] == ["error", "loop_end"]
    assert after_refusal == before  # nothing accepted was lost, nothing was added
    assert isinstance(last, LoopEnd) and last.reason == "task_completion"
    snapshot = decode(await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1"), SessionSnapshot)
    assert snapshot.turns == 2 and snapshot.agent == "calc"


async def test_a_tool_name_an_agent_allows_that_matches_no_tool_is_reported(
    nats_server: Any, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="loopmesh.loop_worker.agents")
    typo = AgentSpec(name="typo", tools=("local.cuont",), approval_tools=("local.ecko",))
    async with mesh_on(nats_server.url) as mesh:
        await apply_agents(mesh.nc.jetstream(), SUBJECTS, [typo])
        await mesh.tool_worker()
        await mesh.loop_worker()
        worker = mesh.running[-1].service
        # whichever of the two loads last reports, before its waiters resume (the tool
        # worker's specs were in the catalog before the loop worker started)
        await worker.agents.loaded()
        await worker.tools.catalog.loaded()
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "typo.tools[0]" in m and "'local.cuont'" in m and "local.count" in m for m in messages
    )
    assert any("typo.approval_tools[0]" in m and "needs a person's approval" in m for m in messages)


async def test_a_turn_for_an_agent_nobody_defined_is_refused_with_a_clear_message(mesh: Mesh):
    async with Watch(mesh.nc, "acme", "s2") as watch:
        await send_turn(mesh.nc, turn("t1", "hello", session="s2", agent="calculator"))
        end = await watch.wait("loop_end", "t1")
    assert isinstance(end, LoopEnd) and end.reason == "error"
    [error] = watch.of("error", "t1")
    assert isinstance(error, Error) and error.code == "unknown_agent"
    assert "no agent 'calculator' is defined" in error.message
    assert await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s2") is None
