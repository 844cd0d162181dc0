"""The gateway on a server whose events are split over three streams (``[nats]
partitions = 3``): each session's events are read from its own partition's stream
(SSE history, live events, resume, trimmed history, A2A tasks), the tenant's latest
events are merged across the partitions, readiness wants every events stream, and a
gateway configured with another count refuses to start.

The sessions are chosen to land in different partitions, and the events are published
so that the partitions' sequences overlap: an event read from the wrong stream shows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
from a2a.types import GetTaskRequest, TaskState
from nats.aio.client import Client
from nats.aio.msg import Msg

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.errors import ProvisionError
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import connect_fast, provision_short
from loopmesh.testing.sse import messages
from schemas import Subjects, Turn, decode, encode
from schemas.events import ContentDelta, Event, LoopEnd, LoopStart
from schemas.events import Message as AnswerMessage
from tests.gateway.a2a_client import a2a_client, answer, follow, message
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, KEYS, auth

PARTS = Subjects(partitions=3)


def sessions_apart(tenant: str) -> tuple[str, str, str]:
    """Three session names of ``tenant``, one in each partition, partition 0's last
    (so the first two are never in the stream an unpartitioned reader would look at)."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < 3:
        found.setdefault(PARTS.partition(tenant, f"s{n}"), f"s{n}")
        n += 1
    return found[1], found[2], found[0]


A, B, C = sessions_apart("acme")


def test_the_sessions_used_here_land_in_different_partitions():
    assert [PARTS.partition("acme", s) for s in (A, B, C)] == [1, 2, 0]
    assert PARTS.events_stream_of("acme", A) == "LOOPMESH_EVENTS_1"


@pytest.fixture
async def url3(nats_server: Any) -> AsyncIterator[str]:
    """A nats-server provisioned with three events partitions."""
    nc = await connect_fast(nats_server.url)
    try:
        await provision_short(nc, subjects=PARTS)
    finally:
        await nc.close()
    yield nats_server.url


@pytest.fixture
async def nc3(url3: str) -> AsyncIterator[Client]:
    client = await connect_fast(url3)
    try:
        yield client
    finally:
        await client.close()


def gateway_on(url: str, partitions: int = 3) -> GatewayServer:
    config = GatewayConfig(
        nats=NatsSettings(url=url, reconnect_wait_s=0.05, partitions=partitions),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
    )
    return GatewayServer(config)


@pytest.fixture
async def gw3(url3: str) -> AsyncIterator[GatewayServer]:
    async with gateway_on(url3) as gw:
        yield gw


@pytest.fixture
async def acme(gw3: GatewayServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw3.url, headers=auth(ACME_KEY)) as c:
        yield c


async def emit(nc: Client, event: Event) -> int:
    """Publish ``event`` as a worker does, to its session's partition; its sequence."""
    subject = PARTS.event(event.tenant, event.session, event.type)
    ack = await nc.jetstream().publish(subject, encode(event))
    return ack.seq


async def deltas(nc: Client, session: str, n: int, *, tenant: str = "acme") -> list[int]:
    """``n`` content deltas of the session's turn ``t1``; their sequences (in its stream)."""
    seqs = []
    for i in range(n):
        text = f"{session}-{i}"
        event = ContentDelta(
            tenant=tenant, session=session, turn_id="t1", iteration=i, text=text, ts=time.time()
        )
        seqs.append(await emit(nc, event))
    return seqs


def stream_of(
    client: httpx.AsyncClient, session: str, **kw: Any
) -> AbstractAsyncContextManager[httpx.Response]:
    return client.stream("GET", f"/v1/sessions/{session}/events", **kw)


async def test_a_sessions_events_stream_and_resume_from_its_own_partition(
    acme: httpx.AsyncClient, nc3: Client
):
    for s in (A, B):
        assert (await acme.post("/v1/sessions", json={"session": s})).status_code == 201
    mine = await deltas(nc3, A, 3)
    theirs = await deltas(nc3, B, 3)
    assert mine == theirs == [1, 2, 3]  # two streams, the same sequences
    async with stream_of(acme, A, params={"since": 0}) as r:
        reader = messages(r)
        async with asyncio.timeout(10):
            got = [await anext(reader) for _ in range(2)]
    assert [(m.id, m.event) for m in got] == [("1", "content_delta"), ("2", "content_delta")]
    assert [m.json()["text"] for m in got] == [f"{A}-0", f"{A}-1"]
    mine += await deltas(nc3, A, 2)
    await deltas(nc3, B, 4)  # B's stream runs ahead: A's ids are still A's own
    async with stream_of(acme, A, headers={"Last-Event-ID": "2"}) as r:
        reader = messages(r)
        async with asyncio.timeout(10):
            rest = [await anext(reader) for _ in range(3)]
            live = await deltas(nc3, A, 1)
            rest.append(await anext(reader))
    assert [int(m.id or 0) for m in rest] == mine[2:] + live == [3, 4, 5, 6]
    assert {m.json()["session"] for m in rest} == {A}
    assert {m.event for m in rest} == {"content_delta"}


