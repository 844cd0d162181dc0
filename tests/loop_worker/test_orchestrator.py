"""The dual-model orchestrator (``mode = "orchestrator"``): the real ``openai`` client
against the fake server, scripted per model (a planner and an executor)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from loopmesh.commands.printer import Printer
from loopmesh.testing.fake_llm import FakeLLM, empty, error, text, tool_calls
from schemas import DecodeError, ToolSpec, Turn, decode, encode
from schemas.events import (
    ContentDelta,
    Error,
    LoopEnd,
    LoopIteration,
    LoopStart,
    Message,
    OrchestratorFallback,
    PlanUpdate,
    Retry,
    ToolCallEvent,
)
from tests.loop_worker.scripted import CountingTools, Rig

ORCH = {"mode": "orchestrator", "planner_model": "planner", "executor_model": "executor"}


def plan(*steps: str) -> str:
    body = {"steps": [{"id": str(n), "description": d} for n, d in enumerate(steps, 1)]}
    return f"Here is the plan:\n```json\n{json.dumps(body)}\n```\nI hope it helps."


def fruit_tools() -> CountingTools:
    """``count`` answers with the name's length and the name: "6 apples"."""
    return CountingTools(lambda name: f"{len(name)} {name}")


def messages_text(request: dict[str, Any]) -> str:
    return "\n".join(str(m.get("content") or "") for m in request["messages"])


async def test_a_three_step_plan_runs_to_a_synthesized_streamed_answer() -> None:
    tools = fruit_tools()
    async with FakeLLM() as fake:
        fake.script_for(
            "planner",
            text(plan("count the apples", "count the pears", "add them up")),
            text("You have 6 apples and 5 pears: 11 fruit.", chunk_size=5),
        )
        fake.script_for(
            "executor",
            tool_calls(("local__count", {"name": "apples"})),
            text("6 apples"),
            tool_calls(("local__count", {"name": "pears"})),
            text("5 pears"),
            text("11 in all"),
        )
        async with Rig.openai(fake, tools=tools, **ORCH) as rig:
            end = await rig.run("How many fruit do I have?")
    assert (end.reason, end.content) == (
        "task_completion",
        "You have 6 apples and 5 pears: 11 fruit.",
    )
    assert tools.counted == {"apples": 1, "pears": 1}
    # the plan, shown as it goes, ends with every step done and its result
    final = rig.of(PlanUpdate)[-1].plan
    assert [(s.id, s.status, s.result) for s in final] == [
        ("1", "done", "6 apples"),
        ("2", "done", "5 pears"),
        ("3", "done", "11 in all"),
    ]
    assert rig.of(PlanUpdate)[0].plan[0].status == "pending"
    # the planner: no tools, a JSON schema asked for; the executor: the tools
    planner, executor = fake.requests_for("planner"), fake.requests_for("executor")
    assert len(planner) == 2 and len(executor) == 5
    assert "tools" not in planner[0] and planner[0]["response_format"]["type"] == "json_schema"
    assert {t["function"]["name"] for t in executor[0]["tools"]} == {"local__count", "local__wait"}
    # each step sees the earlier steps' results; the synthesis sees them all
    assert "6 apples" not in messages_text(executor[0])
    assert "6 apples" in messages_text(executor[2]) and "5 pears" in messages_text(executor[4])
    assert "add them up" in messages_text(executor[4])
    assert all(r in messages_text(planner[1]) for r in ("6 apples", "5 pears", "11 in all"))
    # call ids are unique per step; only the synthesis streams content
    ids = [e.call_id for e in rig.of(ToolCallEvent)]
    assert len(set(ids)) == 2
    last = rig.of(Message)[-1]
    deltas = [e for e in rig.of(ContentDelta)]
    assert "".join(e.text for e in deltas) == end.content
    assert {e.iteration for e in deltas} == {last.iteration}
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.status == "idle"
    assert [m.role for m in snapshot.messages] == ["user", "assistant"]


