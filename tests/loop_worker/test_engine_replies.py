"""What the engine does with each kind of model reply, through the real openai client."""

from __future__ import annotations

import pytest

from loop_worker.engine.prompt import load_prompts
from loopmesh.testing.fake_llm import FakeLLM, cut, empty, error, text, tool_calls
from schemas import ChatMessage, SessionSnapshot
from schemas.events import (
    ContentDelta,
    ContextBudget,
    Error,
    LLMRequest,
    LLMResponse,
    MemoryPruned,
    Message,
    NoToolCall,
    Retry,
    ThinkingDelta,
    ThinkingEnd,
    ToolErrorEvent,
    ToolResultEvent,
)
from tests.loop_worker.scripted import Rig

NUDGES = load_prompts().nudges
ECHO_HI = '<tool>{"server_name": "local", "tool_name": "echo", "arguments": {"text": "hi"}}</tool>'
DONE_TEXT = (
    '<tool>{"server_name": "loop", "tool_name": "task_completion",'
    ' "arguments": {"result": "ok"}}</tool>'
)


def finish(result: str = "ok") -> object:
    return tool_calls(("task_completion", {"result": result}))


def last_user(request: dict) -> str:
    return [m for m in request["messages"] if m["role"] == "user"][-1]["content"]


async def test_thinking_sections_become_thinking_events_and_leave_the_content(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        text("<thinking>I should greet.</thinking>Hello there!", chunk_size=3), finish()
    )
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    first = rig.types.index("thinking_start")
    assert rig.types.index("thinking_end") > first
    assert "".join(e.text for e in rig.of(ThinkingDelta)) == "I should greet."
    assert rig.of(ThinkingEnd)[0].text == "I should greet."
    assert "".join(e.text for e in rig.of(ContentDelta)) == "Hello there!"
    assert rig.of(LLMResponse)[0].content == "Hello there!"
    assert fake_llm.requests[1]["messages"][-2] == {"role": "assistant", "content": "Hello there!"}