async def test_a_resume_into_trimmed_history_is_told_of_its_own_partition(
    acme: httpx.AsyncClient, nc3: Client
):
    await acme.post("/v1/sessions", json={"session": A})
    await deltas(nc3, B, 8)  # another partition, further on
    seqs = await deltas(nc3, A, 5)
    await nc3.jetstream().purge_stream(PARTS.events_stream_of("acme", A), seq=seqs[3])
    async with stream_of(acme, A, headers={"Last-Event-ID": str(seqs[0])}) as r:
        reader = messages(r)
        async with asyncio.timeout(10):
            got = [await anext(reader) for _ in range(3)]
    assert got[0].event == "trimmed"
    assert got[0].json()["first_available"] == seqs[3] == 4
    assert [int(m.id or 0) for m in got[1:]] == seqs[3:]


async def test_a_turn_posted_says_where_its_events_come_in_its_sessions_stream(
    acme: httpx.AsyncClient, nc3: Client
):
    await acme.post("/v1/sessions", json={"session": A})
    await deltas(nc3, B, 6)
    await deltas(nc3, A, 2)
    r = await acme.post(f"/v1/sessions/{A}/turns", json={"input": "hello"})
    assert r.status_code == 202, r.text
    assert r.json()["events_url"].endswith("&since=2")


async def test_the_latest_events_merge_the_tenants_partitions_by_time(
    acme: httpx.AsyncClient, nc3: Client
):
    t0 = time.time()
    order = [("acme", A), ("globex", A), ("acme", B), ("acme", C), ("acme", A), ("acme", B)]
    sent: list[tuple[str, int]] = []
    for i, (tenant, session) in enumerate(order):
        event = LoopStart(tenant=tenant, session=session, turn_id=f"t{i}", ts=t0 + i)
        seq = await emit(nc3, event)
        if tenant == "acme":
            sent.append((f"t{i}", seq))
    r = await acme.get("/v1/events/latest", params={"limit": 10})
    assert r.status_code == 200
    got = [(e["turn_id"], e["seq"]) for e in r.json()]
    assert got == sent
    assert [seq for _, seq in got[:3]] == [1, 1, 1]  # one from each partition's start
    r = await acme.get("/v1/events/latest", params={"limit": 2})
    assert [e["turn_id"] for e in r.json()] == ["t4", "t5"]
    async with httpx.AsyncClient(base_url=str(acme.base_url), headers=auth(GLOBEX_KEY)) as g:
        r = await g.get("/v1/events/latest", params={"limit": 10})
    assert [(e["turn_id"], e["session"]) for e in r.json()] == [("t1", A)]


async def test_readiness_wants_every_partitions_events_stream(acme: httpx.AsyncClient, nc3: Client):
    assert (await acme.get("/readyz")).json() == {"status": "ready"}
    await nc3.jetstream().delete_stream(PARTS.partition_stream(2))
    r = await acme.get("/readyz")
    assert r.status_code == 503
    assert "LOOPMESH_EVENTS_2" in r.text


async def fake_worker(nc: Client, answer_text: str) -> Any:
    """A loop worker's part, on a core subscription to the turns: each turn gets a
    start, a streamed reply, the answer and its end, in its session's partition."""

    async def run(msg: Msg) -> None:
        turn = decode(msg.data, Turn)
        t, s, id_ = turn.tenant, turn.session, turn.id
        await emit(nc, LoopStart(tenant=t, session=s, turn_id=id_, ts=time.time()))
        await emit(nc, ContentDelta(tenant=t, session=s, turn_id=id_, text=answer_text))
        await emit(nc, AnswerMessage(tenant=t, session=s, turn_id=id_, content=answer_text))
        end = LoopEnd(tenant=t, session=s, turn_id=id_, reason="task_completion")
        await emit(nc, end)

    return await nc.subscribe(PARTS.all_turns, cb=run)


async def test_an_a2a_task_streams_and_reads_from_its_sessions_partition(
    gw3: GatewayServer, nc3: Client
):
    await deltas(nc3, B, 5)  # other partitions run ahead of the task's
    await deltas(nc3, C, 7)
    sub = await fake_worker(nc3, "forty-two")
    try:
        async with a2a_client(gw3.url, ACME_KEY) as client:
            got = await follow(client.send_message(message("six times seven?", context_id=A)))
            assert got.state == TaskState.TASK_STATE_COMPLETED
            assert got.streamed_text() == "forty-two"
            task = await client.get_task(GetTaskRequest(id=got.task_id))
    finally:
        await sub.unsubscribe()
    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    assert answer(task) == "forty-two"
    assert task.context_id == A
    meta = dict(task.metadata["loopmesh"])
    assert meta["session"] == A and meta["seq"] == 4  # the end, in A's own stream


@pytest.mark.parametrize("partitions", [1, 2])
async def test_a_gateway_with_another_partition_count_refuses_to_start(url3: str, partitions: int):
    with pytest.raises(ProvisionError) as caught:
        async with gateway_on(url3, partitions):
            pass
    assert str(caught.value).startswith(f"[nats] partitions is {partitions}, but the server")
    assert "3 partitions" in str(caught.value)
    assert "set partitions = 3" in str(caught.value)
