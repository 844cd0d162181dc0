"""Streamed text that a retry or a nudge discards is taken back with a ``retract`` event,
and the CLI's printer says so instead of leaving it to read as the answer."""

from __future__ import annotations

import io

from loopmesh.commands.printer import Printer
from loopmesh.testing.fake_llm import FakeLLM, cut, text, tool_calls
from schemas import encode
from schemas.events import ContentDelta, Event, Retract, decode_event
from tests.loop_worker.scripted import Rig


def visible(events: list[Event]) -> dict[int, str]:
    """What a reader that honours ``retract`` shows, per iteration."""
    shown: dict[int, str] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            shown[event.iteration] = shown.get(event.iteration, "") + event.text
        elif isinstance(event, Retract):
            shown[event.iteration] = ""
    return shown


async def test_text_of_a_cut_stream_is_retracted_before_the_retry(fake_llm: FakeLLM) -> None:
    partial = "partial text that never ends"
    fake_llm.script(cut(partial, after_chunks=2), tool_calls(("task_completion", {"result": "ok"})))
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    streamed = "".join(e.text for e in rig.of(ContentDelta))
    assert streamed and partial.startswith(streamed)
    retract = rig.one(Retract)
    assert (retract.reason, retract.chars, retract.iteration) == ("retry", len(streamed), 1)
    assert rig.types.index("retract") < rig.types.index("retry")
    assert visible(rig.events.events) == {1: ""}


async def test_a_reply_that_gets_a_nudge_is_retracted(fake_llm: FakeLLM) -> None:
    fake_llm.script(
        text("I would call a tool here."),
        text("The answer is 42.", chunk_size=4),
    )
    async with Rig.openai(fake_llm, max_no_tool_reminders=1) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("converse", "The answer is 42.")
    retract = rig.one(Retract)
    assert (retract.reason, retract.iteration) == ("nudge", 1)
    assert retract.chars == len("I would call a tool here.")
    # the second text reply was not nudged (reminders spent): it stays
    assert visible(rig.events.events) == {1: "", 2: "The answer is 42."}


async def test_the_cli_printer_marks_retracted_text_as_not_the_answer(fake_llm: FakeLLM) -> None:
    fake_llm.script(
        text("abandoned words"), tool_calls(("task_completion", {"result": "final words"}))
    )
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    out = io.StringIO()
    printer = Printer(out, deltas=True)
    for event in rig.events.events:
        printer.show(decode_event(encode(event)))
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if "abandoned words" in line)
    mark = next(i for i, line in enumerate(lines) if "taken back (nudge)" in line)
    assert at < mark < len(lines) - 1 and "not the answer" in lines[mark]
    assert any("final words" in line for line in lines[mark:])
    assert "abandoned" not in "".join(lines[mark:])
