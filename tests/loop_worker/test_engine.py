"""The engine's core: the loop, tools, loop-breaking tools, events and checkpoints.

Each behaviour runs through the real ``openai`` client against the fake server;
a few use the scripted LLM where that is clearer.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from loop_worker.engine.errors import StaleSessionError
from loop_worker.engine.inmemory import LocalTools
from loop_worker.engine.tokens import TokenCounter
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import ChatMessage, SessionSnapshot, ToolCall, ToolCallRequest, call_id
from schemas.events import (
    Error,
    LoopEnd,
    LoopIteration,
    LoopStart,
    Message,
    Question,
    ToolCallEvent,
    ToolResultEvent,
)
from tests.loop_worker.scripted import Rig, ScriptedLLM, call, done, echo


def cid(turn: str, iteration: int, index: int) -> str:
    """The call id the engine gives a call of acme/s1's turn ``turn``."""
    return call_id("acme", "s1", turn, iteration, index)


async def test_task_completion_ends_the_turn_with_its_result_and_the_events_in_order(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(tool_calls(("task_completion", {"result": "The answer is 42."})))
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert (end.reason, end.content, end.iterations) == ("task_completion", "The answer is 42.", 1)
    assert rig.types == [
        "turn_accepted",
        "loop_start",
        "loop_iteration",
        "context_budget",
        "llm_request",
        "llm_response",
        "tool_call",
        "message",
        "tool_result",
        "loop_end",
    ]
    assert rig.one(Message).content == "The answer is 42."


@pytest.mark.parametrize(
    ("tool", "argument", "event"),
    [("ask_question", "question", Question), ("converse", "message", Message)],
)
async def test_ask_question_and_converse_end_the_turn_with_their_reason(
    fake_llm: FakeLLM, tool: str, argument: str, event: type
) -> None:
    fake_llm.script(tool_calls((tool, {argument: "Which file?"})))
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == (tool, "Which file?")
    found = rig.one(event)
    assert (found.text if event is Question else found.content) == "Which file?"


async def test_a_tool_result_goes_back_to_the_model_and_the_loop_continues(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("local__echo", {"text": "ping"})),
        tool_calls(("task_completion", {"result": "ok"})),
    )
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert (end.reason, end.iterations) == ("task_completion", 2)
    second = fake_llm.requests[1]["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "local__echo"
    assert second[-1] == {"role": "tool", "content": "ping", "tool_call_id": cid("t1", 1, 0)}
    [called] = [e for e in rig.of(ToolCallEvent) if e.tool == "echo"]
    [result] = [e for e in rig.of(ToolResultEvent) if e.tool == "echo"]
    assert (called.call_id, called.server, called.arguments) == (
        cid("t1", 1, 0),
        "local",
        {"text": "ping"},
    )
    assert (result.call_id, result.content) == (cid("t1", 1, 0), "ping")
    assert [r.call_id for r in rig.tools.runs] == [call_id("acme", "s1", "t1", 1, 0)]


async def test_several_native_tool_calls_in_one_response_run_concurrently(
    fake_llm: FakeLLM,
) -> None:
    barrier = asyncio.Barrier(2)  # each call waits for the other: sequential calls time out
    tools = LocalTools()

    @tools.tool(timeout_s=60)
    async def meet(name: str) -> str:
        async with asyncio.timeout(30):
            await barrier.wait()
        return f"met {name}"

    fake_llm.script(
        tool_calls(("local__meet", {"name": "a"}), ("local__meet", {"name": "b"})),
        tool_calls(("task_completion", {"result": "ok"})),
    )
    async with Rig.openai(fake_llm, tools=tools) as rig:
        await rig.run()
    contents = [e.content for e in rig.of(ToolResultEvent) if e.tool == "meet"]
    assert sorted(contents) == ["met a", "met b"]
    tool_messages = [m for m in fake_llm.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == [cid("t1", 1, 0), cid("t1", 1, 1)]


async def test_every_event_carries_tenant_session_turn_iteration_and_time(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("local__echo", {"text": "x"})),
        tool_calls(("task_completion", {"result": "ok"})),
    )
    async with Rig.openai(fake_llm) as rig:
        rig.engine.clock = lambda: 1234.5
        await rig.run()
    assert {(e.tenant, e.session, e.turn_id, e.ts) for e in rig.events.events} == {
        ("acme", "s1", "t1", 1234.5)
    }
    assert [e.iteration for e in rig.of(LoopIteration)] == [1, 2]
    assert {e.iteration for e in rig.of(ToolCallEvent)} == {1, 2}


async def test_a_checkpoint_is_saved_after_every_iteration_and_before_its_tool_calls_run(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("local__echo", {"text": "x"})),
        tool_calls(("task_completion", {"result": "ok"})),
    )
    async with Rig.openai(fake_llm) as rig:
        saved: list[SessionSnapshot] = []
        save = rig.store.save

        async def spy(snapshot: SessionSnapshot) -> None:
            saved.append(snapshot)
            await save(snapshot)

        rig.store.save = spy  # type: ignore[method-assign]
        await rig.run()
    assert [(s.status, s.iteration, [p.id for p in s.pending]) for s in saved] == [
        ("running", 0, []),  # the turn started: its user message is stored
        ("running", 0, [cid("t1", 1, 0)]),  # the model answered: its calls are stored, then run
        ("running", 1, []),
        ("running", 1, [cid("t1", 2, 0)]),
        ("idle", 2, []),
    ]
    calling = saved[1]
    assert [m.role for m in calling.messages] == ["user", "assistant"]
    assert (calling.pending[0].server, calling.pending[0].tool) == ("local", "echo")
    assert calling.pending[0].arguments == {"text": "x"}
    after_first = saved[2].messages
    assert [m.role for m in after_first] == ["user", "assistant", "tool"]
    assert after_first[2].content == "x"
    assert (saved[4].turn_id, saved[4].turns) == ("t1", 1)


