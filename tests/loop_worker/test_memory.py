"""Memory: pruning to a budget without splitting tool calls, summaries, truncation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from loop_worker.engine.memory import PruneResult, fallback_summary, prune, summarize, truncate
from loop_worker.engine.protocols import Completion
from loop_worker.engine.tokens import TokenCounter
from schemas import ChatMessage, ToolCall

COUNTER = TokenCounter()
WORDS = [
    "the",
    "agent",
    "reads",
    "files",
    "runs",
    "tools",
    "and",
    "answers",
    "questions",
    "about",
    "nats",
    "streams",
]


def _text(draw: st.DrawFn) -> str:
    n = draw(st.integers(0, 400))
    start = draw(st.integers(0, len(WORDS) - 1))
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


@st.composite
def conversations(draw: st.DrawFn) -> list[ChatMessage]:
    """System, user and assistant messages; tool calls each followed by their results."""
    messages: list[ChatMessage] = []
    calls = 0
    for _ in range(draw(st.integers(0, 14))):
        kind: Literal["system", "user", "assistant", "tools"] = draw(
            st.sampled_from(["system", "user", "user", "assistant", "tools", "tools"])
        )
        if kind != "tools":
            messages.append(ChatMessage(role=kind, content=_text(draw)))
            continue
        batch = []
        for _ in range(draw(st.integers(1, 3))):
            calls += 1
            batch.append(ToolCall(id=f"call_{calls}", name=f"tool{calls % 3}", arguments="{}"))
        messages.append(ChatMessage(role="assistant", content=_text(draw), tool_calls=tuple(batch)))
        for call in batch:
            messages.append(ChatMessage(role="tool", content=_text(draw), tool_call_id=call.id))
    return messages


def _caller(messages: Sequence[ChatMessage], call_id: str | None) -> ChatMessage | None:
    return next((m for m in messages if any(c.id == call_id for c in m.tool_calls)), None)


def _newest_unit(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The last non-system, non-tool message and the messages answering it."""
    starts = [i for i, m in enumerate(messages) if m.role not in ("system", "tool")]
    return [m for m in messages[starts[-1] :] if m.role != "system"] if starts else []


