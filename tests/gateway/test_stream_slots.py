"""Every long-lived call of a key holds one of its ``[gateway] max_streams_per_key`` slots
until it ends: an SSE event stream, an A2A stream, a blocking A2A ``SendMessage`` and an
MCP ``tools/call``. Past the cap each is refused in its protocol's shape: HTTP 429 for
the event stream and A2A, a JSON-RPC error for MCP (the SDKs' own clients here). No loop
worker runs: a call's turn waits in the turns stream until the test publishes its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import httpx
import pytest
from a2a.client.errors import A2AClientError
from a2a.types import TaskState
from mcp.shared.exceptions import MCPError
from nats.aio.client import Client

from gateway.server import GatewayServer
from loopmesh.testing.durable import SUBJECTS, wait_for
from schemas import Turn, decode, encode
from schemas.events import LoopEnd
from tests.gateway.a2a_client import a2a_client, follow, message
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, GatewayFactory, auth
from tests.gateway.test_mcp import connected

SETTING = "max_streams_per_key"
T = TypeVar("T")


async def published_turn(nc: Client) -> Turn:
    """The one turn of the turns stream, once it is there."""
    js = nc.jetstream()

    async def there() -> bool:
        return (await js.stream_info(SUBJECTS.turns_stream)).state.messages == 1

    await wait_for(there, timeout=20, what="the call's turn published")
    info = await js.stream_info(SUBJECTS.turns_stream)
    return decode((await js.get_msg(SUBJECTS.turns_stream, info.state.first_seq)).data, Turn)


async def end(nc: Client, turn: Turn) -> None:
    """The turn's ``loop_end``, as its loop worker would publish it."""
    done = LoopEnd(
        tenant=turn.tenant, session=turn.session, turn_id=turn.id,
        reason="task_completion", content="done", iterations=1,
    )  # fmt: skip
    subject = SUBJECTS.event(turn.tenant, turn.session, "loop_end")
    await nc.jetstream().publish(subject, encode(done))


async def event_stream_refused(gw: GatewayServer) -> None:
    async with (
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as http,
        http.stream("GET", "/v1/sessions/s1/events") as r,
    ):
        assert r.status_code == 429, "the key's one slot is free"
        error = (await r.aread()).decode()
        assert SETTING in error and "close one first" in error, error


async def mcp_call_refused(gw: GatewayServer) -> None:
    async with connected(gw) as mcp:
        with pytest.raises(MCPError, match=SETTING) as refused:
            await mcp.call_tool("default", {"input": "again"})
    assert refused.value.error.data == {"code": "rate_limited", "retry_after": 1}


async def a2a_send_refused(gw: GatewayServer) -> None:
    for streaming in (False, True):
        async with a2a_client(gw.url, ACME_KEY, streaming=streaming) as client:
            with pytest.raises(A2AClientError, match="429"):
                await follow(client.send_message(message("again")))


async def slot_free(gw: GatewayServer) -> None:
    """Once the call has ended, the key's slot is back: an event stream opens."""
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as http:
        deadline = time.monotonic() + 10
        while True:  # the slot is given back once the server has sent the call's answer
            async with http.stream("GET", "/v1/sessions/s1/events") as r:
                if r.status_code == 200:
                    return
            assert time.monotonic() < deadline, "the slot was never given back"
            await asyncio.sleep(0.05)


async def other_key_not_counted(gw: GatewayServer) -> None:
    async with (
        httpx.AsyncClient(base_url=gw.url, headers=auth(GLOBEX_KEY)) as http,
        http.stream("GET", "/v1/sessions/s1/events") as r,
    ):
        assert r.status_code == 200


async def sessions(gw: GatewayServer) -> None:
    for key in (ACME_KEY, GLOBEX_KEY):
        async with httpx.AsyncClient(base_url=gw.url, headers=auth(key)) as http:
            assert (await http.post("/v1/sessions", json={"session": "s1"})).status_code == 201


async def held(gw: GatewayServer, nc: Client, call: Awaitable[T]) -> T:
    """Run ``call`` (the key's one slot), check that each other long-lived call of the
    key is refused while it waits for its turn, then end the turn; the call's answer,
    once the slot is back."""
    waiting = asyncio.ensure_future(call)
    turn = await published_turn(nc)
    await event_stream_refused(gw)
    await mcp_call_refused(gw)
    await a2a_send_refused(gw)
    await other_key_not_counted(gw)
    await end(nc, turn)
    answer = await waiting
    await slot_free(gw)
    return answer


async def test_an_mcp_tool_call_holds_a_slot_until_its_turn_ends(
    gateway_at: GatewayFactory, nc: Client
):
    async with gateway_at(max_streams_per_key=1) as gw:
        await sessions(gw)
        async with connected(gw) as mcp:
            result = await held(gw, nc, mcp.call_tool("default", {"input": "hi"}))
        assert not result.is_error and result.structured_content is not None
        assert result.structured_content["answer"] == "done"


@pytest.mark.parametrize("streaming", [False, True])
async def test_an_a2a_send_holds_a_slot_until_its_turn_ends(
    gateway_at: GatewayFactory, nc: Client, streaming: bool
):
    async with gateway_at(max_streams_per_key=1) as gw:
        await sessions(gw)
        async with a2a_client(gw.url, ACME_KEY, streaming=streaming) as client:
            got = await held(gw, nc, follow(client.send_message(message("hi"))))
        assert got.state == TaskState.TASK_STATE_COMPLETED
