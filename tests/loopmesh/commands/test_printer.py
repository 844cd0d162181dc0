"""How ``loopmesh run`` and ``loopmesh events`` print a turn's events."""

from __future__ import annotations

import io

from loopmesh.commands.printer import NO_TOOL_RAN, Printer
from schemas.events import (
    ApprovalRequired,
    ContentDelta,
    Event,
    LLMResponse,
    LoopEnd,
    LoopIteration,
    Message,
    Question,
    ToolCallEvent,
    ToolResultEvent,
)

IDS = {"tenant": "t", "session": "s1", "turn_id": "u1"}


def printed(*events: Event, deltas: bool = False) -> str:
    out = io.StringIO()
    printer = Printer(out, deltas=deltas)
    for event in events:
        printer.show(event)
    return out.getvalue()


def test_the_final_answer_is_printed_once_in_full():
    answer = "The answer is 391.\nIt is 17 times 23."
    out = printed(
        LoopIteration(**IDS, iteration=1, max_iterations=5),
        ToolCallEvent(
            **IDS, call_id="c1", server="loop", tool="task_completion", arguments={"result": answer}
        ),
        Message(**IDS, content=answer),
        ToolResultEvent(
            **IDS, call_id="c1", server="loop", tool="task_completion", content="delivered"
        ),
        LoopEnd(**IDS, reason="task_completion", content=answer, iterations=1),
    )
    assert out.count("The answer is 391.") == 1
    assert out.count("It is 17 times 23.") == 1
    assert out.endswith("✔ task_completion after 1 iteration(s)\n")
    assert "delivered" not in out  # the loop's own tools say nothing of their own


def test_a_streamed_answer_is_not_printed_again():
    out = printed(
        LoopIteration(**IDS, iteration=1, max_iterations=5),
        *(ContentDelta(**IDS, text=t) for t in ("Hel", "lo there", ".")),
        LLMResponse(**IDS, content="Hello there."),
        Message(**IDS, content="Hello there."),
        LoopEnd(**IDS, reason="converse", content="Hello there.", iterations=1),
        deltas=True,
    )
    assert out.count("Hello there.") == 1
    # no tool ran: the CLI says so rather than mark it done
    assert out.endswith(f"Hello there.\n⚠ converse after 1 iteration(s) ({NO_TOOL_RAN})\n")


def test_a_question_is_printed_once_and_an_unshown_ending_is_printed_whole():
    out = printed(
        Question(**IDS, text="Which file?"),
        LoopEnd(**IDS, reason="ask_question", content="Which file?", iterations=1),
    )
    assert out.count("Which file?") == 1
    out = printed(LoopEnd(**IDS, reason="max_iterations", content="gave up", iterations=5))
    assert out == "✘ max_iterations after 5 iteration(s)\ngave up\n"


def test_an_approval_says_how_to_give_it():
    out = printed(ApprovalRequired(**IDS, call_id="c-1", server="fs", tool="fs_write"))
    assert "loopmesh approve --session s1 c-1" in out
