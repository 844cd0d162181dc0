"""A turn's events as the protocol's response chunks: held until the loop keeps them,
the answer always last, and each end that is no answer the protocol's error."""

from __future__ import annotations

import time
from typing import Any

import pytest
from synadia_ai.agent_service import RequestRejectedError

from nats_agents.reply import Reply
from schemas import Turn
from schemas.events import (
    ContentDelta,
    Error,
    Event,
    LLMRequest,
    LoopEnd,
    LoopIteration,
    Message,
    Retract,
    ThinkingDelta,
    ToolCallEvent,
)

TURN = Turn(id="t1", tenant="acme", session="s1", input="hi", created_at=time.time())
IDS: dict[str, Any] = {"tenant": "acme", "session": "s1", "turn_id": "t1"}


def delta(text: str) -> ContentDelta:
    return ContentDelta(text=text, **IDS)


def call(tool: str = "count", server: str = "local") -> ToolCallEvent:
    return ToolCallEvent(call_id="c1", server=server, tool=tool, **IDS)


def end(reason: Any, content: str = "", error: str | None = None) -> LoopEnd:
    return LoopEnd(reason=reason, content=content, error=error, **IDS)


def sent(reply: Reply, *events: Event) -> list[str]:
    """The texts ``events`` put on the stream, the last one a ``loop_end``."""
    texts = [reply.take(e) for e in events]
    if isinstance(events[-1], LoopEnd):
        texts.append(reply.end(events[-1]))
    return [t for t in texts if t]


def test_text_before_a_tool_call_goes_out_at_the_call_and_the_answer_follows_it():
    texts = sent(
        Reply(TURN),
        LoopIteration(**IDS),
        delta("Let me "),
        delta("count."),
        call(),
        LoopIteration(iteration=2, **IDS),
        call("task_completion", "loop"),
        Message(content="There are 3.", **IDS),
        end("task_completion", "There are 3."),
    )
    assert texts == ["Let me count.", "\n\nThere are 3."]


def test_a_reply_the_loop_kept_without_a_tool_call_goes_out_at_the_next_model_call():
    step = LLMRequest(model="executor", **IDS)  # an orchestrator's next step
    assert sent(Reply(TURN), step, delta("Step 1 done."), step) == ["Step 1 done."]


def test_an_answer_the_model_streamed_is_sent_once():
    texts = sent(
        Reply(TURN),
        delta("It is "),
        delta("391."),
        Message(content="It is 391.", **IDS),
        end("converse", "It is 391."),
    )
    assert texts == ["It is 391."]


def test_text_the_loop_takes_back_never_goes_out():
    texts = sent(
        Reply(TURN),
        delta("I could do that."),
        Retract(reason="nudge", chars=16, **IDS),
        delta("Half a rep"),
        Retract(reason="retry", chars=10, **IDS),
        delta("It is 391."),
        call("task_completion", "loop"),
        end("task_completion", "391"),
    )
    assert texts == ["It is 391.", "\n\n391"]


def test_a_reply_cut_by_a_failed_model_call_is_not_sent_before_the_error():
    reply = Reply(TURN)
    failed = Error(code="llm_failed", message="down", fatal=True, **IDS)
    fallback = Message(content="Sorry, the model failed.", **IDS)
    assert sent(reply, delta("It is 3"), failed, fallback) == []
    with pytest.raises(RequestRejectedError, match="llm_failed: down"):
        reply.end(end("llm_failed", "Sorry, the model failed.", "down"))


def test_thinking_is_not_sent_and_an_answer_alone_has_no_blank_line():
    thought = ThinkingDelta(text="hmm", **IDS)
    assert sent(Reply(TURN), thought, call("task_completion", "loop"), end("task_completion", "42"))
    assert sent(Reply(TURN), thought, end("ask_question", "Which file?")) == ["Which file?"]
    assert sent(Reply(TURN), end("task_completion", "")) == []


@pytest.mark.parametrize(
    ("events", "code", "said"),
    [
        ([end("max_iterations", error="20 iterations")], 500, "ended with max_iterations"),
        ([end("llm_failed", "Sorry.", "model down")], 500, "llm_failed: model down"),
        ([end("deadline")], 500, "ended with deadline"),
        (
            [Error(code="unknown_agent", fatal=True, **IDS), end("error", error="no calc")],
            404,
            "ended with error (unknown_agent): no calc",
        ),
        ([Error(code="agent_mismatch", fatal=True, **IDS), end("error")], 409, "agent_mismatch"),
        ([Error(code="session_busy", fatal=True, **IDS), end("rejected")], 409, "rejected"),
        ([end("cancelled")], 409, "cancelled"),
        ([end("interrupted")], 409, "interrupted"),
        ([end("budget", error="tenant ceiling")], 429, "budget"),
        ([end("budget_exceeded", "Out of tokens.")], 429, "Out of tokens."),
    ],
)
def test_a_turn_that_did_not_answer_is_the_protocols_error(
    events: list[Event], code: int, said: str
):
    reply = Reply(TURN)
    with pytest.raises(RequestRejectedError) as raised:
        sent(reply, *events)
    assert raised.value.code == code
    description = raised.value.description
    assert description.startswith("turn t1 in session s1 ") and said in description
