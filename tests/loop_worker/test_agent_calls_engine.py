"""An agent calls the agents its definition names as tools (``agents.<name>``, taking
``input``): the call runs a child turn, whose answer is the call's result. In one process
(``LocalAgentCalls``); the durable service's is tested on real workers in
``test_agent_calls.py``."""

from __future__ import annotations

import msgspec

from loop_worker.engine.agents import StaticAgents
from loop_worker.engine.inmemory import LocalAgentCalls
from schemas import AgentSpec, Parent
from schemas.events import LoopStart, ToolErrorEvent, ToolResultEvent
from tests.loop_worker.scripted import Rig, ScriptedLLM, call, done

BOSS = AgentSpec(name="boss", description="Delegates.", model="boss-model", agents=("calc",))
CALC = AgentSpec(name="calc", description="Does arithmetic.", model="calc-model")


def rig(llm: ScriptedLLM, *agents: AgentSpec, **settings) -> tuple[Rig, LocalAgentCalls]:
    r = Rig(llm, **settings)
    r.engine.agents = StaticAgents(agents)
    calls = LocalAgentCalls()
    calls.engine = r.engine
    r.engine.agent_calls = calls
    return r, calls


async def test_a_called_agent_runs_a_child_turn_whose_answer_is_the_result() -> None:
    llm = ScriptedLLM()
    llm.script(
        call(("agents__calc", {"input": "What is 17 * 23?"})),  # boss
        done("391"),  # calc, in its own turn
        done("calc says 391"),  # boss again
    )
    r, calls = rig(llm, BOSS, CALC)
    end = await r.run("ask calc", agent="boss")
    assert end.reason == "task_completion" and end.content == "calc says 391"
    offered = [t["function"]["name"] for t in llm.requests[0].tools]
    assert "agents__calc" in offered
    [tool] = [t for t in llm.requests[0].tools if t["function"]["name"] == "agents__calc"]
    assert tool["function"]["description"] == "Does arithmetic."
    # the child: its id and session the call's id, its parent the call, its chain boss
    [child] = calls.children
    [result] = [e for e in r.of(ToolResultEvent) if e.server == "agents"]
    assert (child.id, child.session, child.agent) == (result.call_id, result.call_id, "calc")
    assert child.parent == Parent(session="s1", turn="t1", call=result.call_id)
    assert child.chain == ("boss",) and child.input == "What is 17 * 23?"
    assert result.content == "391" and llm.requests[1].model == "calc-model"
    # the child's events name their parent
    starts = {e.turn_id: e for e in r.of(LoopStart)}
    assert starts[child.id].parent == child.parent and starts["t1"].parent is None


async def test_a_child_asked_again_answers_with_its_stored_end() -> None:
    """A caller that resumes after a crash asks for the same child: it does not run
    again."""
    llm = ScriptedLLM()
    llm.script(call(("agents__calc", {"input": "2+2"})), done("4"), done("four"))
    r, calls = rig(llm, BOSS, CALC)
    await r.run("ask calc", agent="boss")
    [child] = calls.children
    end = await calls.call(child, timeout_s=5, relay=_no_relay)
    assert end.content == "4" and len(calls.children) == 1 and len(llm.requests) == 3


async def test_a_cycle_and_a_chain_too_deep_are_refused_with_an_error_result() -> None:
    loop = msgspec.structs.replace(CALC, agents=("calc",))  # calls itself
    llm = ScriptedLLM()
    llm.script(call(("agents__calc", {"input": "again"})), done("stopped"))
    r, calls = rig(llm, loop)
    end = await r.run("loop", agent="calc")
    assert end.reason == "task_completion" and calls.children == []
    [error] = r.of(ToolErrorEvent)
    assert error.code == "cycle" and "calc → calc" in error.message

    chain = [AgentSpec(name=f"a{i}", agents=(f"a{i + 1}",) if i < 3 else ()) for i in range(4)]
    llm = ScriptedLLM()
    llm.script(
        call(("agents__a1", {"input": "go"})),  # a0
        call(("agents__a2", {"input": "go"})),  # a1
        call(("agents__a3", {"input": "go"})),  # a2: one call too deep at depth 2
        done("a2 stops"),
        done("a1 stops"),
        done("a0 stops"),
    )
    r, calls = rig(llm, *chain, agent_max_depth=2)
    end = await r.run("go", agent="a0")
    assert end.content == "a0 stops" and [c.agent for c in calls.children] == ["a1", "a2"]
    [error] = r.of(ToolErrorEvent)
    assert error.code == "too_deep" and "a0 → a1 → a2 → a3" in error.message


async def test_a_call_without_input_is_refused() -> None:
    llm = ScriptedLLM()
    llm.script(call(("agents__calc", {"question": "hm"})), done("ok"))
    r, calls = rig(llm, BOSS, CALC)
    await r.run("ask", agent="boss")
    [error] = r.of(ToolErrorEvent)
    assert calls.children == []
    assert error.code in ("invalid_arguments", "bad_arguments"), error


async def _no_relay(event: object) -> None:
    return None
