"""Prompt assembly: the documented order, static sections from prompts.toml, warnings."""

from __future__ import annotations

from loop_worker.engine.prompt import (
    assemble,
    iteration_warning,
    load_prompts,
    loop_message,
    system_message,
)
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import ChatMessage
from schemas.events import PlanUpdate
from tests.loop_worker.scripted import Rig

PROMPTS = load_prompts()


def finish() -> object:
    return tool_calls(("task_completion", {"result": "ok"}))


def positions(text: str, *parts: str) -> list[int]:
    found = [text.find(p) for p in parts]
    assert -1 not in found, f"missing {[p for p, i in zip(parts, found, strict=True) if i < 0]}"
    return found


async def test_the_prompt_is_assembled_in_the_documented_order(fake_llm: FakeLLM) -> None:
    fake_llm.script(finish())
    async with Rig.openai(fake_llm, instructions="You are Ada, a careful assistant.") as rig:
        await rig.run(
            "Summarise the report.",
            instructions="Answer in French.",
            metadata={"context": "The report is about llamas."},
        )
    system, user = fake_llm.requests[0]["messages"]
    assert system["role"] == "system"
    s = system["content"]
    order = positions(
        s,
        "You are Ada",
        "Answer in French.",
        PROMPTS.system.agent_loop.strip(),
        PROMPTS.system.capabilities.strip(),
        PROMPTS.system.chain_of_thought.strip(),
        PROMPTS.turn.tools_heading,  # the tools are stable content: first, in the system
        "`local__echo` (local.echo): Echo the text back.",
        "### Calling tools",
    )
    assert order == sorted(order)
    u = user["content"]
    assert PROMPTS.turn.tools_heading not in u
    order = positions(
        u,
        PROMPTS.turn.plan_heading,
        PROMPTS.turn.context_heading,
        "The report is about llamas.",
        PROMPTS.turn.input_heading,
        "Summarise the report.",
    )
    assert order == sorted(order)
    assert u.endswith("Summarise the report.")


async def test_native_calling_sends_every_tool_schema_including_the_built_in_ones(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(finish())
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    functions = {t["function"]["name"]: t["function"] for t in fake_llm.requests[0]["tools"]}
    assert set(functions) == {
        "task_completion",
        "ask_question",
        "converse",
        "update_plan",
        "local__echo",
    }
    assert functions["local__echo"]["parameters"] == {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }


async def test_update_plan_sets_the_plan_and_it_appears_in_the_next_prompt(
    fake_llm: FakeLLM,
) -> None:
    steps = [{"title": "Read the file", "status": "done"}, {"title": "Write a summary"}]
    fake_llm.script(tool_calls(("update_plan", {"steps": steps})), finish())
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    plan = rig.one(PlanUpdate).plan
    assert [(p.title, p.status) for p in plan] == [
        ("Read the file", "done"),
        ("Write a summary", "pending"),
    ]
    current = next(m for m in fake_llm.requests[1]["messages"] if m["role"] == "user")["content"]
    assert "1. [done] Read the file\n2. [pending] Write a summary" in current
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.plan == plan


async def test_an_invalid_plan_goes_back_to_the_model_as_an_error(fake_llm: FakeLLM) -> None:
    fake_llm.script(tool_calls(("update_plan", {"steps": [{"status": "done"}]})), finish())
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    assert rig.of(PlanUpdate) == []
    assert fake_llm.requests[1]["messages"][-1]["content"].startswith("Error (invalid_arguments)")


async def test_iteration_warnings_appear_as_the_limit_nears(fake_llm: FakeLLM) -> None:
    fake_llm.script(*[tool_calls(("local__echo", {"text": "x"})) for _ in range(3)])
    async with Rig.openai(fake_llm, max_iterations=3, iteration_warning_at=1) as rig:
        await rig.run()
    last = [r["messages"][-1] for r in fake_llm.requests]
    assert last[0]["content"].endswith("do the task")  # iteration 1 of 3: no warning
    assert last[1]["content"] == PROMPTS.nudges.iteration_warning.strip().format(remaining=1)
    assert last[2]["content"] == PROMPTS.nudges.final_iteration.strip()


def test_warnings_start_when_remaining_iterations_reach_the_threshold() -> None:
    said = [iteration_warning(PROMPTS, iteration=i, limit=5, warn_at=2) for i in range(1, 6)]
    assert [bool(s) for s in said] == [False, False, True, True, True]
    assert said[-1] == PROMPTS.nudges.final_iteration.strip()


def test_the_current_turn_message_takes_the_place_of_the_stored_user_input() -> None:
    system = system_message(PROMPTS, instructions=[], summary="")
    old = ChatMessage(role="user", content="hi")
    nudge = loop_message("hi")  # same text, but the loop's own message
    history = [
        old,
        ChatMessage(role="assistant", content="a"),
        ChatMessage(role="user", content="hi"),
        nudge,
    ]
    current = ChatMessage(role="user", content="TOOLS... hi")
    out = assemble(system=system, history=history, current=current, user_input="hi")
    assert out == [system, old, history[1], current, nudge]


def test_the_current_turn_message_goes_first_when_pruning_evicted_the_input() -> None:
    system = system_message(PROMPTS, instructions=[], summary="earlier")
    tail = [ChatMessage(role="assistant", content="a")]
    current = ChatMessage(role="user", content="X")
    out = assemble(system=system, history=tail, current=current, user_input="gone", warning="w")
    assert out[:3] == [system, current, tail[0]]
    assert out[3] == loop_message("w")
    assert "earlier" in system.content
