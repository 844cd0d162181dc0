"""What a turn's input may carry besides text (images and files, passed to the model),
and a ``before_llm`` hook that answers in the model's place."""

from __future__ import annotations

import pytest

from loop_worker.engine.hooks import Hooks
from loop_worker.engine.protocols import Completion
from loop_worker.engine.tokens import PART_TOKENS
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import ChatMessage, DecodeError, FilePart, ImagePart, ToolCall, Turn, decode
from schemas.events import ContextBudget, LLMRequest, LLMResponse
from schemas.wire import FileRef, ImageURL
from tests.loop_worker.scripted import Rig

PNG = "data:image/png;base64,iVBORw0KGgo="
PDF = "data:application/pdf;base64,JVBERi0xLjQK"


def finish() -> object:
    return tool_calls(("task_completion", {"result": "ok"}))


async def test_images_and_files_reach_the_model_as_content_parts(fake_llm: FakeLLM) -> None:
    fake_llm.script(finish(), finish())
    parts = (
        ImagePart(image_url=ImageURL(url=PNG, detail="low")),
        FilePart(file=FileRef(file_data=PDF, filename="report.pdf")),
    )
    async with Rig.openai(fake_llm) as rig:
        await rig.run("What is in these?", parts=parts)
        await rig.run("And the first one again?", id="t2")
    content = fake_llm.requests[0]["messages"][1]["content"]
    assert isinstance(content, list)
    assert content[0]["type"] == "text" and "What is in these?" in content[0]["text"]
    assert content[1:] == [
        {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
        {"type": "file", "file": {"file_data": PDF, "filename": "report.pdf"}},
    ]
    # the next turn's history keeps them with the message they came with
    earlier = [m for m in fake_llm.requests[1]["messages"] if isinstance(m["content"], list)]
    assert len(earlier) == 1 and earlier[0]["content"][0] == {
        "type": "text",
        "text": "What is in these?",
    }
    # each part is counted in the budget
    with_parts, without = rig.of(ContextBudget)[0], rig.of(ContextBudget)[1]
    assert with_parts.tokens > 2 * PART_TOKENS
    assert without.tokens > 2 * PART_TOKENS  # the history still holds them


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ('{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}', "matching regex"),
        ('{"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "max"}}', None),
        ('{"type": "file", "file": {"filename": "a.pdf"}}', "exactly one of"),
        ('{"type": "file", "file": {"file_id": "f1", "file_data": "' + PDF + '"}}', "exactly one"),
        ('{"type": "file", "file": {"file_data": "JVBERi0="}}', "matching regex"),
        ('{"type": "input_audio", "input_audio": {}}', "Invalid value 'input_audio'"),
    ],
)
def test_content_parts_are_validated(part: str, says: str | None) -> None:
    raw = f'{{"id": "t", "tenant": "a", "session": "s", "input": "hi", "parts": [{part}]}}'
    with pytest.raises(DecodeError, match=says or "Invalid enum value 'max'"):
        decode(raw.encode(), Turn)


def test_a_turn_carries_at_most_16_parts() -> None:
    part = '{"type": "file", "file": {"file_id": "f1"}}'
    raw = '{"id": "t", "tenant": "a", "session": "s", "input": "hi", "parts": [%s]}'
    assert len(decode((raw % ",".join([part] * 16)).encode(), Turn).parts) == 16
    with pytest.raises(DecodeError, match="length <= 16"):
        decode((raw % ",".join([part] * 17)).encode(), Turn)


class Cached:
    """Answers the first call from a cache, so the model is asked only after that."""

    def __init__(self) -> None:
        self.calls = 0

    def before_llm(self, messages: list[ChatMessage]) -> Completion | None:
        self.calls += 1
        if self.calls > 1:
            return None
        call = ToolCall(id="c1", name="local__echo", arguments='{"text": "from the cache"}')
        return Completion(content="Cached.", tool_calls=(call,), finish_reason="tool_calls")


async def test_a_before_llm_hook_can_answer_in_place_of_the_model(fake_llm: FakeLLM) -> None:
    fake_llm.script(finish())
    hook = Cached()
    async with Rig.openai(fake_llm, hooks=Hooks([hook])) as rig:
        end = await rig.run("echo something")
    assert end.reason == "task_completion"
    assert hook.calls == 2
    assert len(fake_llm.requests) == 1  # the model was asked once, not twice
    responses = rig.of(LLMResponse)
    assert [r.by_hook for r in responses] == [True, False]
    assert len(rig.of(LLMRequest)) == 1  # no request for the call that was not made
    assert rig.types.index("llm_response") < rig.types.index("llm_request")
    results = [e for e in rig.events.events if e.type == "tool_result"]
    assert results[0].content == "from the cache"
    assert "content_delta" in rig.types[: rig.types.index("llm_request")]  # its text streamed
