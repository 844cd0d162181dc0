"""SSE event streams: sequence ids, history, resume, turn filter, trimmed history,
keep-alive comments, slow clients cut on their own, the per-key stream cap."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
from nats.aio.client import Client

from loopmesh.testing.sse import Message, messages
from schemas import Subjects
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, auth, publish

SUBJECTS = Subjects()


async def take(response: httpx.Response, n: int, *, timeout: float = 10.0) -> list[Message]:
    """The next ``n`` messages of ``response`` (which may be read again later)."""
    reader = response.extensions.get("sse_reader")
    if reader is None:
        reader = response.extensions["sse_reader"] = messages(response)
    async with asyncio.timeout(timeout):
        return [await anext(reader) for _ in range(n)]


async def test_history_streams_with_the_stream_sequence_as_id_and_the_type_as_event(
    client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    seqs = await publish(nc, 3)
    async with client.stream("GET", "/v1/sessions/s1/events", params={"since": 0}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = await take(r, 3)
    assert [m.id for m in got] == [str(s) for s in seqs]
    assert {m.event for m in got} == {"content_delta"}
    assert [m.json()["iteration"] for m in got] == [0, 1, 2]


async def test_a_stream_that_asked_for_history_says_when_it_has_all_of_it(
    client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    seqs = await publish(nc, 300)  # more than one replay batch
    async with client.stream("GET", "/v1/sessions/s1/events", params={"since": 0}) as r:
        reader = messages(r, caught_up=True)
        async with asyncio.timeout(30):
            got = [await anext(reader) for _ in range(301)]
            assert [m.id for m in got[:300]] == [str(s) for s in seqs]
            assert got[300].event == "caught_up" and got[300].id is None
            assert got[300].json()["last_id"] == seqs[-1]
            live = await publish(nc, 1)
            after = await anext(reader)
    assert (after.event, after.id) == ("content_delta", str(live[0]))


async def test_new_events_arrive_live_and_since_skips_what_was_seen(
    client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    first = await publish(nc, 2)
    async with client.stream("GET", "/v1/sessions/s1/events", params={"since": first[0]}) as r:
        got = await take(r, 1)
        later = await publish(nc, 1)
        got += await take(r, 1)
    assert [int(m.id or 0) for m in got] == [first[1], later[0]]
    async with client.stream("GET", "/v1/sessions/s1/events") as r:  # from new
        more = await publish(nc, 1)
        assert [int(m.id or 0) for m in await take(r, 1)] == more


async def test_the_turn_filter_keeps_one_turns_events(client: httpx.AsyncClient, nc: Client):
    await client.post("/v1/sessions", json={"session": "s1"})
    await publish(nc, 2, turn="a")
    mine = await publish(nc, 2, turn="b")
    await publish(nc, 1, turn="a")
    mine += await publish(nc, 1, turn="b")
    params = {"since": 0, "turn": "b"}
    async with client.stream("GET", "/v1/sessions/s1/events", params=params) as r:
        got = await take(r, 3)
    assert [int(m.id or 0) for m in got] == mine
    assert {m.json()["turn_id"] for m in got} == {"b"}


async def test_a_dropped_stream_resumes_by_last_event_id_missing_nothing_repeating_nothing(
    client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    seqs = await publish(nc, 4)
    async with client.stream("GET", "/v1/sessions/s1/events", params={"since": 0}) as r:
        first = await take(r, 2)
    # the connection is gone; more events are stored meanwhile
    seqs += await publish(nc, 3)
    headers = {"Last-Event-ID": first[-1].id or ""}
    # Last-Event-ID wins over a stale since= in the URL the client reconnects to
    async with client.stream(
        "GET", "/v1/sessions/s1/events", params={"since": 0}, headers=headers
    ) as r:
        rest = await take(r, 5)
    assert [int(m.id or 0) for m in first + rest] == seqs


async def test_resuming_from_trimmed_history_says_so_then_sends_the_rest(
    client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    seqs = await publish(nc, 5)
    await nc.jetstream().purge_stream(SUBJECTS.events_stream, seq=seqs[3])  # drop 1..3
    async with client.stream(
        "GET", "/v1/sessions/s1/events", headers={"Last-Event-ID": str(seqs[0])}
    ) as r:
        got = await take(r, 3)
    trimmed = got[0]
    assert trimmed.event == "trimmed" and trimmed.id is None
    assert trimmed.json() == {
        "requested": seqs[1],
        "first_available": seqs[3],
        "message": f"events {seqs[1]}..{seqs[2]} are no longer kept; "
        f"this stream continues from {seqs[3]}",
    }
    assert [int(m.id or 0) for m in got[1:]] == seqs[3:]


async def test_an_idle_stream_gets_keepalive_comments(gateway_at, nc: Client):
    async with (
        gateway_at(keepalive_s=0.2) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        await c.post("/v1/sessions", json={"session": "s1"})
        async with c.stream("GET", "/v1/sessions/s1/events") as r:
            async with asyncio.timeout(10):
                async for m in messages(r, comments=True):
                    if "keepalive" in m.comments:
                        break


async def test_a_slow_client_is_cut_alone_and_resumes_by_last_event_id(gateway_at, nc: Client):
    big = "y" * 64 * 1024
    async with (
        gateway_at(stream_buffer=8) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY), timeout=30) as c,
    ):
        await c.post("/v1/sessions", json={"session": "s1"})
        async with (
            c.stream("GET", "/v1/sessions/s1/events") as stalled,
            c.stream("GET", "/v1/sessions/s1/events") as reader,
        ):
            seen: list[int] = []

            async def read_all() -> None:
                async for m in messages(reader):
                    seen.append(int(m.id or 0))
                    if len(seen) == 300:
                        return

            reading = asyncio.create_task(read_all())
            seqs = await publish(nc, 300, text=big)  # ~19 MB the stalled client never reads
            await asyncio.wait_for(reading, 60)
            assert seen == seqs  # the reader was not slowed down or cut
            got: list[Message] = []
            async with asyncio.timeout(30):
                async for m in messages(stalled):
                    got.append(m)
        assert got[-1].event == "cut"
        delivered = [int(m.id or 0) for m in got[:-1]]
        assert delivered == seqs[: len(delivered)] and len(delivered) < len(seqs)
        cut = got[-1].json()
        assert cut["last_id"] == delivered[-1]
        assert f"Last-Event-ID: {delivered[-1]}" in cut["message"]
        # a client resumes after each cut (a replay at full speed may be cut again)
        last = cut["last_id"]
        async with asyncio.timeout(60):
            while len(delivered) < len(seqs):
                headers = {"Last-Event-ID": str(last)}
                async with c.stream("GET", "/v1/sessions/s1/events", headers=headers) as r:
                    async for m in messages(r):
                        if m.event == "cut":
                            last = m.json()["last_id"]
                            break
                        delivered.append(int(m.id or 0))
                        if len(delivered) == len(seqs):
                            break
        assert delivered == seqs
        metrics = (await c.get("/metrics")).text
        assert "loopmesh_gateway_sse_cut_total" in metrics


async def test_open_streams_per_key_are_capped_and_a_closed_one_frees_its_slot(gateway_at):
    async with (
        gateway_at(max_streams_per_key=2) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
        httpx.AsyncClient(base_url=gw.url, headers=auth(GLOBEX_KEY)) as other,
    ):
        await c.post("/v1/sessions", json={"session": "s1"})
        await other.post("/v1/sessions", json={"session": "s1"})
        async with contextlib.AsyncExitStack() as streams:
            for _ in range(2):
                r = await streams.enter_async_context(c.stream("GET", "/v1/sessions/s1/events"))
                assert r.status_code == 200
            r = await c.get("/v1/sessions/s1/events")
            assert r.status_code == 429
            assert r.json()["error"] == {
                "code": "rate_limited",
                "message": "this key has 2 streams and calls open (event streams, A2A streams "
                "and sends, MCP tool calls), the most allowed ([gateway] max_streams_per_key "
                "= 2); close one first",
            }
            assert r.headers["retry-after"] == "1"
            # another key's streams are counted apart
            async with other.stream("GET", "/v1/sessions/s1/events") as r:
                assert r.status_code == 200
            metrics = (await c.get("/metrics")).text
            line = next(x for x in metrics.splitlines() if x.startswith("loopmesh_gateway_sse_c"))
            assert float(line.split()[1]) >= 2  # the other key's may not be seen closed yet
        deadline = time.monotonic() + 10
        while True:  # the slots are released once the server sees the disconnects
            async with c.stream("GET", "/v1/sessions/s1/events") as r:
                if r.status_code == 200:
                    break
            assert time.monotonic() < deadline, "slot never released"
            await asyncio.sleep(0.05)


async def test_streaming_another_tenants_session_is_not_found(
    client: httpx.AsyncClient, gateway, nc: Client
):
    async with httpx.AsyncClient(base_url=gateway.url, headers=auth(GLOBEX_KEY)) as globex:
        assert (await globex.post("/v1/sessions", json={"session": "theirs"})).status_code == 201
    r = await client.get("/v1/sessions/theirs/events", params={"since": 0})
    assert r.status_code == 404
    assert r.json()["error"] == {"code": "not_found", "message": "no session 'theirs'"}


async def test_resuming_from_past_the_end_waits_for_the_next_events(
    client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    seqs = await publish(nc, 2)
    headers = {"Last-Event-ID": str(seqs[-1] + 1)}  # one this session never had
    async with client.stream("GET", "/v1/sessions/s1/events", headers=headers) as r:
        assert r.status_code == 200
        more = await publish(nc, 3)
        got = await take(r, 2)
    assert [int(m.id or 0) for m in got] == more[1:]
