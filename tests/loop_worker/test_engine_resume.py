"""Resuming a turn whose worker died while its tool calls ran.

The model's reply is checkpointed before its calls run; the next worker re-issues
exactly those calls (same call ids: finished ones return their recorded result) and
does not ask the model again for that iteration.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import SessionSnapshot, call_id
from schemas.events import LoopStart, Message, ToolCallEvent, ToolErrorEvent, ToolResultEvent
from tests.loop_worker.scripted import CountingTools, Rig, ScriptedLLM, call, done, say


def cid(turn: str, iteration: int, index: int) -> str:
    """The call id the engine gives a call of acme/s1's turn ``turn``."""
    return call_id("acme", "s1", turn, iteration, index)


async def crash_while_waiting(rig: Rig, tools: CountingTools) -> SessionSnapshot:
    """Run a turn until the ``wait`` tool blocks, then cut the run task as a dying
    worker would (no loop_end, no final checkpoint); return the stored snapshot."""
    task = asyncio.create_task(rig.run())
    await asyncio.wait_for(tools.waiting.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    tools.waiting.clear()
    tools.release.set()
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.status == "running"
    assert "loop_end" not in rig.types
    return snapshot


async def test_a_worker_dying_mid_tool_call_is_resumed_without_asking_the_model_again() -> None:
    tools = CountingTools()
    first_llm = ScriptedLLM([call(("local__count", {"name": "a"}), ("local__wait", {}))])
    async with Rig(first_llm, tools=tools) as rig:
        stored = await crash_while_waiting(rig, tools)
        assert stored.iteration == 0
        assert [c.id for c in stored.pending] == [cid("t1", 1, 0), cid("t1", 1, 1)]
        assert [m.role for m in stored.messages] == ["user", "assistant"]

        # a model asked again for iteration 1 would answer differently
        second_llm = ScriptedLLM([call(("local__count", {"name": "b"})), done("all counted")])
        second = rig.fork(second_llm)
        end = await second.run()

    assert second.one(LoopStart).resumed is True
    resumed = ["loop_start", "tool_call", "tool_call", "tool_result", "tool_result"]
    assert second.types[:5] == resumed  # no loop_iteration / llm_request before the calls
    assert [e.call_id for e in second.of(ToolCallEvent)][:2] == [cid("t1", 1, 0), cid("t1", 1, 1)]
    assert [e.iteration for e in second.of(ToolCallEvent)][:2] == [1, 1]
    results = {e.call_id: e.content for e in second.of(ToolResultEvent)}
    assert (results[cid("t1", 1, 0)], results[cid("t1", 1, 1)]) == ("counted a", "released")

    assert len(first_llm.requests) == 1
    assert len(second_llm.requests) == 2  # iterations 2 and 3: iteration 1 was not asked
    sent = second_llm.requests[0].messages
    assert [c.id for c in sent[-3].tool_calls] == [cid("t1", 1, 0), cid("t1", 1, 1)]
    assert [(m.tool_call_id, m.content) for m in sent[-2:]] == [
        (cid("t1", 1, 0), "counted a"),
        (cid("t1", 1, 1), "released"),
    ]

    assert tools.counted == Counter({"a": 1, "b": 1})
    ran = Counter(r.call_id for r in tools.runs)
    assert ran == Counter(
        {cid("t1", 1, 0): 1, cid("t1", 1, 1): 2, cid("t1", 2, 0): 1}
    )  # wait was cut, then re-run
    assert (end.reason, end.content, end.iterations) == ("task_completion", "all counted", 3)
    assert rig.types.count("loop_end") + second.types.count("loop_end") == 1
    snapshot = second.store.get("acme", "s1")
    assert snapshot is not None and (snapshot.status, snapshot.pending) == ("idle", ())


async def test_a_pending_task_completion_ends_the_resumed_turn_without_a_new_llm_request() -> None:
    tools = CountingTools()
    reply = call(("local__wait", {}), ("task_completion", {"result": "finished"}))
    first_llm = ScriptedLLM([reply])
    async with Rig(first_llm, tools=tools) as rig:
        await crash_while_waiting(rig, tools)
        second_llm = ScriptedLLM()  # any request fails the turn
        second = rig.fork(second_llm)
        end = await second.run()

    assert (end.reason, end.content, end.iterations) == ("task_completion", "finished", 1)
    assert second_llm.requests == []
    assert second.one(Message).content == "finished"
    assert "message" not in rig.types  # the first worker died before delivering it
    snapshot = second.store.get("acme", "s1")
    assert snapshot is not None
    assert [m.role for m in snapshot.messages] == ["user", "assistant", "tool", "tool"]
    assert (snapshot.status, snapshot.pending) == ("idle", ())


async def test_a_call_refused_before_the_crash_is_refused_again_not_run() -> None:
    tools = CountingTools()
    first_llm = ScriptedLLM([call(("local__count", '{"name": '), ("local__wait", {}))])
    async with Rig(first_llm, tools=tools) as rig:
        stored = await crash_while_waiting(rig, tools)
        # the history shows "{}" for the unreadable arguments; the pending call keeps why
        assert stored.messages[-1].tool_calls[0].arguments == "{}"
        assert stored.pending[0].error is not None
        second = rig.fork(ScriptedLLM([done()]))
        end = await second.run()
    assert end.reason == "task_completion"
    assert tools.counted == Counter()
    assert second.one(ToolErrorEvent).code == "invalid_arguments"


async def test_a_text_format_turn_resumes_its_pending_tool_blocks() -> None:
    tools = CountingTools()
    block = '<tool>{"server_name": "local", "tool_name": "wait", "arguments": {}}</tool>'
    finish = (
        '<tool>{"server_name": "loop", "tool_name": "task_completion", '
        '"arguments": {"result": "ok"}}</tool>'
    )
    async with Rig(ScriptedLLM([say(f"Waiting. {block}")]), tools=tools, tool_format="text") as rig:
        await crash_while_waiting(rig, tools)
        second_llm = ScriptedLLM([say(finish)])
        second = rig.fork(second_llm)
        end = await second.run()
    assert (end.reason, end.iterations) == ("task_completion", 2)
    assert len(second_llm.requests) == 1
    result = second_llm.requests[0].messages[-1]
    assert result.name == "loopmesh" and 'tool_name="wait" status="ok">\nreleased' in result.content


async def test_a_resumed_turn_over_the_openai_client_sends_one_request_per_iteration(
    fake_llm: FakeLLM,
) -> None:
    tools = CountingTools()
    fake_llm.script(
        tool_calls(("local__count", {"name": "a"}), ("local__wait", {})),
        tool_calls(("task_completion", {"result": "ok"})),
        tool_calls(("converse", {"message": "asked twice"})),  # what a second ask would get
    )
    async with Rig.openai(fake_llm, tools=tools) as rig:
        await crash_while_waiting(rig, tools)
        assert len(fake_llm.requests) == 1
        second = rig.fork()
        end = await second.run()
    assert (end.reason, end.iterations) == ("task_completion", 2)
    assert len(fake_llm.requests) == 2
    sent = fake_llm.requests[1]["messages"]
    assert sent[-2:] == [
        {"role": "tool", "content": "counted a", "tool_call_id": cid("t1", 1, 0)},
        {"role": "tool", "content": "released", "tool_call_id": cid("t1", 1, 1)},
    ]
    assert tools.counted == Counter({"a": 1})
    assert rig.types.count("loop_end") + second.types.count("loop_end") == 1


async def test_a_new_turn_answers_the_calls_a_dead_turn_left_without_results() -> None:
    tools = CountingTools()
    async with Rig(ScriptedLLM([call(("local__wait", {}))]), tools=tools) as rig:
        await crash_while_waiting(rig, tools)
        llm = ScriptedLLM([done()])
        second = rig.fork(llm)
        end = await second.run("something else", id="t2")
    assert end.reason == "task_completion"
    assert [r.call_id for r in tools.runs] == [
        cid("t1", 1, 0)
    ]  # the dead turn's call is not re-run
    sent = llm.requests[0].messages
    assert [m.role for m in sent] == ["system", "user", "assistant", "tool", "user"]
    assert sent[3].tool_call_id == cid("t1", 1, 0) and sent[3].content.startswith(
        "Error (interrupted)"
    )