async def test_an_unparseable_plan_falls_back_to_the_single_model_loop() -> None:
    tools = fruit_tools()
    async with FakeLLM() as fake:
        fake.script_for("planner", text("First I would count the apples, then the pears."))
        fake.script_for(
            "fake-model",
            tool_calls(("local__count", {"name": "apples"})),
            tool_calls(("task_completion", {"result": "6 apples"})),
        )
        async with Rig.openai(fake, tools=tools, **ORCH) as rig:
            end = await rig.run("How many apples?")
    fell = rig.one(OrchestratorFallback)
    assert fell.reason == "plan_unparseable" and "no JSON plan" in fell.message
    assert (end.reason, end.content) == ("task_completion", "6 apples")
    assert tools.counted == {"apples": 1}
    assert rig.types.index("orchestrator_fallback") < rig.types.index("tool_call")
    loop = fake.requests_for("fake-model")
    assert "could not be carried out" in messages_text(loop[0])
    assert not fake.requests_for("executor")
    # the ordinary loop numbers its iterations after the planner's
    assert [e.iteration for e in rig.of(ToolCallEvent) if e.server == "local"] == [2]


async def test_a_step_failing_past_its_retries_falls_back_with_what_was_learnt() -> None:
    tools = fruit_tools()
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("count the apples", "count the pears")))
        fake.script_for(
            "executor",
            tool_calls(("local__count", {"name": "apples"})),
            text("6 apples"),
            error(400, "the executor cannot do this"),  # step 2, attempt 1
            error(400, "the executor cannot do this"),  # step 2, attempt 2
        )
        fake.script_for("fake-model", tool_calls(("task_completion", {"result": "6 and 5"})))
        async with Rig.openai(fake, tools=tools, step_retries=1, **ORCH) as rig:
            end = await rig.run("Count my fruit")
    assert rig.one(Retry).what == "step"
    fell = rig.one(OrchestratorFallback)
    assert (fell.reason, fell.step, fell.finished) == ("step_failed", "2", 1)
    assert "after 2 attempts" in fell.message and "cannot do this" in fell.message
    assert (end.reason, end.content) == ("task_completion", "6 and 5")
    prompt = messages_text(fake.requests_for("fake-model")[0])
    assert "6 apples" in prompt  # the finished step's result
    assert tools.counted == {"apples": 1}


async def test_a_step_without_a_result_within_its_iterations_is_retried_then_falls_back() -> None:
    tools = fruit_tools()
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("count the apples")))
        fake.script_for(
            "executor",
            *[tool_calls(("local__count", {"name": f"a{i}"})) for i in range(4)],
        )
        fake.script_for("fake-model", tool_calls(("task_completion", {"result": "gave up"})))
        settings = {"step_retries": 1, "step_max_iterations": 2}
        async with Rig.openai(fake, tools=tools, **settings, **ORCH) as rig:
            end = await rig.run("Count")
    fell = rig.one(OrchestratorFallback)
    assert fell.reason == "step_failed" and "no result within 2 executor calls" in fell.message
    assert end.content == "gave up"
    assert tools.counted == {"a0": 1, "a1": 1, "a2": 1, "a3": 1}
    assert len({e.call_id for e in rig.of(ToolCallEvent) if e.server == "local"}) == 4


