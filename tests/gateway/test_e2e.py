"""End to end: HTTP turns through the gateway, NATS, a real loop worker and a real tool
worker (in-process services, each with its own client) against the fake OpenAI server;
their events come back over SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from loopmesh.testing.durable import stream_events
from loopmesh.testing.sse import Message, messages
from tests.loop_worker.durable import Mesh, count_task, mesh_on


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_url, provisioned=True, workers=True) as mesh:
        yield mesh


async def until(reader: AsyncIterator[Message], event: str, out: list[Message]) -> Message:
    async with asyncio.timeout(30):
        async for m in reader:
            out.append(m)
            if m.event == event:
                return m
    raise AssertionError(f"stream ended before {event}")


async def stored(mesh: Mesh, session: str, turn_id: str) -> list[tuple[str, str]]:
    """(type, turn JSON) of the turn's events as the events stream holds them."""
    return [
        (e.type, e.turn_id) for e, _ in await stream_events(mesh.nc, "acme", session)
        if e.turn_id == turn_id
    ]  # fmt: skip


async def test_an_http_turn_runs_on_the_workers_and_its_events_arrive_over_sse(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    r = await client.post("/v1/sessions/s1/turns", json={"input": count_task(tmp_path / "n")})
    assert r.status_code == 202
    posted = r.json()
    got: list[Message] = []
    async with client.stream("GET", posted["events_url"]) as s:
        end = await until(messages(s), "loop_end", got)
    assert end.json()["reason"] == "task_completion"
    assert (tmp_path / "n").read_text() == "a\n"
    types = [m.event for m in got]
    for expected in ("loop_start", "loop_iteration", "llm_request",
                     "llm_response", "tool_call", "tool_result", "loop_end"):  # fmt: skip
        assert expected in types, (expected, types)
    # exactly what the events stream holds for the turn, in its order
    assert [(m.event, m.json()["turn_id"]) for m in got] == await stored(
        mesh, "s1", posted["turn_id"]
    )
    ids = [int(m.id or 0) for m in got]
    assert ids == sorted(set(ids))
    session = (await client.get("/v1/sessions/s1")).json()
    assert session["status"] == "idle" and session["turns"] == 1
    assert session["messages"][0]["role"] in ("system", "user")


async def test_a_stream_dropped_mid_turn_resumes_by_last_event_id(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    task = count_task(tmp_path / "n", seconds=1.0)
    posted = (await client.post("/v1/sessions/s1/turns", json={"input": task})).json()
    first: list[Message] = []
    async with client.stream("GET", posted["events_url"]) as s:
        await until(messages(s), "tool_call", first)
    # dropped while the tool runs; the turn goes on without the client
    rest: list[Message] = []
    headers = {"Last-Event-ID": first[-1].id or ""}
    async with client.stream("GET", posted["events_url"], headers=headers) as s:
        end = await until(messages(s), "loop_end", rest)
    assert end.json()["reason"] == "task_completion"  # closing the stream did not stop it
    both = first + rest
    ids = [int(m.id or 0) for m in both]
    assert len(ids) == len(set(ids)), "an event arrived twice"
    assert [(m.event, m.json()["turn_id"]) for m in both] == await stored(
        mesh, "s1", posted["turn_id"]
    )  # nothing missed


async def test_a_tool_that_needs_approval_runs_once_approved_over_http(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    args = {"path": str(tmp_path / "g"), "label": "ok"}
    task = f"call local__guarded {json.dumps(args)}"
    posted = (await client.post("/v1/sessions/s1/turns", json={"input": task})).json()
    got: list[Message] = []
    async with client.stream("GET", posted["events_url"]) as s:
        reader = messages(s)
        required = await until(reader, "approval_required", got)
        call_id = required.json()["call_id"]
        r = await client.post(f"/v1/sessions/s1/approvals/{call_id}", json={"approve": True})
        assert r.status_code == 202
        decided = await until(reader, "approval_decision", got)
        assert decided.json()["approved"] is True
        end = await until(reader, "loop_end", got)
    assert end.json()["reason"] == "task_completion"
    assert (tmp_path / "g").read_text() == "ok\n"


async def test_cancel_over_http_ends_the_running_turn(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    task = count_task(tmp_path / "n", seconds=30.0)
    posted = (await client.post("/v1/sessions/s1/turns", json={"input": task})).json()
    got: list[Message] = []
    async with client.stream("GET", posted["events_url"]) as s:
        reader = messages(s)
        await until(reader, "tool_call", got)
        r = await client.post("/v1/sessions/s1/cancel", json={"reason": "stop it"})
        assert r.status_code == 202
        end = await until(reader, "loop_end", got)
    assert end.json()["reason"] == "cancelled"


async def test_pause_over_http_holds_the_turn_at_its_next_iteration_until_resumed(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    task = count_task(tmp_path / "n", seconds=1.0)
    posted = (await client.post("/v1/sessions/s1/turns", json={"input": task})).json()
    got: list[Message] = []
    async with client.stream("GET", posted["events_url"]) as s:
        reader = messages(s)
        await until(reader, "tool_call", got)
        r = await client.post("/v1/sessions/s1/pause", json={})
        assert r.status_code == 202 and r.json() == {"type": "pause", "session": "s1"}
        await until(reader, "paused", got)
        assert [e for e, _ in await stored(mesh, "s1", posted["turn_id"])][-1] == "paused"
        r = await client.post("/v1/sessions/s1/resume", json={})
        assert r.status_code == 202 and r.json()["type"] == "resume"
        await until(reader, "resumed", got)
        end = await until(reader, "loop_end", got)
    assert end.json()["reason"] == "task_completion"
    types = [m.event for m in got]
    assert types.index("tool_result") < types.index("paused")  # the tool ran to its end


async def read_without_since(client: httpx.AsyncClient, session: str) -> list[Message]:
    """``GET .../events`` with neither ``since`` nor ``Last-Event-ID``, up to a
    ``loop_end``."""
    got: list[Message] = []
    async with client.stream("GET", f"/v1/sessions/{session}/events") as s:
        await until(messages(s), "loop_end", got)
    return got


async def test_events_without_since_right_after_a_post_show_that_turn_to_its_end(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    first = (await client.post("/v1/sessions/s1/turns", json={"input": "hello"})).json()
    async with client.stream("GET", first["events_url"]) as s:
        await until(messages(s), "loop_end", [])
    task = count_task(tmp_path / "n")
    posted = (await client.post("/v1/sessions/s1/turns", json={"input": task})).json()
    got = await read_without_since(client, "s1")
    assert got[0].event == "turn_accepted"  # from its start, none of the turn before
    assert got[-1].json()["reason"] == "task_completion"
    assert [(m.event, m.json()["turn_id"]) for m in got] == await stored(
        mesh, "s1", posted["turn_id"]
    )


async def test_events_without_since_opened_mid_turn_start_at_that_turns_beginning(
    mesh: Mesh, client: httpx.AsyncClient, tmp_path: Path
):
    task = count_task(tmp_path / "n", seconds=1.0)
    posted = (await client.post("/v1/sessions/s1/turns", json={"input": task})).json()
    async with client.stream("GET", posted["events_url"]) as s:
        await until(messages(s), "tool_call", [])  # the turn is under way
    got = await read_without_since(client, "s1")
    assert [(m.event, m.json()["turn_id"]) for m in got] == await stored(
        mesh, "s1", posted["turn_id"]
    )
    # once it has ended, the same request shows it again: the session's latest turn
    again = await read_without_since(client, "s1")
    assert [m.id for m in again] == [m.id for m in got]