async def test_a_running_turn_resumes_after_its_last_checkpoint_reusing_recorded_results(
    fake_llm: FakeLLM,
) -> None:
    async with Rig.openai(fake_llm) as rig:
        # a worker finished iteration 1, ran iteration 2's tool call, then died
        user = ChatMessage(role="user", content="do the task")
        first = ChatMessage(
            role="assistant",
            tool_calls=(
                ToolCall(id=cid("t1", 1, 0), name="local__echo", arguments='{"text":"one"}'),
            ),
        )
        result = ChatMessage(role="tool", content="one", tool_call_id=cid("t1", 1, 0))
        await rig.store.save(
            SessionSnapshot(
                tenant="acme",
                session="s1",
                messages=(user, first, result),
                status="running",
                turn_id="t1",
                iteration=1,
            )
        )
        request = ToolCallRequest(
            call_id=call_id("acme", "s1", "t1", 2, 0),
            tenant="acme",
            session="s1",
            turn_id="t1",
            server="local",
            tool="echo",
            arguments={"text": "two"},
        )
        await rig.tools.call(request)
        fake_llm.script(
            tool_calls(("local__echo", {"text": "two"})),
            tool_calls(("task_completion", {"result": "ok"})),
        )
        end = await rig.run()
    start = rig.one(LoopStart)
    assert start.resumed is True
    assert [e.iteration for e in rig.of(LoopIteration)] == [2, 3]
    assert len(rig.tools.runs) == 1  # the recorded result was returned, not run again
    assert (end.reason, end.iterations) == ("task_completion", 3)
    resent = fake_llm.requests[0]["messages"]
    assert resent[-1] == {"role": "tool", "content": "one", "tool_call_id": cid("t1", 1, 0)}


async def test_a_finished_turn_delivered_again_emits_only_its_loop_end_again(
    fake_llm: FakeLLM,
) -> None:
    """A crash between the last checkpoint and the ``loop_end`` would otherwise leave
    the turn without one: a redelivery that finds it done emits it again, the same
    (the stream drops a second copy by its fixed msg id), and asks the model nothing."""
    fake_llm.script(tool_calls(("task_completion", {"result": "ok"})))
    async with Rig.openai(fake_llm) as rig:
        first = await rig.run()
        count = len(rig.events.events)
        again = await rig.engine.run(rig.turn(), rig.control)
    assert isinstance(again, LoopEnd)
    assert rig.events.events[count:] == [again]
    fields = ("reason", "content", "iterations", "error", "iteration", "turn_id")
    assert [getattr(again, f) for f in fields] == [getattr(first, f) for f in fields]
    assert len(fake_llm.requests) == 1


async def test_a_snapshot_that_does_not_say_how_its_turn_ended_emits_nothing(
    fake_llm: FakeLLM,
) -> None:
    """A snapshot stored before ``last_end`` existed: the turn is done, nothing to say."""
    fake_llm.script(tool_calls(("task_completion", {"result": "ok"})))
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
        turn = rig.turn()
        stored = await rig.engine.store.load(turn.tenant, turn.session)
        assert stored is not None and stored.last_end is not None
        await rig.engine.store.save(msgspec.structs.replace(stored, last_end=None))
        count = len(rig.events.events)
        again = await rig.engine.run(turn, rig.control)
    assert again is None
    assert len(rig.events.events) == count


