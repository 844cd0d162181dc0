"""Named agents in the engine: a turn runs its agent's definition over ``[loop]``, with the
turn's own fields on top; a session keeps to one agent; unknown agents are refused."""

from __future__ import annotations

import asyncio

import msgspec

from loop_worker.engine.agents import StaticAgents, resolve
from loop_worker.engine.settings import LoopSettings
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import error, tool_calls
from schemas import AgentSpec, ApprovalDecision
from schemas.events import ApprovalRequired, Error, LoopEnd, LoopStart
from tests.loop_worker.scripted import CountingTools, Rig, ScriptedLLM, call, done

CALC = AgentSpec(
    name="calc",
    description="Does arithmetic.",
    instructions="You are a careful calculator.",
    model="calc-model",
    tools=("local.count",),
    max_iterations=4,
    revision=7,
)


def system(request) -> str:
    return request.messages[0].content


def offered(request) -> list[str]:
    return [t["function"]["name"] for t in request.tools]


def echo(text: str) -> str:
    """Echo the text back."""
    return text


def rig_with(llm, *agents: AgentSpec, allow: tuple[str, ...] | None = None, **settings) -> Rig:
    """A rig with the tools ``count`` and ``echo``, ``agents`` defined and ``[loop]
    tools`` = ``allow``."""
    tools = CountingTools()
    tools.add(echo)
    rig = Rig(llm, tools=tools, model="deployment-model", **settings)
    rig.engine.settings = msgspec.structs.replace(rig.engine.settings, tools=allow)
    rig.engine.agents = StaticAgents(agents)
    return rig


async def test_a_turn_runs_its_agents_instructions_model_tools_and_limits():
    llm = ScriptedLLM(steps=[done("4")])
    rig = rig_with(llm, CALC, instructions="You are the deployment's generalist.")
    end = await rig.run("2+2?", agent="calc", instructions="Answer in digits.")
    assert end.reason == "task_completion"
    [request] = llm.requests
    assert "You are a careful calculator." in system(request)
    assert "Answer in digits." in system(request)  # the turn's own follow
    assert "generalist" not in system(request)  # the agent's replace [loop]'s
    assert request.model == "calc-model"
    assert "local__count" in offered(request) and "local__echo" not in offered(request)
    start = rig.one(LoopStart)
    assert (start.agent, start.agent_revision) == ("calc", 7)
    assert (start.model, start.max_iterations) == ("calc-model", 4)
    assert (await rig.store.load("acme", "s1")).agent == "calc"


async def test_the_turns_own_model_and_limits_win_over_the_agents():
    llm = ScriptedLLM(steps=[done()])
    rig = rig_with(llm, CALC)
    await rig.run(agent="calc", model="turn-model", max_iterations=9)
    assert llm.requests[0].model == "turn-model"
    assert rig.one(LoopStart).max_iterations == 9


async def test_without_an_agent_a_turn_runs_the_default_agent_which_is_loop():
    llm = ScriptedLLM(steps=[done()])
    rig = rig_with(llm, CALC, instructions="You are the deployment's generalist.")
    await rig.run()
    assert "generalist" in system(llm.requests[0])
    assert llm.requests[0].model == "deployment-model"
    assert {"local__count", "local__echo"} <= set(offered(llm.requests[0]))
    start = rig.one(LoopStart)
    assert (start.agent, start.agent_revision) == ("default", 0)


async def test_every_allowlist_that_is_set_applies_the_most_restrictive_wins():
    llm = ScriptedLLM(steps=[call(("local__count", {"name": "x"})), done()])
    wide = AgentSpec(name="wide", tools=("local.count", "echo"))
    rig = rig_with(llm, wide, allow=("local.count",))
    await rig.run(agent="wide", tools=("echo", "count"))
    # the turn allows echo and count, the agent both, [loop] only count: count it is
    assert [n for n in offered(llm.requests[0]) if n.startswith("local__")] == ["local__count"]
    assert rig.tools.counted["x"] == 1

    narrow = AgentSpec(name="narrow", tools=("echo",))
    llm2 = ScriptedLLM(steps=[call(("local__count", {"name": "y"})), done()])
    rig2 = rig_with(llm2, narrow)
    await rig2.run(agent="narrow", tools=("count",))  # the turn cannot widen the agent's
    assert not any(n.startswith("local__") for n in offered(llm2.requests[0]))
    [refused] = [e for e in rig2.events.events if e.type == "tool_error"]
    assert refused.code == "not_allowed" and rig2.tools.counted["y"] == 0


