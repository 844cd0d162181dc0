"""Fork and rewind end to end: HTTP through the real gateway, NATS, a real loop worker
(its ``openai`` client) and a real tool worker, against the fake OpenAI server, which
records every request. After a fork or a rewind, the model's first request holds exactly
the history up to the chosen point."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import GatewayServer
from loopmesh.testing.durable import stream_events
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.sse import messages
from tests.conftest import Durable
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, KEYS, auth
from tests.gateway.test_partitions import PARTS, A, B
from tests.gateway.test_partitions import gateway_on as partitioned_gateway
from tests.gateway.test_webview import llm, mesh
from tests.loop_worker.durable import Mesh, count_task, gateway_on, mesh_on

__all__ = ["llm", "mesh"]  # the fixtures, shared


async def run(client: httpx.AsyncClient, llm: FakeLLM, session: str, text: str) -> Any:
    """Post a turn and read its events until it ends; (turn id, its first LLM request)."""
    asked = len(llm.requests)
    r = await client.post(f"/v1/sessions/{session}/turns", json={"input": text})
    assert r.status_code == 202, r.text
    posted = r.json()
    async with asyncio.timeout(60), client.stream("GET", posted["events_url"]) as s:
        async for m in messages(s):
            if m.event == "loop_end":
                assert m.json()["reason"] == "task_completion", m.data
                break
    return posted["turn_id"], llm.requests[asked]


def called(request: dict[str, Any]) -> list[str]:
    """The tools called in a request's history."""
    return [c["function"]["name"] for m in request["messages"] for c in m.get("tool_calls", [])]


async def three_turns(client: httpx.AsyncClient, llm: FakeLLM, tmp_path: Path) -> Any:
    """Session s1: a plain turn, one that runs a tool, a plain turn."""
    return await three_turns_in(client, llm, "s1", tmp_path)


async def three_turns_in(
    client: httpx.AsyncClient, llm: FakeLLM, session: str, tmp_path: Path
) -> Any:
    first = await run(client, llm, session, "remember the word heron")
    second = await run(client, llm, session, count_task(tmp_path / "n"))
    third = await run(client, llm, session, "what was the word?")
    assert (tmp_path / "n").read_text() == "a\n"
    return first, second, third


async def test_a_fork_before_a_turn_asks_the_model_exactly_what_that_turn_asked(
    mesh: Mesh, client: httpx.AsyncClient, llm: FakeLLM, tmp_path: Path
):
    (t1, _), (t2, asked2), (t3, asked3) = await three_turns(client, llm, tmp_path)
    before = (await client.get("/v1/sessions/s1")).json()

    r = await client.post("/v1/sessions/s1/fork", json={"before_turn": t3, "session": "f1"})
    assert r.status_code == 201, r.text
    assert r.json() == {
        "tenant": "acme", "session": "f1", "source": "s1", "agent": "default",
        "at_turn": t2, "turns": [t1, t2], "messages": r.json()["messages"],
    }  # fmt: skip
    _, again = await run(client, llm, "f1", "what was the word?")
    assert again["messages"] == asked3["messages"]  # the same history, the same input

    # at the end of the first turn, with an input of its own
    r = await client.post("/v1/sessions/s1/fork", json={"at_turn": t1})
    assert r.status_code == 201, r.text
    fork = r.json()["session"]
    assert r.json()["turns"] == [t1]
    _, other = await run(client, llm, fork, "spell it backwards")
    assert other["messages"][:-1] == asked2["messages"][:-1]
    assert other["messages"][-1]["content"].endswith("spell it backwards")
    assert "local__count" in called(asked3) and "local__count" not in called(other)

    # the source is untouched, and the new sessions say where they came from
    assert (await client.get("/v1/sessions/s1")).json() == before
    events = [e for e, _ in await stream_events(mesh.nc, "acme", "f1")]
    assert events[0].type == "forked"
    assert (events[0].source, events[0].at_turn, events[0].turns) == ("s1", t2, (t1, t2))
    assert (tmp_path / "n").read_text() == "a\n"  # nothing ran again


