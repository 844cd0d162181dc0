"""Cancel, pause, resume and human approval, through the real openai client."""

from __future__ import annotations

import asyncio

from loop_worker.engine.inmemory import LocalTools
from loopmesh.testing.fake_llm import FakeLLM, hang, text, tool_calls
from schemas import ApprovalDecision
from schemas.events import ApprovalDecided, ApprovalRequired, LoopEnd, ToolErrorEvent
from tests.loop_worker.scripted import Rig


def finish() -> object:
    return tool_calls(("task_completion", {"result": "ok"}))


async def test_cancelling_stops_the_llm_stream_promptly(fake_llm: FakeLLM) -> None:
    fake_llm.script(hang(60))
    async with Rig.openai(fake_llm) as rig:
        task = asyncio.create_task(rig.run())
        await rig.events.wait_for("llm_request")
        await fake_llm.wait_requests(1)
        rig.control.cancel("user pressed stop")
        async with asyncio.timeout(15):
            end = await task
        await fake_llm.wait_disconnects(1)
    assert (end.reason, end.error) == ("cancelled", "user pressed stop")
    assert rig.types.count("loop_end") == 1


async def test_cancelling_mid_stream_after_some_deltas(fake_llm: FakeLLM) -> None:
    fake_llm.script(text("a slow story " * 50, chunk_size=4, delay_s=0.5))
    async with Rig.openai(fake_llm) as rig:
        task = asyncio.create_task(rig.run())
        await rig.events.wait_for("content_delta")
        rig.control.cancel()
        async with asyncio.timeout(15):
            end = await task
    assert end.reason == "cancelled"


async def test_cancelling_stops_pending_tool_waits_and_closes_the_calls(fake_llm: FakeLLM) -> None:
    started = asyncio.Event()
    tools = LocalTools()

    @tools.tool()
    async def slow() -> str:
        started.set()
        await asyncio.sleep(60)
        return "never"

    fake_llm.script(tool_calls(("local__slow", {})))
    async with Rig.openai(fake_llm, tools=tools) as rig:
        task = asyncio.create_task(rig.run())
        async with asyncio.timeout(30):
            await started.wait()
        rig.control.cancel()
        async with asyncio.timeout(15):
            end = await task
    assert end.reason == "cancelled"
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.status == "idle"
    # the history never holds a call without its result
    assert [m.role for m in snapshot.messages] == ["user", "assistant", "tool"]
    assert "cancelled" in snapshot.messages[-1].content


async def test_a_cancel_before_the_turn_starts_ends_it_at_once(fake_llm: FakeLLM) -> None:
    async with Rig.openai(fake_llm) as rig:
        rig.control.cancel()
        end = await rig.run()
    assert end.reason == "cancelled"
    assert fake_llm.requests == []


async def test_pause_waits_at_the_iteration_boundary_and_resume_continues(
    fake_llm: FakeLLM,
) -> None:
    tools = LocalTools()
    rig_ref: list[Rig] = []

    @tools.tool()
    def pause_me() -> str:
        rig_ref[0].control.pause()  # the person pauses while a tool runs
        return "paused"

    fake_llm.script(tool_calls(("local__pause_me", {})), finish())
    async with Rig.openai(fake_llm, tools=tools) as rig:
        rig_ref.append(rig)
        task = asyncio.create_task(rig.run())
        await rig.events.wait_for("paused")
        assert len(fake_llm.requests) == 1  # nothing more happens while paused
        assert "loop_iteration" not in rig.types[rig.types.index("paused") :]
        rig.control.resume()
        async with asyncio.timeout(30):
            end = await task
    assert end.reason == "task_completion"
    paused, resumed = rig.types.index("paused"), rig.types.index("resumed")
    assert paused < resumed < len(rig.types) - 1
    assert rig.types[resumed + 1] == "loop_iteration"


async def test_cancelling_a_paused_turn_ends_it(fake_llm: FakeLLM) -> None:
    fake_llm.script(finish())
    async with Rig.openai(fake_llm) as rig:
        rig.control.pause()
        task = asyncio.create_task(rig.run())
        await rig.events.wait_for("paused")
        rig.control.cancel()
        async with asyncio.timeout(15):
            end = await task
    assert end.reason == "cancelled"


async def _approval_rig(fake_llm: FakeLLM, **settings: object) -> Rig:
    def delete(path: str) -> str:
        return f"deleted {path}"

    rig = Rig.openai(fake_llm, approval_tools=("local.delete",), **settings)  # type: ignore[arg-type]
    rig.tools.add(delete)
    fake_llm.script(tool_calls(("local__delete", {"path": "/tmp/x"})), finish())
    return rig


async def test_a_tool_that_needs_approval_waits_and_runs_once_approved(fake_llm: FakeLLM) -> None:
    async with await _approval_rig(fake_llm) as rig:
        task = asyncio.create_task(rig.run())
        asked = await rig.events.wait_for("approval_required")
        assert isinstance(asked, ApprovalRequired)
        assert (asked.server, asked.tool, asked.arguments) == (
            "local",
            "delete",
            {"path": "/tmp/x"},
        )
        assert rig.tools.runs == []
        await rig.control.decide(
            ApprovalDecision(tenant="acme", session="s1", call_id=asked.call_id, approved=True)
        )
        end = await asyncio.wait_for(task, 30)
    assert end.reason == "task_completion"
    assert rig.one(ApprovalDecided).approved is True
    assert [r.tool for r in rig.tools.runs] == ["delete"]


async def test_a_rejected_tool_call_goes_back_to_the_model_with_the_reason(
    fake_llm: FakeLLM,
) -> None:
    async with await _approval_rig(fake_llm) as rig:
        task = asyncio.create_task(rig.run())
        asked = await rig.events.wait_for("approval_required")
        await rig.control.decide(
            ApprovalDecision(
                tenant="acme", session="s1", call_id=asked.call_id, approved=False, reason="no!"
            )
        )
        await asyncio.wait_for(task, 30)
    assert rig.tools.runs == []
    assert rig.one(ToolErrorEvent).code == "rejected"
    sent = fake_llm.requests[1]["messages"][-1]["content"]
    assert sent == "Error (rejected): rejected by a person: no!"


async def test_an_approval_that_times_out_is_a_refusal(fake_llm: FakeLLM) -> None:
    async with await _approval_rig(fake_llm, approval_timeout_s=0.05) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    decided = rig.one(ApprovalDecided)
    assert (decided.approved, decided.reason) == (False, "no decision within 0.05 s")
    assert "no decision within 0.05 s" in fake_llm.requests[1]["messages"][-1]["content"]


async def test_tools_marked_needs_approval_in_their_spec_wait_too(fake_llm: FakeLLM) -> None:
    tools = LocalTools()
    tools.add(lambda: "launched", name="launch", needs_approval=True)
    fake_llm.script(tool_calls(("local__launch", {})), finish())
    async with Rig.openai(fake_llm, tools=tools, approval_timeout_s=0.05) as rig:
        await rig.run()
    assert rig.one(ApprovalRequired).tool == "launch"
    assert tools.runs == []


async def test_cancelling_while_waiting_for_approval_ends_the_turn(fake_llm: FakeLLM) -> None:
    async with await _approval_rig(fake_llm) as rig:
        task = asyncio.create_task(rig.run())
        await rig.events.wait_for("approval_required")
        rig.control.cancel()
        end: LoopEnd = await asyncio.wait_for(task, 15)
    assert end.reason == "cancelled"