async def test_the_next_turn_sees_the_history_and_the_session_counts_turns(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("task_completion", {"result": "first answer"})),
        tool_calls(("task_completion", {"result": "second answer"})),
    )
    async with Rig.openai(fake_llm) as rig:
        await rig.run("first question", id="t1")
        await rig.run("second question", id="t2")
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None
    assert (snapshot.status, snapshot.turn_id, snapshot.turns) == ("idle", "t2", 2)
    history = fake_llm.requests[1]["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool", "user"]
    assert history[1]["content"] == "first question"  # earlier turns keep their plain input
    assert history[-1]["content"].endswith("second question")


async def test_max_iterations_ends_the_turn_with_an_error_event(fake_llm: FakeLLM) -> None:
    fake_llm.script(*[tool_calls(("local__echo", {"text": str(i)})) for i in range(3)])
    async with Rig.openai(fake_llm, max_iterations=3) as rig:
        end = await rig.run()
    assert (end.reason, end.iterations) == ("max_iterations", 3)
    error = rig.one(Error)
    assert error.code == "max_iterations"
    assert rig.types[-2:] == ["error", "loop_end"]


async def test_an_unexpected_exception_ends_the_turn_with_an_error_and_one_loop_end() -> None:
    class BrokenTools(LocalTools):
        async def tools(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("catalog unavailable")

    async with Rig(ScriptedLLM([done()]), tools=BrokenTools()) as rig:
        end = await rig.run()
    assert (end.reason, end.error) == ("error", "RuntimeError: catalog unavailable")
    assert rig.one(Error).fatal is True
    assert rig.types.count("loop_end") == 1
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.status == "idle"


async def test_a_checkpoint_that_loses_a_race_ends_the_turn_with_one_loop_end() -> None:
    llm = ScriptedLLM([call(("local__echo", {"text": "x"})), done()])
    async with Rig(llm) as rig:
        other = rig.store.fork()
        original = rig.tools.call

        async def meanwhile(request: ToolCallRequest):  # type: ignore[no-untyped-def]
            snapshot = await other.load("acme", "s1")  # another worker took the session
            assert snapshot is not None
            await other.save(snapshot)
            return await original(request)

        rig.tools.call = meanwhile  # type: ignore[method-assign]
        end = await rig.run()
    assert end.reason == "error"
    assert end.error is not None and StaleSessionError.__name__ in end.error
    assert rig.types.count("loop_end") == 1


async def test_tool_calls_get_deterministic_ids_from_turn_iteration_and_index() -> None:
    llm = ScriptedLLM(
        [call(("local__echo", {"text": "a"}), ("local__echo", {"text": "b"})), done()]
    )
    async with Rig(llm) as rig:
        await rig.run(id="turn-7")
    assert [r.call_id for r in rig.tools.runs] == [cid("turn-7", 1, 0), cid("turn-7", 1, 1)]
    assert [e.call_id for e in rig.of(ToolCallEvent)] == [
        cid("turn-7", 1, 0),
        cid("turn-7", 1, 1),
        cid("turn-7", 2, 0),
    ]


async def test_local_tools_record_results_by_call_id() -> None:
    tools = LocalTools()
    tools.add(echo)
    request = ToolCallRequest(
        call_id="c1",
        tenant="a",
        session="s",
        turn_id="t",
        server="local",
        tool="echo",
        arguments={"text": "hi"},
    )
    first = await tools.call(request)
    again = await tools.call(request)
    assert first == again
    assert len(tools.runs) == 1


async def test_loop_end_is_the_last_event_and_there_is_only_one(fake_llm: FakeLLM) -> None:
    fake_llm.script(
        tool_calls(("task_completion", {"result": "a"}), ("converse", {"message": "b"}))
    )
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("task_completion", "a")  # the first one wins
    assert rig.types.count("loop_end") == 1
    assert isinstance(rig.events.events[-1], LoopEnd)


async def test_the_next_turn_does_not_tokenise_again_what_an_earlier_turn_counted(
    fake_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[str] = []
    real = TokenCounter.count_text

    def spy(self: TokenCounter, text: str) -> int:
        encoded.append(text)
        return real(self, text)

    monkeypatch.setattr(TokenCounter, "count_text", spy)
    fake_llm.script(
        tool_calls(("task_completion", {"result": "one"})),
        tool_calls(("task_completion", {"result": "two"})),
    )
    async with Rig.openai(fake_llm) as rig:
        await rig.run("first task", id="t1")
        system = fake_llm.requests[0]["messages"][0]["content"]
        first = encoded.count(system)
        await rig.run("second task", id="t2")
    assert fake_llm.requests[1]["messages"][0]["content"] == system
    assert first == 1 and encoded.count(system) == 1
