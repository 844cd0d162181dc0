"""Retrieved context: the turn's own passages and a deployment's retriever, in the
prompt's retrieved-context section, bounded and counted."""

from __future__ import annotations

from typing import Any

import pytest

from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import DecodeError, Passage, Turn, decode
from schemas.events import ContextBudget, HookErrorEvent, LoopEnd
from tests.loop_worker.scripted import Rig

WORD = "llama "  # one token each


def finish() -> object:
    return tool_calls(("task_completion", {"result": "ok"}))


def search(turn: Turn) -> list[dict[str, Any]]:
    """A deployment's retriever (``[loop] retriever``): dicts, as JSON would give them."""
    return [
        {"text": f"Found for {turn.input!r}: alpacas hum.", "source": "kb://alpacas"},
        {"text": "Vicuñas are wild."},
    ]


def long_passages(turn: Turn) -> list[Passage]:
    return [
        Passage(text="FIRST " + WORD * 40, source="a"),
        Passage(text="SECOND " + WORD * 40, source="b"),
        Passage(text="THIRD " + WORD * 40, source="c"),
    ]


def broken(turn: Turn) -> object:
    raise RuntimeError("the search index is down")


def wrong_type(turn: Turn) -> object:
    return 42


def prompt_of(fake: FakeLLM, request: int = 0) -> str:
    messages = fake.requests[request]["messages"]
    current = [m for m in messages if m["role"] == "user" and "## The user's message" in str(m)]
    assert len(current) == 1
    return str(current[0]["content"])


async def test_the_turns_passages_are_in_the_retrieved_context_section(fake_llm: FakeLLM) -> None:
    fake_llm.script(finish())
    context = (
        Passage(text="The report is due on Friday.", source="mail://42"),
        Passage(text="Budget: 3 llamas."),
    )
    async with Rig.openai(fake_llm) as rig:
        end = await rig.run("When is the report due?", context=context)
    assert end.reason == "task_completion"
    prompt = prompt_of(fake_llm)
    heading = prompt.index("## Retrieved context")
    first = prompt.index("[mail://42]\nThe report is due on Friday.")
    second = prompt.index("Budget: 3 llamas.")
    assert heading < first < second < prompt.index("## The user's message")


@pytest.mark.parametrize(
    ("context", "says"),
    [
        ('[{"text": ""}]', "Expected `str` of length >= 1"),
        ('[{"source": "x"}]', "missing required field `text`"),
        ('[{"text": "x", "extra": 1}]', None),  # unknown fields are tolerated (evolution)
        ("[" + ",".join(['{"text": "x"}'] * 33) + "]", "length <= 32"),
        ('"just a string"', "Expected `array`"),
    ],
)
def test_a_turns_context_is_validated(context: str, says: str | None) -> None:
    raw = f'{{"id": "t", "tenant": "a", "session": "s", "input": "hi", "context": {context}}}'
    if says is None:
        assert decode(raw.encode(), Turn).context == (Passage(text="x"),)
        return
    with pytest.raises(DecodeError, match=says):
        decode(raw.encode(), Turn)


async def test_a_retriever_named_in_the_settings_adds_passages(fake_llm: FakeLLM) -> None:
    fake_llm.script(finish())
    own = (Passage(text="The client's own passage."),)
    retriever = "tests.loop_worker.test_context:search"
    async with Rig.openai(fake_llm, retriever=retriever) as rig:
        await rig.run("tell me about alpacas", context=own)
    prompt = prompt_of(fake_llm)
    found = prompt.index("[kb://alpacas]\nFound for 'tell me about alpacas': alpacas hum.")
    assert prompt.index("The client's own passage.") < found < prompt.index("Vicuñas are wild.")


async def test_retrieved_passages_are_cut_to_their_token_bound_and_counted(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(finish(), finish())
    retriever = "tests.loop_worker.test_context:long_passages"
    async with Rig.openai(fake_llm) as plain:
        await plain.run("hi")
    async with Rig.openai(fake_llm, retriever=retriever, retrieved_max_tokens=70) as rig:
        await rig.run("hi")
    prompt = prompt_of(fake_llm, 1)
    assert "[a]\nFIRST " + WORD.strip() in prompt
    assert "[b]\nSECOND" in prompt and prompt.rstrip().count("…") == 1  # cut short
    assert "THIRD" not in prompt
    second = prompt[prompt.index("SECOND") : prompt.index("…")]
    assert second.count("llama") < 40
    added = rig.one(ContextBudget).tokens - plain.one(ContextBudget).tokens
    assert 50 <= added <= 70 + 10  # the bound, plus the heading and the separators


@pytest.mark.parametrize(
    ("retriever", "says"),
    [
        ("broken", "RuntimeError: the search index is down"),
        ("wrong_type", "a retriever returned int"),
    ],
)
async def test_a_failing_retriever_is_reported_and_the_turn_goes_on(
    fake_llm: FakeLLM, retriever: str, says: str
) -> None:
    fake_llm.script(finish())
    path = f"tests.loop_worker.test_context:{retriever}"
    async with Rig.openai(fake_llm, retriever=path) as rig:
        end = await rig.run("hi")
    assert end.reason == "task_completion"
    error = rig.one(HookErrorEvent)
    assert error.hook == "retrieve" and says in error.message and not error.fatal
    assert rig.types.index("hook_error") < rig.types.index("llm_request")
    assert isinstance(rig.of(LoopEnd)[0], LoopEnd)
