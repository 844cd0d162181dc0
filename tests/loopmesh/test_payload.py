"""Cutting a message to fit in one NATS message: the longest texts go first, each with a
marker, and the result always fits."""

from __future__ import annotations

import json

import pytest

from loopmesh.payload import DoesNotFit, fit
from schemas import ChatMessage, SessionSnapshot, ToolCall, ToolResult, decode, encode
from schemas.events import LLMResponse


def test_a_message_that_fits_is_returned_unchanged() -> None:
    result = ToolResult(call_id="c1", content="short")
    fitted = fit(result, 10_000)
    assert fitted.value is result and fitted.cut == () and fitted.data == encode(result)


@pytest.mark.parametrize("char", ["a", "é", "漢", "🙂", '"', "\n"])
def test_the_longest_text_is_cut_to_fit_with_a_marker(char: str) -> None:
    result = ToolResult(call_id="c1", content=char * 100_000, server="local", tool="big")
    fitted = fit(result, 20_000)
    assert len(fitted.data) <= 20_000 and fitted.size == len(encode(result))
    assert fitted.cut == ("content",)
    value = decode(fitted.data, ToolResult)
    assert value == fitted.value and value.tool == "big"
    kept, _, marker = value.content.partition("\n[cut by loopmesh: ")
    assert set(kept) <= {char} and len(kept) > 1_000
    assert marker.startswith(f"{len(kept.encode())} of {len(char.encode()) * 100_000} bytes")


def test_texts_are_cut_longest_first_until_it_fits_and_only_under_the_keys_given() -> None:
    messages = tuple(
        ChatMessage(role="assistant", content=c * n) for c, n in (("a", 30_000), ("b", 20_000))
    )
    snapshot = SessionSnapshot(tenant="t", session="s", messages=messages, summary="z" * 9_000)
    fitted = fit(snapshot, 12_000, keys={"content", "summary"})
    assert len(fitted.data) <= 12_000
    assert fitted.cut == ("messages[0].content", "messages[1].content")
    assert fitted.value.summary == "z" * 9_000
    event = LLMResponse(tenant="t", session="s", turn_id="u", content="x" * 50_000)
    assert fit(event, 8_000).value.type == "llm_response"


def test_a_message_without_long_texts_to_cut_does_not_fit() -> None:
    result = ToolResult(call_id="c1", content="x" * 200)
    with pytest.raises(DoesNotFit):
        fit(result, 100)


def test_a_tool_calls_arguments_cut_to_fit_stay_json() -> None:
    arguments = json.dumps({"path": "notes.txt", "text": 'a "quoted" line\n' * 5_000})
    call = ToolCall(id="call_1", name="local__fs_write", arguments=arguments)
    snapshot = SessionSnapshot(
        tenant="t", session="s", messages=(ChatMessage(role="assistant", tool_calls=(call,)),)
    )
    fitted = fit(snapshot, 10_000, keys={"content", "arguments"}, json_keys={"arguments"})
    assert len(fitted.data) <= 10_000 and fitted.cut == ("messages[0].tool_calls[0].arguments",)
    [kept] = fitted.value.messages[0].tool_calls
    assert (kept.id, kept.name) == ("call_1", "local__fs_write")
    cut = json.loads(kept.arguments)
    assert arguments.startswith(cut["start"]) and len(cut["start"]) > 1_000
    assert cut["cut_by_loopmesh"].startswith(f"[cut by loopmesh: {len(cut['start'])} of ")