async def test_an_agents_approval_tools_add_to_the_deployments(fake_llm: FakeLLM):
    guarded = AgentSpec(name="guarded", approval_tools=("local.echo",))
    rig = Rig.openai(fake_llm)
    rig.engine.agents = StaticAgents([guarded])
    fake_llm.script(
        tool_calls(("local__echo", {"text": "hi"})),
        tool_calls(("task_completion", {"result": "done"})),
    )
    async with rig:
        task = asyncio.create_task(rig.run(agent="guarded"))
        asked = await rig.events.wait_for("approval_required")
        assert isinstance(asked, ApprovalRequired) and asked.tool == "echo"
        await rig.control.decide(
            ApprovalDecision(tenant="acme", session="s1", call_id=asked.call_id, approved=True)
        )
        assert (await asyncio.wait_for(task, 5)).reason == "task_completion"


async def test_an_agents_fallback_models_replace_the_deployments(fake_llm: FakeLLM):
    agent = AgentSpec(name="sturdy", model="first", fallback_models=("second",))
    fake_llm.script_for("first", error(400, "no such model"))
    fake_llm.script_for("second", tool_calls(("task_completion", {"result": "ok"})))
    rig = Rig.openai(fake_llm, llm={"fallback_models": ("deployment-fallback",)})
    rig.engine.agents = StaticAgents([agent])
    async with rig:
        end = await rig.run(agent="sturdy")
    assert end.reason == "task_completion"
    assert [r["model"] for r in fake_llm.requests] == ["first", "second"]


async def test_a_turn_naming_another_agent_in_the_session_is_refused_and_nothing_is_lost():
    llm = ScriptedLLM(steps=[done("first"), done("third")])
    rig = rig_with(llm, CALC)
    await rig.run("one", id="t1", agent="calc")
    before = await rig.store.load("acme", "s1")

    end = await rig.run("two", id="t2", agent="default")
    assert (end.reason, end.turn_id) == ("error", "t2")
    [refusal] = [e for e in rig.of(Error) if e.turn_id == "t2"]
    assert refusal.code == "agent_mismatch" and refusal.fatal
    assert "belongs to agent 'calc'" in refusal.message
    assert [e.type for e in rig.events.events if e.turn_id == "t2"] == ["error", "loop_end"]
    assert await rig.store.load("acme", "s1") == before  # nothing checkpointed

    # a turn that names no agent runs the session's
    end = await rig.run("three", id="t3")
    assert end.reason == "task_completion" and end.content == "third"
    after = await rig.store.load("acme", "s1")
    assert after.agent == "calc" and after.turns == 2
    assert [m.content for m in after.messages if m.role == "user"] == ["one", "three"]


async def test_a_turn_naming_an_agent_nobody_defined_is_refused_with_a_clear_message():
    llm = ScriptedLLM(steps=[])
    rig = rig_with(llm, CALC)
    end = await rig.run(agent="calculator")
    assert end.reason == "error" and "unknown_agent" in (end.error or "")
    error_event = rig.one(Error)
    assert error_event.code == "unknown_agent"
    assert "no agent 'calculator' is defined" in error_event.message
    assert llm.requests == [] and await rig.store.load("acme", "s1") is None
    assert rig.types == ["error", "loop_end"] and isinstance(rig.events.events[-1], LoopEnd)


async def test_a_changed_definition_runs_from_the_next_turn():
    llm = ScriptedLLM(steps=[done(), done()])
    rig = rig_with(llm, CALC)
    await rig.run(id="t1", agent="calc")
    book = rig.engine.agents
    assert isinstance(book, StaticAgents)
    book.put(AgentSpec(name="calc", instructions="You are terse.", model="m2", revision=8))
    await rig.run(id="t2", agent="calc")
    assert "You are terse." in system(llm.requests[1]) and llm.requests[1].model == "m2"
    assert [e.agent_revision for e in rig.of(LoopStart)] == [7, 8]


def test_resolving_the_default_agent_keeps_the_settings_themselves():
    settings = LoopSettings(instructions="x", approval_tools=("a.b",))
    agent = resolve(AgentSpec(name="default"), settings, "m")
    assert agent.settings is settings and agent.model == "m" and agent.fallbacks is None
    guarded = resolve(AgentSpec(name="g", approval_tools=("c.d", "a.b")), settings, "m")
    assert guarded.settings.approval_tools == ("a.b", "c.d")
