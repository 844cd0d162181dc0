"""Per-turn limits and policy: the tool allowlist, the deadline, the tool-call cap, the
parallel calls of an iteration and the tool-failure mode, from the turn and from
``[loop]``; each hit ends the turn (or the call) with its own reason or error event."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from loop_worker.engine.inmemory import LocalTools
from loop_worker.engine.settings import LoopSettings
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas.events import ContextBudget, Error, LoopEnd, ToolErrorEvent, ToolResultEvent
from tests.loop_worker.scripted import HANG, Rig, ScriptedLLM, call, done


def catalog() -> LocalTools:
    tools = LocalTools()

    @tools.tool()
    def echo(text: str) -> str:
        return text

    @tools.tool()
    def shout(text: str) -> str:
        return text.upper()

    @tools.tool(server="files")
    def read(path: str) -> str:
        return f"contents of {path}"

    return tools


def offered(llm: ScriptedLLM, index: int = 0) -> list[str]:
    return sorted(t["function"]["name"] for t in llm.requests[index].tools)


def fatal(rig: Rig, code: str) -> Error:
    errors = [e for e in rig.of(Error) if e.code == code]
    assert len(errors) == 1, rig.types
    assert errors[0].fatal
    return errors[0]


# -- the allowlist ------------------------------------------------------------------


async def test_tools_outside_the_turns_allowlist_are_not_offered_and_a_call_is_refused() -> None:
    llm = ScriptedLLM()
    llm.script(call(("local__shout", {"text": "hi"}), ("local__echo", {"text": "hi"})), done())
    async with Rig(llm, tools=catalog()) as rig:
        end = await rig.run(tools=("local.echo",))
    assert end.reason == "task_completion"
    names = offered(llm)
    assert "local__echo" in names and "task_completion" in names
    assert "local__shout" not in names and "files__read" not in names
    refused = rig.one(ToolErrorEvent)
    assert (refused.tool, refused.code) == ("shout", "not_allowed")
    assert "not allowed in this turn" in refused.message and "local.echo" in refused.message
    assert [e.content for e in rig.of(ToolResultEvent) if e.tool == "echo"] == ["hi"]


async def test_a_turn_allowlist_narrows_the_deployments_and_never_widens_it() -> None:
    llm = ScriptedLLM()
    llm.script(call(("files__read", {"path": "a"})), done())
    async with Rig(llm, tools=catalog()) as rig:
        deployment = msgspec.structs.replace(rig.settings, tools=("echo", "local.shout"))
        rig.engine.settings = deployment
        end = await rig.run(tools=("echo", "files.read"))
    assert end.reason == "task_completion"
    names = offered(llm)
    assert "local__echo" in names
    assert "local__shout" not in names and "files__read" not in names
    refused = rig.one(ToolErrorEvent)
    assert (refused.server, refused.tool, refused.code) == ("files", "read", "not_allowed")


# -- the deadline ---------------------------------------------------------------------


async def test_a_turn_past_its_deadline_ends_with_reason_deadline() -> None:
    async with Rig(ScriptedLLM(default=HANG)) as rig:
        end = await rig.run(deadline_s=0.2)
    assert end.reason == "deadline"
    assert "deadline of 0.2 s passed" in end.content and "Turn.deadline_s" in end.content
    fatal(rig, "deadline")
    assert rig.types[-1] == "loop_end"


async def test_the_deployment_deadline_applies_and_a_tool_call_in_flight_is_answered() -> None:
    tools = LocalTools()

    @tools.tool(timeout_s=60)
    async def stall() -> str:
        await asyncio.Event().wait()
        return "never"

    llm = ScriptedLLM()
    llm.script(call(("local__stall", {})))
    async with Rig(llm, tools=tools, deadline_s=0.2) as rig:
        end = await rig.run()
    assert end.reason == "deadline"
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.pending == () and snapshot.status == "idle"
    last = snapshot.messages[-1]
    assert last.role == "tool" and "ran out of time" in last.content


async def test_a_resumed_turn_keeps_the_deadline_of_its_first_start() -> None:
    tools = LocalTools()
    waiting = asyncio.Event()

    @tools.tool(timeout_s=60)
    async def stall() -> str:
        waiting.set()
        await asyncio.Event().wait()
        return "never"

    llm = ScriptedLLM()
    llm.script(call(("local__stall", {})))
    async with Rig(llm, tools=tools) as rig:
        task = asyncio.create_task(rig.run(deadline_s=600))
        await asyncio.wait_for(waiting.wait(), 5)
        task.cancel()  # the worker dies
        with pytest.raises(asyncio.CancelledError):
            await task
        started = rig.store.get("acme", "s1")
        assert started is not None and started.turn_started_at > 0
        later = rig.fork(ScriptedLLM(default=HANG))
        later.engine.clock = lambda: time.time() + 601  # past the first start's deadline
        end = await later.run(deadline_s=600)
    assert end.reason == "deadline"


# -- the tool-call cap ----------------------------------------------------------------


async def test_calls_past_the_cap_are_refused_and_the_turn_ends_with_max_tool_calls() -> None:
    llm = ScriptedLLM()
    llm.script(
        call(("local__echo", {"text": "a"})),
        call(("local__echo", {"text": "b"}), ("local__echo", {"text": "c"})),
    )
    async with Rig(llm) as rig:
        end = await rig.run(max_tool_calls=2)
    assert end.reason == "max_tool_calls"
    assert "limit of 2 tool calls" in end.content and "1 more" in end.content
    assert [e.content for e in rig.of(ToolResultEvent)] == ["a", "b"]
    refused = rig.one(ToolErrorEvent)
    assert refused.code == "max_tool_calls" and "Turn.max_tool_calls" in refused.message
    fatal(rig, "max_tool_calls")
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.turn_tool_calls == 2


async def test_loop_tools_do_not_count_against_the_cap() -> None:
    llm = ScriptedLLM()
    llm.script(call(("local__echo", {"text": "a"}), ("update_plan", {"steps": ["x"]})), done())
    async with Rig(llm, max_tool_calls=1) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"


async def test_a_resumed_turn_counts_its_tool_calls_from_the_checkpoint() -> None:
    tools = LocalTools()
    waiting, release = asyncio.Event(), asyncio.Event()

    @tools.tool(timeout_s=60)
    async def hold() -> str:
        waiting.set()
        await release.wait()
        return "held"

    tools.add(lambda text: text, name="echo")
    llm = ScriptedLLM()
    llm.script(call(("local__echo", {"text": "a"}), ("local__hold", {})))
    async with Rig(llm, tools=tools) as rig:
        task = asyncio.create_task(rig.run(max_tool_calls=2))
        await asyncio.wait_for(waiting.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stored = rig.store.get("acme", "s1")
        assert stored is not None and stored.turn_tool_calls == 2
        release.set()
        again = ScriptedLLM()
        again.script(call(("local__echo", {"text": "b"})))
        later = rig.fork(again)
        end = await later.run(max_tool_calls=2)
    assert end.reason == "max_tool_calls"
    assert later.one(ToolErrorEvent).code == "max_tool_calls"


# -- parallel calls of one iteration ----------------------------------------------------


@pytest.mark.parametrize("parallel", [1, 2])
async def test_at_most_max_parallel_tools_calls_run_at_once_and_the_rest_queue(
    parallel: int,
) -> None:
    tools = LocalTools()
    barrier = asyncio.Barrier(parallel)  # passes only when `parallel` calls run together
    active = peak = 0

    @tools.tool(timeout_s=60)
    async def meet(n: int) -> str:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            async with asyncio.timeout(10):
                await barrier.wait()
        finally:
            active -= 1
        return f"met {n}"

    llm = ScriptedLLM()
    llm.script(call(*[("local__meet", {"n": n}) for n in range(4)]), done())
    async with Rig(llm, tools=tools, max_parallel_tools=8) as rig:
        end = await rig.run(max_parallel_tools=parallel)
    assert end.reason == "task_completion"
    assert sorted(e.content for e in rig.of(ToolResultEvent) if e.tool == "meet") == [
        f"met {n}" for n in range(4)
    ]
    assert peak == parallel


# -- the tool-failure mode -----------------------------------------------------------


def failing() -> LocalTools:
    tools = LocalTools()

    @tools.tool()
    def flaky() -> str:
        raise RuntimeError("disk full")

    return tools


async def test_in_fail_mode_a_failed_tool_call_ends_the_turn_with_tool_failed() -> None:
    llm = ScriptedLLM()
    llm.script(call(("local__flaky", {})))
    async with Rig(llm, tools=failing(), tool_failure="fail") as rig:
        end = await rig.run()
    assert end.reason == "tool_failed"
    assert "local.flaky failed" in end.content and "disk full" in end.content
    assert "tool_failure" in end.content
    assert rig.one(ToolErrorEvent).tool == "flaky"
    fatal(rig, "tool_failed")
    assert len(llm.requests) == 1


async def test_in_continue_mode_the_error_goes_to_the_model_and_the_turn_goes_on() -> None:
    llm = ScriptedLLM()
    llm.script(call(("local__flaky", {})), done("handled"))
    async with Rig(llm, tools=failing(), tool_failure="fail") as rig:
        end = await rig.run(tool_failure="continue")
    assert (end.reason, end.content) == ("task_completion", "handled")
    tool_message = [m for m in llm.requests[1].messages if m.role == "tool"]
    assert "disk full" in tool_message[-1].content
    failed = rig.one(ToolErrorEvent)  # the failure is reported, and ends nothing
    assert failed.tool == "flaky" and "disk full" in failed.message
    assert not [e for e in rig.of(Error) if e.fatal]


# -- through the real openai client ----------------------------------------------------


async def test_limits_through_the_openai_client_against_the_fake_server(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("local__echo", {"text": "one"}), ("local__shout", {"text": "two"})),
        tool_calls(("local__echo", {"text": "three"})),
    )
    async with Rig.openai(fake_llm, tools=catalog()) as rig:
        end = await rig.run(tools=("local.echo", "local.shout"), max_tool_calls=2)
    assert end.reason == "max_tool_calls"
    sent = {t["function"]["name"] for t in fake_llm.requests[0]["tools"]}
    assert {"local__echo", "local__shout"} <= sent and "files__read" not in sent
    assert [e.content for e in rig.of(ToolResultEvent)] == ["one", "TWO"]
    assert rig.one(ToolErrorEvent).code == "max_tool_calls"
    assert rig.of(LoopEnd)[-1].reason == "max_tool_calls"


# -- room kept for the reply ------------------------------------------------------------


async def test_the_reply_reserve_is_kept_out_of_the_prompts_budget() -> None:
    llm = ScriptedLLM()
    llm.script(done())
    async with Rig(llm) as rig:
        await rig.run()
    needed = rig.one(ContextBudget).tokens
    reserve = 16_000 - needed + 1  # the prompt no longer fits beside the reply
    async with Rig(ScriptedLLM(), reply_reserve_tokens=reserve) as rig:
        end = await rig.run()
    assert end.reason == "budget_exceeded"
    budget = rig.of(ContextBudget)[0]
    assert (budget.budget, budget.reply_reserve) == (needed - 1, reserve)


def test_a_reply_reserve_that_leaves_no_room_for_the_prompt_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="reply_reserve_tokens"):
        msgspec.convert({"context_budget_tokens": 1000, "reply_reserve_tokens": 900}, LoopSettings)