async def test_the_turn_s_models_override_the_deployment_s() -> None:
    async with FakeLLM() as fake:
        fake.script_for("plan-b", text('{"steps": ["say hi"]}'), text("Hi there."))
        fake.script_for("exec-b", text("hi"))
        deployment = {"mode": "orchestrator", "planner_model": "plan-a", "executor_model": "exec-a"}
        async with Rig.openai(fake, **deployment) as rig:
            end = await rig.run("greet me", planner_model="plan-b", executor_model="exec-b")
            assert end.content == "Hi there."
            assert [r["model"] for r in fake.requests] == ["plan-b", "exec-b", "plan-b"]
            # a turn may also leave the deployment's orchestrator for the ordinary loop
            fake.script_for("fake-model", tool_calls(("converse", {"message": "hello"})))
            end = await rig.run("hello", id="t2", mode="loop")
    assert (end.reason, end.content) == ("converse", "hello")
    assert fake.requests[-1]["model"] == "fake-model"
    assert rig.of(LoopStart)[-1].resumed is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "swarm"),
        ("planner_model", ""),
        ("executor_model", "two words"),
        ("planner_model", "x" * 201),
    ],
)
def test_a_turn_with_an_invalid_orchestrator_field_is_refused(field: str, value: str) -> None:
    good = Turn(id="t1", tenant="acme", session="s1", input="hi", **ORCH)  # type: ignore[arg-type]
    raw = {**msgspec.to_builtins(good), field: value}
    with pytest.raises(DecodeError, match=field):
        decode(msgspec.json.encode(raw), Turn)
    assert decode(encode(good), Turn) == good


async def test_a_worker_dying_mid_step_resumes_at_that_step_running_no_call_twice() -> None:
    tools = fruit_tools()
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("count the apples", "wait", "count the pears")))
        fake.script_for(
            "executor",
            tool_calls(("local__count", {"name": "apples"})),
            text("6 apples"),
            tool_calls(("local__wait", {}), ("local__count", {"name": "plums"})),
        )
        async with Rig.openai(fake, tools=tools, **ORCH) as rig:
            task = asyncio.create_task(rig.run("Count my fruit"))
            await asyncio.wait_for(tools.waiting.wait(), 20)
            task.cancel()  # the worker dies while step 2's call waits
            with pytest.raises(asyncio.CancelledError):
                await task
            stored = rig.store.get("acme", "s1")
            assert stored is not None and stored.orchestrator is not None
            assert stored.orchestrator.step == 1 and len(stored.pending) == 2
            tools.waiting.clear()
            tools.release.set()
            fake.script_for(
                "executor",
                text("waited; 5 plums"),
                tool_calls(("local__count", {"name": "pears"})),
                text("5 pears"),
            )
            fake.script_for("planner", text("6 apples, 5 plums, 5 pears."))
            second = rig.fork()
            end = await second.run("Count my fruit")
    assert end.content == "6 apples, 5 plums, 5 pears."
    assert tools.counted == {"apples": 1, "plums": 1, "pears": 1}
    assert second.one(LoopStart).resumed is True
    # the resumed run re-issues step 2's calls first, and asks the planner only to write
    assert second.types[1:3] == ["tool_call", "tool_call"]
    assert len(fake.requests_for("planner")) == 2
    assert [s.result for s in second.of(PlanUpdate)[-1].plan] == [
        "6 apples",
        "waited; 5 plums",
        "5 pears",
    ]