def _minimum(messages: list[ChatMessage]) -> list[ChatMessage]:
    """What prune may never evict: system messages, the last user message, the newest unit."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    newest = {id(m) for m in _newest_unit(messages)}
    return [
        m
        for i, m in enumerate(messages)
        if m.role == "system" or (users and i == users[-1]) or id(m) in newest
    ]


@settings(max_examples=150, deadline=None)
@given(conversations(), st.floats(0.0, 1.2))
async def test_prune_keeps_calls_with_results_and_fits_the_budget(
    messages: list[ChatMessage], fraction: float
) -> None:
    total = await COUNTER.count_all(messages)
    budget = int(total * fraction)
    result = await prune(messages, budget, COUNTER)

    index = {id(m): i for i, m in enumerate(messages)}
    kept = [index[id(m)] for m in result.kept]
    evicted = [index[id(m)] for m in result.evicted]
    assert kept == sorted(kept)
    assert sorted(kept + evicted) == list(range(len(messages)))
    for position, m in enumerate(result.kept):
        if m.role == "tool":
            caller = _caller(result.kept, m.tool_call_id)
            assert caller is not None
            assert result.kept.index(caller) < position
        for call in m.tool_calls:
            assert any(t.tool_call_id == call.id for t in result.kept[position + 1 :])
    minimum = _minimum(messages)
    for m in minimum:
        assert any(k is m for k in result.kept)
    for m in _newest_unit(messages):
        assert any(k is m for k in result.kept)
    evictable = [i for i in kept if not any(messages[i] is m for m in minimum)]
    assert all(e < k for e in evicted for k in evictable)  # oldest first
    assert result.tokens_before == total
    assert result.tokens_after == await COUNTER.count_all(result.kept)
    if not result.over_budget:
        assert result.tokens_after <= budget
    if await COUNTER.count_all(minimum) <= budget:
        assert not result.over_budget
    if result.evicted and not result.over_budget:  # stopped as soon as it fitted
        start = max(i for i, m in enumerate(result.evicted) if m.role != "tool")
        last_unit = result.evicted[start:]
        restored = result.tokens_after + sum([await COUNTER.count(m) for m in last_unit])
        assert restored > budget


async def test_prune_evicts_nothing_when_the_history_fits() -> None:
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hello"),
        ChatMessage(role="assistant", content="hi"),
    ]
    result = await prune(messages, 10_000, COUNTER)
    total = await COUNTER.count_all(messages)
    assert result == PruneResult(
        kept=tuple(messages), evicted=(), tokens_before=total, tokens_after=total, over_budget=False
    )


async def test_prune_evicts_a_tool_call_together_with_its_results() -> None:
    call = ToolCall(id="c1", name="read_file", arguments='{"path": "a.txt"}')
    old = [
        ChatMessage(role="user", content="read a.txt"),
        ChatMessage(role="assistant", tool_calls=(call,)),
        ChatMessage(role="tool", content="x " * 500, tool_call_id="c1"),
    ]
    recent = [ChatMessage(role="user", content="now summarise it")]
    budget = await COUNTER.count_all(recent) + 1
    result = await prune(old + recent, budget, COUNTER)
    assert result.evicted == tuple(old)
    assert result.kept == tuple(recent)
    assert not result.over_budget


async def test_prune_reports_over_budget_when_the_minimum_does_not_fit() -> None:
    messages = [
        ChatMessage(role="system", content="rules " * 50),
        ChatMessage(role="user", content="old question"),
        ChatMessage(role="user", content="the question " * 50),
    ]
    result = await prune(messages, 20, COUNTER)
    assert result.over_budget
    assert result.kept == (messages[0], messages[2])
    assert result.tokens_after > 20


def _iteration(n: int, size: int) -> list[ChatMessage]:
    call = ToolCall(id=f"t1-{n}-0", name="local__read", arguments=f'{{"page": {n}}}')
    return [
        ChatMessage(role="assistant", content=f"reading page {n}", tool_calls=(call,)),
        ChatMessage(role="tool", content=f"page {n}: " + "text " * size, tool_call_id=call.id),
    ]


async def test_prune_evicts_earlier_iterations_of_the_turn_in_progress() -> None:
    system = ChatMessage(role="system", content="be brief")
    user = ChatMessage(role="user", content="read the whole book")
    first, second, third = _iteration(1, 300), _iteration(2, 300), _iteration(3, 300)
    messages = [system, user, *first, *second, *third]
    budget = await COUNTER.count_all([system, user, *third]) + 10
    result = await prune(messages, budget, COUNTER)
    assert result.evicted == (*first, *second)
    assert result.kept == (system, user, *third)
    assert not result.over_budget


async def test_prune_keeps_as_many_newest_units_as_asked() -> None:
    user = ChatMessage(role="user", content="read the whole book")
    first, second, third = _iteration(1, 300), _iteration(2, 300), _iteration(3, 300)
    messages = [user, *first, *second, *third]
    result = await prune(messages, 10, COUNTER, keep_last_units=2)
    assert result.evicted == tuple(first)
    assert result.kept == (user, *second, *third)
    assert result.over_budget


class ScriptedLLM:
    def __init__(self, reply: str | Exception) -> None:
        self.reply = reply
        self.prompts: list[Sequence[ChatMessage]] = []

    async def complete(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Completion:
        self.prompts.append(messages)
        if isinstance(self.reply, Exception):
            raise self.reply
        return Completion(content=self.reply)


EVICTED = (
    ChatMessage(role="user", content="Find the failing test\nin loop_worker."),
    ChatMessage(
        role="assistant",
        content="Looking.",
        tool_calls=(ToolCall(id="c1", name="run_tests", arguments='{"path": "tests"}'),),
    ),
    ChatMessage(role="tool", content="1 failed: test_prune " + "log " * 300, tool_call_id="c1"),
)


async def test_summarize_uses_the_llm_reply_without_thinking() -> None:
    llm = ScriptedLLM("<thinking>hmm</thinking> The user wants the failing test found.")
    summary = await summarize(EVICTED, previous="Earlier: setup done.", llm=llm)
    assert summary == "The user wants the failing test found."
    prompt = llm.prompts[0][-1].content
    assert "Earlier: setup done." in prompt
    assert "tool run_tests returned: 1 failed: test_prune" in prompt


async def test_summarize_falls_back_when_the_llm_raises() -> None:
    llm = ScriptedLLM(RuntimeError("model unavailable"))
    summary = await summarize(EVICTED, previous="Earlier.", llm=llm, max_chars=500)
    assert llm.prompts
    assert summary == fallback_summary(EVICTED, previous="Earlier.", max_chars=500)


async def test_summarize_falls_back_when_the_llm_answers_nothing() -> None:
    summary = await summarize(EVICTED, llm=ScriptedLLM("  \n"))
    assert summary == fallback_summary(EVICTED)


def test_fallback_summary_has_a_line_per_message() -> None:
    summary = fallback_summary(EVICTED, previous="Earlier: setup done.")
    lines = summary.splitlines()
    assert lines[0] == "Earlier: setup done."
    assert lines[1] == "user: Find the failing test in loop_worker."
    assert lines[2] == "assistant: Looking."
    assert lines[3].startswith("assistant called tool run_tests(")
    assert lines[4].startswith("tool run_tests returned: 1 failed: test_prune")
    assert len(lines[4]) < 250


@given(st.integers(1, 400), st.text(max_size=300))
def test_fallback_summary_is_deterministic_and_bounded(max_chars: int, previous: str) -> None:
    summary = fallback_summary(EVICTED * 5, previous=previous, max_chars=max_chars)
    assert summary == fallback_summary(EVICTED * 5, previous=previous, max_chars=max_chars)
    assert 0 < len(summary) <= max_chars
    newest = fallback_summary(EVICTED, max_chars=10_000).splitlines()[-1]
    assert summary.endswith(newest) if len(newest) <= max_chars else summary == newest[:max_chars]


def test_truncate_leaves_short_text_alone() -> None:
    assert truncate("short", 10) == ("short", False)
    assert truncate("x" * 10, 10) == ("x" * 10, False)


def test_truncate_cuts_long_text_and_says_so() -> None:
    text = "y" * 123_456
    cut, was_cut = truncate(text, 6_000)
    assert was_cut
    marker = "\n[truncated: 123456 characters, showing the first 6000]"
    assert cut == "y" * 6_000 + marker
