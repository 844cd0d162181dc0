"""A reply that only repeats the loop's own reminder is never the answer, and a turn that
ended by ``converse`` with no tool run says so in the CLI."""

from __future__ import annotations

import io

from loop_worker.engine.nudges import echoes_loop
from loop_worker.engine.prompt import load_prompts
from loop_worker.engine.run import NOT_AN_ANSWER
from loopmesh.commands.printer import NO_TOOL_RAN, Printer
from loopmesh.testing.fake_llm import FakeLLM, text, tool_calls
from schemas.events import Error, Event, LoopEnd, Message, ToolCallEvent
from tests.loop_worker.scripted import Rig

REMINDER = " ".join(load_prompts().nudges.no_tool_call.split())
IDS = {"tenant": "t", "session": "s1", "turn_id": "u1"}


def test_the_loops_own_texts_are_recognised_and_answers_are_not():
    prompts = load_prompts()
    assert echoes_loop(REMINDER, prompts)
    assert echoes_loop("Sure. " + REMINDER[:120], prompts)  # a part of it, lightly wrapped
    assert not echoes_loop("17 * 23 is 391.", prompts)
    assert not echoes_loop("I called the calculator: the task is done, the result is 391.", prompts)
    assert not echoes_loop("", prompts)


async def test_a_text_reply_that_repeats_the_reminder_is_not_taken_as_the_answer(
    fake_llm: FakeLLM,
):
    fake_llm.script(text("I am not sure."), text(REMINDER))
    async with Rig.openai(fake_llm, max_no_tool_reminders=1) as rig:
        end = await rig.run("What is 17 * 23?")
    assert end.reason == "error"
    assert "repeated the loop's own reminder" in end.content
    assert rig.one(Error).code == "no_answer"
    assert not [m for m in rig.of(Message) if REMINDER in m.content]


async def test_a_loop_breaking_call_that_repeats_the_reminder_is_refused(fake_llm: FakeLLM):
    fake_llm.script(
        tool_calls(("converse", {"message": REMINDER})),
        tool_calls(("task_completion", {"result": "391"})),
    )
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run("What is 17 * 23?")
    assert (end.reason, end.content) == ("task_completion", "391")
    tool_messages = [m for m in fake_llm.requests[1]["messages"] if m["role"] == "tool"]
    assert NOT_AN_ANSWER in tool_messages[0]["content"]


def printed(*events: Event) -> str:
    out = io.StringIO()
    printer = Printer(out)
    for event in events:
        printer.show(event)
    return out.getvalue()


def test_the_cli_says_plainly_when_a_turn_ended_by_converse_with_no_tool_run():
    end = LoopEnd(**IDS, reason="converse", content="Hello!", iterations=1)
    out = printed(end)
    assert "✔" not in out and f"⚠ converse after 1 iteration(s) ({NO_TOOL_RAN})" in out
    call = ToolCallEvent(**IDS, call_id="c1", server="local", tool="calculator", arguments={})
    assert "✔ converse after 1 iteration(s)" in printed(call, end)