class OnlyCounting:
    """A tool selector that keeps the tools whose description shares a word with the step."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, text: str, tools: Sequence[ToolSpec]) -> Sequence[ToolSpec]:
        self.asked.append(text)
        extra = ToolSpec(server="evil", name="not_offered")  # a selector only narrows
        words = set(text.lower().split())
        return [t for t in tools if words & set(t.description.lower().split())] + [extra]


async def test_a_tool_selector_narrows_each_step_s_tools() -> None:
    selector = OnlyCounting()
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("count the apples")), text("done"))
        fake.script_for("executor", text("6 apples"))
        async with Rig.openai(fake, tools=fruit_tools(), **ORCH) as rig:
            rig.engine.select_tools = selector
            end = await rig.run("Count")
    assert end.content == "done"
    assert selector.asked == ["count the apples"]
    offered = [t["function"]["name"] for t in fake.requests_for("executor")[0]["tools"]]
    assert offered == ["local__count"]


async def test_an_ordinary_turn_ends_with_the_same_events_as_before() -> None:
    async with FakeLLM() as fake:
        fake.script_for("fake-model", tool_calls(("task_completion", {"result": "ok"})))
        async with Rig.openai(fake) as rig:
            end = await rig.run()
    assert isinstance(end, LoopEnd) and end.content == "ok"
    assert "orchestrator_fallback" not in rig.types and "plan_update" not in rig.types


async def test_a_planner_that_refuses_response_format_is_asked_again_without_it() -> None:
    async with FakeLLM() as fake:
        fake.script_for(
            "planner",
            error(400, "response_format is not supported"),
            text(plan("say hi")),
            text("Hi."),
        )
        fake.script_for("executor", text("hi"))
        async with Rig.openai(fake, **ORCH) as rig:
            end = await rig.run("greet me")
    assert end.content == "Hi."
    first, second, _ = fake.requests_for("planner")
    assert "response_format" in first and "response_format" not in second


def test_the_cli_says_when_the_orchestrator_falls_back() -> None:
    out = io.StringIO()
    fell = OrchestratorFallback(
        tenant="t", session="s", turn_id="u", reason="plan_unparseable", message="no JSON plan"
    )
    Printer(out).show(fell)
    assert "plan was given up (plan_unparseable)" in out.getvalue()
    assert "no JSON plan" in out.getvalue()


async def test_the_turn_s_limits_hold_inside_a_step() -> None:
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("count the apples")))
        fake.script_for("executor", tool_calls(("local__count", {"wrong": "argument"})))
        async with Rig.openai(fake, tools=fruit_tools(), **ORCH) as rig:
            end = await rig.run("Count", tool_failure="fail")
    assert end.reason == "tool_failed" and "local.count" in end.content
    assert "orchestrator_fallback" not in rig.types
    assert rig.types[-1] == "loop_end"


async def test_an_empty_executor_reply_is_asked_again_within_the_step() -> None:
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("say hi")), text("Hi."))
        fake.script_for("executor", empty(), text("hi"))
        async with Rig.openai(fake, **ORCH) as rig:
            end = await rig.run("greet me")
    assert end.content == "Hi."
    assert rig.of(PlanUpdate)[-1].plan[0].result == "hi"
    second = fake.requests_for("executor")[1]
    assert [m["role"] for m in second["messages"]] == ["system", "user"]


async def test_the_orchestrator_s_own_calls_end_the_turn_at_max_iterations() -> None:
    tools = fruit_tools()
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("count the apples", "count the pears")))
        fake.script_for(
            "executor",
            tool_calls(("local__count", {"name": "apples"})),
            text("6 apples"),
            tool_calls(("local__count", {"name": "pears"})),
        )
        # a step's own bound (6 calls, 1 retry) would allow many more than 4 calls
        async with Rig.openai(fake, tools=tools, max_iterations=4, **ORCH) as rig:
            end = await rig.run("Count my fruit")
    assert (end.reason, end.iterations) == ("max_iterations", 4)
    assert end.content == "I stopped after 4 iterations without finishing the task."
    error = rig.one(Error)
    assert (error.code, error.fatal) == ("max_iterations", False)
    assert rig.types[-2:] == ["error", "loop_end"]
    assert "orchestrator_fallback" not in rig.types
    assert len(fake.requests) == 4 and tools.counted == {"apples": 1, "pears": 1}
    assert [e.max_iterations for e in rig.of(LoopIteration)] == [4, 4, 4, 4]
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.status == "idle" and not snapshot.pending
    assert snapshot.last_end is not None and snapshot.last_end.reason == "max_iterations"


async def test_a_turn_s_max_iterations_bounds_the_orchestrator_too() -> None:
    async with FakeLLM() as fake:
        fake.script_for("planner", text(plan("say hi")))
        async with Rig.openai(fake, **ORCH) as rig:
            end = await rig.run("greet me", max_iterations=1)
    assert (end.reason, end.iterations) == ("max_iterations", 1)
    assert len(fake.requests) == 1  # the plan; no executor was asked
    assert rig.of(PlanUpdate)[-1].plan[0].status == "in_progress"
