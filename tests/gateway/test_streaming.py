"""A long streamed reply through the real ``openai`` client, a real loop worker and the
gateway's SSE: its tokens are stored coalesced (``[loop] stream_flush_ms``), not one
event each, and the text a reader joins is the model's, byte for byte; a reply cut
mid-stream is still taken back exactly by its ``retract``."""

from __future__ import annotations

import asyncio
import string
from collections.abc import AsyncIterator

import httpx
import pytest

from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings
from loopmesh.testing.durable import stream_events
from loopmesh.testing.fake_llm import cut, tool_calls
from loopmesh.testing.sse import Message, messages
from tests.loop_worker.durable import Mesh, mesh_on

CHUNKS = 500
TEXT = "".join(string.ascii_letters[i % 52] + f"{i:03d}" for i in range(CHUNKS))  # 4 a chunk


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    """A tool worker and a loop worker whose model may be asked again once."""
    async with mesh_on(nats_url, provisioned=True) as mesh:
        settings = LLMSettings(
            base_url=mesh.llm_url, api_key="test", model="fake-model", max_retries=1,
            backoff_initial_s=0.01,
        )  # fmt: skip
        async with OpenAILLM(settings) as llm:
            await mesh.tool_worker()
            await mesh.loop_worker(llm=llm)
            yield mesh


async def read_turn(client: httpx.AsyncClient, session: str, text: str) -> list[Message]:
    """Post a turn and read its events over SSE up to its ``loop_end``."""
    r = await client.post(f"/v1/sessions/{session}/turns", json={"input": text})
    assert r.status_code == 202, r.text
    got: list[Message] = []
    async with asyncio.timeout(60), client.stream("GET", r.json()["events_url"]) as s:
        async for m in messages(s):
            got.append(m)
            if m.event == "loop_end":
                return got
    raise AssertionError("the stream ended before loop_end")


def shown(events: list[Message]) -> str:
    """The text a reader that honours ``retract`` shows (of iteration 1)."""
    text = ""
    for m in events:
        if m.event == "content_delta":
            text += m.json()["text"]
        elif m.event == "retract":
            text = ""
    return text


async def test_a_reply_of_500_chunks_is_stored_as_a_few_deltas_that_join_to_it(
    mesh: Mesh, client: httpx.AsyncClient
) -> None:
    done = ("task_completion", {"result": "streamed"})
    mesh.fake.script(tool_calls(done, content=TEXT, chunk_size=4, delay_s=0.002))
    got = await read_turn(client, "s1", "stream a long answer")
    deltas = [m.json()["text"] for m in got if m.event == "content_delta"]
    assert "".join(deltas) == TEXT
    # at least a second of streaming, at most a delta each 50 ms (stream_flush_ms): about
    # 20 on a quiet machine. A busy one streams for longer, hence more deltas: each is
    # stamped when its first token came, after the one before went out, so n of them
    # span at least (n - 2) * 50 ms (one more for a token stamped just before that).
    stamps = [m.json()["ts"] for m in got if m.event == "content_delta"]
    assert 2 <= len(deltas) <= (stamps[-1] - stamps[0]) / 0.05 + 3, (len(deltas), stamps)
    assert len(deltas[0]) == 4  # the first token went out at once, alone
    types = [m.event for m in got]
    assert types.index("llm_request") < types.index("content_delta")
    last_delta = len(types) - 1 - types[::-1].index("content_delta")
    assert last_delta < types.index("llm_response") < types.index("tool_call")
    stored = [
        (e.type, getattr(e, "text", None)) for e, _ in await stream_events(mesh.nc, "acme", "s1")
    ]
    assert [(m.event, m.json().get("text")) for m in got] == stored


async def test_a_reply_cut_mid_stream_is_retracted_exactly_with_coalesced_deltas(
    mesh: Mesh, client: httpx.AsyncClient
) -> None:
    again = "the second attempt, whole"
    mesh.fake.script(
        cut(TEXT, after_chunks=250, chunk_size=4),
        tool_calls(("task_completion", {"result": "ok"}), content=again, chunk_size=3),
    )
    got = await read_turn(client, "s2", "stream, then fail")
    types = [m.event for m in got]
    retract = got[types.index("retract")].json()
    before = "".join(
        m.json()["text"] for m in got[: types.index("retract")] if m.event == "content_delta"
    )
    assert before and TEXT.startswith(before)
    assert retract["chars"] == len(before) and retract["reason"] == "retry"
    assert types.index("retract") < types.index("retry")
    assert shown(got) == again