async def test_a_fork_of_a_fork_folds_the_source_turns(
    mesh: Mesh, client: httpx.AsyncClient, llm: FakeLLM, tmp_path: Path
):
    (t1, _), (t2, asked2), _ = await three_turns(client, llm, tmp_path)
    r = await client.post("/v1/sessions/s1/fork", json={"at_turn": t2, "session": "f1"})
    assert r.status_code == 201, r.text
    await run(client, llm, "f1", "a turn of the fork")
    r = await client.post("/v1/sessions/f1/fork", json={"before_turn": t2, "session": "f2"})
    assert r.status_code == 201, r.text
    assert r.json()["turns"] == [t1]
    _, again = await run(client, llm, "f2", count_task(tmp_path / "n"))
    assert again["messages"] == asked2["messages"]


async def test_a_rewind_undoes_the_later_turns_and_the_next_turn_starts_from_there(
    mesh: Mesh, client: httpx.AsyncClient, llm: FakeLLM, tmp_path: Path
):
    (t1, _), (t2, asked2), (t3, _) = await three_turns(client, llm, tmp_path)
    r = await client.post("/v1/sessions/s1/rewind", json={"before_turn": t2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["to_turn"], body["undone"]) == (t1, [t2, t3])
    [call] = body["calls"]  # the count call ran; its effect stays
    assert (call["tool"], call["status"]) == ("count", "ok")
    session = (await client.get("/v1/sessions/s1")).json()
    assert session["status"] == "idle" and session["turn_id"] == t1
    assert len(session["messages"]) == body["messages"]

    _, again = await run(client, llm, "s1", count_task(tmp_path / "n"))
    assert again["messages"] == asked2["messages"]  # the worker read the rewound session
    events = [e for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    rewound = [e for e in events if e.type == "rewound"]
    assert len(rewound) == 1 and rewound[0].turns == (t2, t3)
    assert {e.turn_id for e in events} >= {t1, t2, t3}  # the undone turns' events stay

    # an undone turn can no longer be named; the kept ones still can
    r = await client.post("/v1/sessions/s1/rewind", json={"at_turn": t3})
    assert r.status_code == 422 and "undone" in r.json()["error"]["message"]
    r = await client.post("/v1/sessions/s1/fork", json={"at_turn": t1, "session": "f1"})
    assert r.status_code == 201 and r.json()["turns"] == [t1]


async def test_fork_and_rewind_refuse_what_they_cannot_do(
    mesh: Mesh, gateway: GatewayServer, client: httpx.AsyncClient, llm: FakeLLM, tmp_path: Path
):
    t1, _ = await run(client, llm, "s1", "hello")
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/v1/sessions/nope/fork", {"at_turn": t1}, 404, None),
        ("/v1/sessions/nope/rewind", {"before_turn": t1}, 404, None),
        ("/v1/sessions/s1/fork", {"at_turn": "unknown"}, 422, "at_turn"),
        ("/v1/sessions/s1/rewind", {"before_turn": "unknown"}, 422, "before_turn"),
        ("/v1/sessions/s1/fork", {}, 422, "before_turn"),
        ("/v1/sessions/s1/fork", {"at_turn": t1, "before_turn": t1}, 422, "at_turn"),
        ("/v1/sessions/s1/fork", {"at_turn": "a.b"}, 422, "at_turn"),
        ("/v1/sessions/s1/fork", {"at_turn": t1, "session": "s1"}, 422, "session"),
        ("/v1/sessions/s1/fork", {"at_turn": t1, "session": "x y"}, 422, "session"),
        ("/v1/sessions/s1/fork", {"at_turn": 3}, 400, "at_turn"),
        ("/v1/sessions/s1/fork", {"at_turn": t1, "turn": 1}, 400, None),
        ("/v1/sessions/s1/rewind", {"at_turn": t1}, 422, "at_turn"),  # nothing after it
    ]
    for path, body, status, field in cases:
        r = await client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        if field is not None:
            assert r.json()["error"]["field"] == field, (path, body, r.text)
    assert (await client.post("/v1/sessions", json={"session": "taken"})).status_code == 201
    r = await client.post("/v1/sessions/s1/fork", json={"at_turn": t1, "session": "taken"})
    assert r.status_code == 409 and r.json()["error"]["field"] == "session"

    # another tenant sees no such session
    async with httpx.AsyncClient(base_url=gateway.url, headers=auth(GLOBEX_KEY)) as globex:
        for kind, body in (("fork", {"at_turn": t1}), ("rewind", {"before_turn": t1})):
            r = await globex.post(f"/v1/sessions/s1/{kind}", json=body)
            assert r.status_code == 404, r.text


async def test_fork_and_rewind_are_refused_while_a_turn_of_the_session_runs(
    mesh: Mesh, client: httpx.AsyncClient, llm: FakeLLM, tmp_path: Path
):
    t1, _ = await run(client, llm, "s1", "hello")
    r = await client.post(
        "/v1/sessions/s1/turns", json={"input": count_task(tmp_path / "n", seconds=30)}
    )
    posted = r.json()
    async with asyncio.timeout(60), client.stream("GET", posted["events_url"]) as s:
        async for m in messages(s):
            if m.event == "tool_call":
                break
    for kind, body in (("fork", {"at_turn": t1}), ("rewind", {"before_turn": t1})):
        r = await client.post(f"/v1/sessions/s1/{kind}", json=body)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "session_busy"
    r = await client.post("/v1/sessions/s1/cancel", json={})
    assert r.status_code < 300, r.text


async def test_a_fork_into_another_partition_and_its_rewind_read_each_sessions_stream(
    nats_server: Any, tmp_path: Path
):
    assert PARTS.partition("acme", A) != PARTS.partition("acme", B)
    async with (
        mesh_on(nats_server.url, partitions=3, workers=True) as mesh,
        partitioned_gateway(mesh.url) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as client,
    ):
        llm = mesh.fake
        assert llm is not None
        (t1, _), (t2, _), (t3, asked3) = await three_turns_in(client, llm, A, tmp_path)
        r = await client.post(f"/v1/sessions/{A}/fork", json={"at_turn": t3, "session": B})
        assert r.status_code == 201 and r.json()["turns"] == [t1, t2, t3], r.text
        r = await client.post(f"/v1/sessions/{B}/rewind", json={"before_turn": t3})
        assert r.status_code == 200 and r.json()["undone"] == [t3], r.text
        _, again = await run(client, llm, B, "what was the word?")
        assert again["messages"] == asked3["messages"]
        events = [e for e, _ in await stream_events(mesh.nc, "acme", B, PARTS)]
        assert [e.type for e in events][:2] == ["forked", "rewound"]


@pytest.mark.parametrize("durable", ["cluster"], indirect=True)
async def test_fork_and_rewind_on_a_cluster_with_three_replicas(durable: Durable, tmp_path: Path):
    async with (
        mesh_on(durable.url, replicas=3, workers=True) as mesh,
        gateway_on(durable.url, api_keys=KEYS) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as client,
    ):
        llm = mesh.fake
        assert llm is not None
        _, (t2, asked2), (t3, asked3) = await three_turns(client, llm, tmp_path)
        r = await client.post("/v1/sessions/s1/fork", json={"before_turn": t3, "session": "f1"})
        assert r.status_code == 201, r.text
        _, again = await run(client, llm, "f1", "what was the word?")
        assert again["messages"] == asked3["messages"]
        r = await client.post("/v1/sessions/s1/rewind", json={"before_turn": t2})
        assert r.status_code == 200 and r.json()["undone"] == [t2, t3], r.text
        _, again = await run(client, llm, "s1", count_task(tmp_path / "n"))
        assert again["messages"] == asked2["messages"]