async def test_a_reply_without_a_tool_call_emits_no_tool_call_and_a_reminder(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(text("Paris is the capital."), finish("Paris"))
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert rig.one(NoToolCall).content == "Paris is the capital."
    assert last_user(fake_llm.requests[1]) == NUDGES.no_tool_call.strip()
    assert fake_llm.requests[1]["messages"][-1]["name"] == "loopmesh"
    assert end.reason == "task_completion"


async def test_when_reminders_are_spent_a_plain_reply_is_the_answer(fake_llm: FakeLLM) -> None:
    fake_llm.script(text("Hi!"), text("Hi again!"))
    async with Rig.openai(fake_llm, max_no_tool_reminders=1) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("converse", "Hi again!")
    assert rig.of(Message)[-1].content == "Hi again!"


async def test_an_incomplete_answer_gets_a_continuation_nudge(fake_llm: FakeLLM) -> None:
    fake_llm.script(text("I've done 3 of the files, 4 remaining."), finish())
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    assert last_user(fake_llm.requests[1]) == NUDGES.continuation.strip()


async def test_deflections_get_a_nudge_at_most_max_deflection_nudges_times(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(*[text("I can't do that.") for _ in range(4)])
    async with Rig.openai(fake_llm, max_deflection_nudges=2, max_no_tool_reminders=1) as rig:
        end = await rig.run()
    sent = [last_user(r) for r in fake_llm.requests[1:]]
    assert sent == [NUDGES.deflection.strip()] * 2 + [NUDGES.no_tool_call.strip()]
    assert (end.reason, end.content) == ("converse", "I can't do that.")


async def test_empty_responses_are_retried_then_a_summary_is_forced_without_tools(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(empty(), empty(), empty(), text("Here is what I found."))
    async with Rig.openai(fake_llm, empty_response_retries=2) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("forced_summary", "Here is what I found.")
    assert [e.what for e in rig.of(Retry)] == ["empty_response", "empty_response"]
    assert all("tools" in r for r in fake_llm.requests[:3])
    assert "tools" not in fake_llm.requests[3]
    assert last_user(fake_llm.requests[3]) == NUDGES.forced_summary.strip()
    assert rig.one(Message).content == "Here is what I found."


async def test_a_thinking_only_reply_counts_as_empty(fake_llm: FakeLLM) -> None:
    fake_llm.script(text("<thinking>hmm</thinking>"), finish())
    async with Rig.openai(fake_llm, empty_response_retries=1) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    assert [e.what for e in rig.of(Retry)] == ["empty_response"]


async def test_llm_errors_are_retried_with_a_retry_event_each(fake_llm: FakeLLM) -> None:
    fake_llm.script(error(429), error(503), finish())
    async with Rig.openai(fake_llm, llm={"max_retries": 2}) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    retries = rig.of(Retry)
    assert [(r.what, r.attempt) for r in retries] == [("llm", 1), ("llm", 2)]
    assert "429" in retries[0].reason


async def test_when_every_model_fails_the_turn_ends_with_the_static_fallback_message(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(error(500), error(500), error(500), error(500))
    async with Rig.openai(
        fake_llm, llm={"max_retries": 1, "fallback_models": ("backup",)}, fallback_message="Sorry."
    ) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("llm_failed", "Sorry.")
    assert [r["model"] for r in fake_llm.requests] == ["fake-model"] * 2 + ["backup"] * 2
    assert rig.one(Error).code == "llm_failed"
    assert rig.one(Message).content == "Sorry."


async def test_a_cut_stream_is_retried_and_its_partial_text_dropped(fake_llm: FakeLLM) -> None:
    fake_llm.script(cut("partial text that never ends", after_chunks=2), finish("whole"))
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("task_completion", "whole")
    assert len(rig.of(Retry)) == 1


async def test_a_cut_stream_on_every_attempt_ends_the_turn_cleanly(fake_llm: FakeLLM) -> None:
    fake_llm.script(cut("abc def ghi jkl", after_chunks=1), cut("abc def ghi jkl", after_chunks=1))
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert end.reason == "llm_failed"
    assert rig.types.count("loop_end") == 1


async def test_an_unknown_tool_goes_back_to_the_model_as_an_error_result(fake_llm: FakeLLM) -> None:
    fake_llm.script(tool_calls(("nope__missing", {"x": 1})), finish())
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    failed = rig.one(ToolErrorEvent)
    assert (failed.code, failed.tool) == ("unknown_tool", "nope__missing")
    sent = fake_llm.requests[1]["messages"][-1]
    assert sent["role"] == "tool" and sent["content"].startswith("Error (unknown_tool)")
    assert "local__echo" in sent["content"]  # the model is told what exists
    assert end.reason == "task_completion"


async def test_invalid_argument_json_goes_back_to_the_model_as_an_error_result(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(tool_calls(("local__echo", '{"text": "unterminated')), finish())
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    assert rig.one(ToolErrorEvent).code == "invalid_arguments"
    assert fake_llm.requests[1]["messages"][-1]["content"].startswith("Error (invalid_arguments)")
    assert fake_llm.requests[1]["messages"][-2]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert rig.tools.runs == []


async def test_the_circuit_breaker_stops_the_turn_when_the_same_tool_error_repeats(
    fake_llm: FakeLLM,
) -> None:
    def fail(path: str) -> str:
        raise FileNotFoundError(path)

    fake_llm.script(*[tool_calls(("local__fail", {"path": "a.txt"})) for _ in range(3)])
    async with Rig.openai(fake_llm, circuit_breaker_threshold=3) as rig:
        rig.tools.add(fail)
        end = await rig.run()
    assert (end.reason, end.iterations) == ("circuit_open", 3)
    assert rig.of(Error)[-1].code == "circuit_open"
    assert "FileNotFoundError: a.txt" in end.content


async def test_a_success_in_between_resets_the_circuit_breaker(fake_llm: FakeLLM) -> None:
    calls = iter([False, True, False, False])

    def flaky() -> str:
        if next(calls):
            return "fine"
        raise OSError("down")

    fake_llm.script(*[tool_calls(("local__flaky", {})) for _ in range(4)], finish())
    async with Rig.openai(fake_llm, circuit_breaker_threshold=3) as rig:
        rig.tools.add(flaky)
        end = await rig.run()
    assert end.reason == "task_completion"


async def test_tool_results_are_truncated_and_marked_before_they_enter_the_history(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(tool_calls(("local__echo", {"text": "x" * 5000})), finish())
    async with Rig.openai(fake_llm, tool_result_max_chars=1000) as rig:
        await rig.run()
    [result] = [e for e in rig.of(ToolResultEvent) if e.tool == "echo"]
    assert result.truncated is True
    sent = fake_llm.requests[1]["messages"][-1]["content"]
    assert sent.startswith("x" * 1000) and "truncated" in sent and len(sent) < 1200


async def test_a_one_megabyte_reply_does_not_crash_the_loop(fake_llm: FakeLLM) -> None:
    fake_llm.script(text("y" * 1_000_000, chunk_size=65536), finish())
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    assert "".join(e.text for e in rig.of(ContentDelta)) == "y" * 1_000_000
    assert max(len(e.text) for e in rig.of(ContentDelta)) <= 16384
    assert len(rig.one(NoToolCall).content) <= rig.settings.message_max_chars


async def test_a_context_budget_event_precedes_each_llm_request(fake_llm: FakeLLM) -> None:
    fake_llm.script(tool_calls(("local__echo", {"text": "x"})), finish())
    async with Rig.openai(fake_llm) as rig:
        await rig.run()
    budgets = rig.of(ContextBudget)
    assert len(budgets) == 2
    assert all(b.budget == 16_000 and 0 < b.tokens < b.budget for b in budgets)
    order = [t for t in rig.types if t in ("context_budget", "llm_request")]
    assert order == ["context_budget", "llm_request"] * 2


async def test_over_budget_history_is_pruned_and_summarised_into_the_system_prompt(
    fake_llm: FakeLLM,
) -> None:
    big = "word " * 300  # ~300 tokens a message
    earlier = []
    for i in range(8):  # earlier turns of the session
        earlier += [
            ChatMessage(role="user", content=f"question {i}: {big}"),
            ChatMessage(role="assistant", content=f"answer {i}: {big}"),
        ]
    fake_llm.script(finish())
    async with Rig.openai(fake_llm, context_budget_tokens=2500, summarize_with_llm=False) as rig:
        await rig.store.save(SessionSnapshot(tenant="acme", session="s1", messages=tuple(earlier)))
        end = await rig.run("the new question")
    assert end.reason == "task_completion"
    pruned = rig.one(MemoryPruned)
    assert pruned.removed > 0 and pruned.tokens_after <= 2500 < pruned.tokens_before
    assert rig.types.index("memory_pruned") < rig.types.index("llm_request")
    sent = fake_llm.requests[0]["messages"]
    assert "(summary)" in sent[0]["content"] and pruned.summary in sent[0]["content"]
    assert "question 0" not in str(sent[1:])  # the oldest went first
    assert "question 7" in str(sent[1:]) or "question 7" in pruned.summary
    assert sent[-1]["content"].endswith("the new question")
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.summary == pruned.summary


async def test_the_summary_of_evicted_messages_is_written_by_the_llm_when_enabled(
    fake_llm: FakeLLM,
) -> None:
    earlier = [ChatMessage(role="user", content=f"old {i} " + "word " * 300) for i in range(8)]
    fake_llm.script(text("SUMMARY: the user asked old things."), finish())
    async with Rig.openai(fake_llm, context_budget_tokens=2500) as rig:
        await rig.store.save(SessionSnapshot(tenant="acme", session="s1", messages=tuple(earlier)))
        await rig.run("new")
    assert rig.one(MemoryPruned).summary == "SUMMARY: the user asked old things."
    assert "SUMMARY: the user asked old things." in fake_llm.requests[1]["messages"][0]["content"]


async def test_a_long_turn_prunes_its_own_earlier_iterations_instead_of_running_out(
    fake_llm: FakeLLM,
) -> None:
    def page(n: int) -> str:
        return f"page {n}: " + "word " * 400  # ~400 tokens a result

    fake_llm.script(*[tool_calls(("local__page", {"n": n})) for n in range(1, 9)], finish())
    async with Rig.openai(
        fake_llm, context_budget_tokens=2500, summarize_with_llm=False, max_iterations=20
    ) as rig:
        rig.tools.add(page)
        end = await rig.run("read pages 1 to 8")
    assert (end.reason, end.iterations) == ("task_completion", 9)
    assert not [e for e in rig.of(Error) if e.code == "budget_exceeded"]
    pruned = rig.of(MemoryPruned)
    assert len(pruned) >= 2 and all(p.tokens_after <= 2500 < p.tokens_before for p in pruned)
    assert all(b.tokens <= 2500 for b in rig.of(LLMRequest))
    for request in fake_llm.requests:  # the turn's input and the newest result always stay
        messages = request["messages"]
        assert last_user(request).endswith("read pages 1 to 8")
        called = [c["id"] for m in messages for c in m.get("tool_calls", ())]
        assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == called
    last = fake_llm.requests[-1]["messages"]
    assert last[-1]["content"].startswith("page 8:") and "page 1:" not in str(last[1:])
    assert "local__page" in pruned[-1].summary and pruned[-1].summary in last[0]["content"]
    snapshot = rig.store.get("acme", "s1")
    assert snapshot is not None and snapshot.summary == pruned[-1].summary


async def test_pruning_leaves_headroom_so_the_next_iterations_need_not_prune_again(
    fake_llm: FakeLLM,
) -> None:
    def page(n: int) -> str:
        return f"page {n}: " + "word " * 400

    prunes = {}
    for ratio in (1.0, 0.5):
        fake_llm.script(*[tool_calls(("local__page", {"n": n})) for n in range(1, 9)], finish())
        async with Rig.openai(
            fake_llm,
            context_budget_tokens=2500,
            summarize_with_llm=False,
            max_iterations=20,
            prune_target_ratio=ratio,
        ) as rig:
            rig.tools.add(page)
            end = await rig.run("read pages 1 to 8")
        assert end.reason == "task_completion"
        prunes[ratio] = len(rig.of(MemoryPruned))
    assert 0 < prunes[0.5] < prunes[1.0]


async def test_a_prompt_that_cannot_fit_the_budget_ends_with_budget_exceeded(
    fake_llm: FakeLLM,
) -> None:
    async with Rig.openai(fake_llm, context_budget_tokens=256) as rig:
        end = await rig.run("word " * 1000)
    assert end.reason == "budget_exceeded"
    assert rig.of(Error)[-1].code == "budget_exceeded"
    assert fake_llm.requests == []


# -- the text tool format --------------------------------------------------------------


async def test_text_format_describes_tools_in_the_prompt_and_runs_tool_blocks(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        text(f"Let me echo. {ECHO_HI}"),
        text(DONE_TEXT.replace('"ok"', '"said hi"')),
    )
    async with Rig.openai(fake_llm, tool_format="text") as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("task_completion", "said hi")
    first = fake_llm.requests[0]
    assert "tools" not in first
    assert 'server_name: "local", tool_name: "echo"' in first["messages"][0]["content"]  # system
    result = fake_llm.requests[1]["messages"][-1]
    assert result["role"] == "user" and result["name"] == "loopmesh"
    assert 'tool_name="echo" status="ok">\nhi\n</tool_result>' in result["content"]


@pytest.mark.parametrize(
    ("block", "says"),
    [
        (
            '<tool>{"server_name": "local", "tool_name": "echo", "arguments": {"text": </tool>',
            "not valid JSON",
        ),
        ('<tool>{"server_name": "local", "arguments": {}}</tool>', "'tool_name'"),
        (
            '<tool>{"server_name": "local", "tool_name": "echo", "arguments": [1]}</tool>',
            "'arguments'",
        ),
        ('<tool>{"server_name": "local", "tool_name": "echo"', "no closing </tool>"),
        ('<tool>{"server_name": "x", "tool_name": "nothing"}</tool>', "no tool 'nothing'"),
    ],
)
async def test_text_format_errors_go_back_to_the_model_naming_what_was_wrong(
    fake_llm: FakeLLM, block: str, says: str
) -> None:
    fake_llm.script(
        text(block),
        text(DONE_TEXT),
    )
    async with Rig.openai(fake_llm, tool_format="text") as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    assert rig.one(ToolErrorEvent).code in ("invalid_arguments", "unknown_tool")
    sent = fake_llm.requests[1]["messages"][-1]
    assert sent["name"] == "loopmesh" and 'status="error"' in sent["content"]
    assert says in sent["content"]
