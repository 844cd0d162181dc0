"""The gateway's endpoints against a real nats-server: sessions, turns, controls, the
catalog, health, metrics, docs."""

from __future__ import annotations

import asyncio
import time

import httpx

from loopmesh.testing.durable import connect_fast
from schemas import ApprovalDecision, Cancel, Subjects, ToolSpec, Turn, decode, encode
from schemas.events import LoopStart
from tests.loop_worker.durable import register_tool

SUBJECTS = Subjects()


async def turns_in_stream(url: str) -> list[tuple[Turn, dict[str, str]]]:
    nc = await connect_fast(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(SUBJECTS.turns_stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(SUBJECTS.turns_stream, seq)
            out.append((decode(msg.data or b"", Turn), dict(msg.headers or {})))
        return out
    finally:
        await nc.close()


async def test_a_session_is_created_listed_and_read(client: httpx.AsyncClient):
    r = await client.post("/v1/sessions", json={"session": "s1"})
    assert r.status_code == 201, r.text
    assert r.json() == {"tenant": "acme", "session": "s1", "agent": "default"}
    r = await client.post("/v1/sessions", json={})
    assert r.status_code == 201
    generated = r.json()["session"]
    r = await client.get("/v1/sessions")
    assert r.status_code == 200
    assert {s["session"] for s in r.json()["sessions"]} == {"s1", generated}
    r = await client.get("/v1/sessions/s1")
    assert r.status_code == 200
    body = r.json()
    assert body["tenant"] == "acme" and body["status"] == "idle" and body["messages"] == []


async def test_creating_an_existing_session_is_a_conflict(client: httpx.AsyncClient):
    assert (await client.post("/v1/sessions", json={"session": "s1"})).status_code == 201
    r = await client.post("/v1/sessions", json={"session": "s1"})
    assert r.status_code == 409
    assert r.json()["error"] == {
        "code": "conflict", "message": "session 's1' exists already", "field": "session"
    }  # fmt: skip


async def test_a_posted_turn_is_published_with_jetstream_and_its_id_from_idempotency_key(
    client: httpx.AsyncClient, nats_url: str
):
    body = {
        "input": "hello", "instructions": "be brief", "model": "m1", "max_iterations": 3,
        "tools": ["local.echo", "count"], "mode": "orchestrator", "planner_model": "big/p:1",
        "executor_model": "small-e",
    }  # fmt: skip
    r = await client.post("/v1/sessions/s1/turns", json=body, headers={"Idempotency-Key": "k-1"})
    assert r.status_code == 202, r.text
    posted = r.json()
    assert posted["turn_id"] == "k-1" and posted["session"] == "s1"
    assert posted["events_url"].startswith("/v1/sessions/s1/events?turn=k-1&since=")
    # a retried POST (same key) is the same turn, deduplicated by Nats-Msg-Id
    again = await client.post(
        "/v1/sessions/s1/turns", json=body, headers={"Idempotency-Key": "k-1"}
    )
    assert again.status_code == 202 and again.json()["turn_id"] == "k-1"
    # its events may have started already: the retry's stream replays the turn's history
    assert again.json()["events_url"] == "/v1/sessions/s1/events?turn=k-1&since=0"
    stored = await turns_in_stream(nats_url)
    assert len(stored) == 1
    turn, headers = stored[0]
    assert (turn.id, turn.tenant, turn.session, turn.input) == ("k-1", "acme", "s1", "hello")
    assert turn.instructions == "be brief" and turn.model == "m1" and turn.max_iterations == 3
    assert turn.tools == ("local.echo", "count")
    assert (turn.mode, turn.planner_model, turn.executor_model) == (
        "orchestrator", "big/p:1", "small-e",
    )  # fmt: skip
    assert headers["Nats-Msg-Id"] == "acme.s1.k-1"
    # posting a turn created the session
    assert (await client.get("/v1/sessions/s1")).status_code == 200


async def test_a_turn_is_interactive_unless_it_asks_for_batch_and_goes_to_its_lane(
    client: httpx.AsyncClient, nats_url: str
):
    for key, extra in (("i1", {}), ("b1", {"priority": "batch"})):
        r = await client.post(
            "/v1/sessions/s1/turns", json={"input": "x", **extra}, headers={"Idempotency-Key": key}
        )
        assert r.status_code == 202, r.text
    r = await client.post("/v1/sessions/s1/turns", json={"input": "x", "priority": "urgent"})
    assert r.status_code == 400, r.text  # a body that does not decode, as for on_busy
    assert r.json()["error"]["field"] == "priority"
    nc = await connect_fast(nats_url)
    try:
        info = await nc.jetstream().stream_info(SUBJECTS.turns_stream, subjects_filter=">")
    finally:
        await nc.close()
    assert info.state.subjects == {
        SUBJECTS.turn("acme", "s1"): 1,
        f"{SUBJECTS.turn('acme', 's1')}.batch": 1,
    }
    assert {t.id: t.priority for t, _ in await turns_in_stream(nats_url)} == {
        "i1": "interactive", "b1": "batch"
    }  # fmt: skip


async def test_without_an_idempotency_key_each_post_is_a_new_turn(
    client: httpx.AsyncClient, nats_url: str
):
    ids = set()
    for _ in range(2):
        r = await client.post("/v1/sessions/s1/turns", json={"input": "x"})
        assert r.status_code == 202
        ids.add(r.json()["turn_id"])
    assert len(ids) == 2
    assert {t.id for t, _ in await turns_in_stream(nats_url)} == ids


async def test_controls_are_recorded_and_published_as_the_loop_workers_expect(
    client: httpx.AsyncClient, nats_url: str
):
    assert (await client.post("/v1/sessions", json={"session": "s1"})).status_code == 201
    nc = await connect_fast(nats_url)
    try:
        got: asyncio.Queue = asyncio.Queue()

        async def on(msg):
            await got.put(msg)

        await nc.subscribe(SUBJECTS.control("acme", "s1"), cb=on)
        await nc.flush()
        r = await client.post("/v1/sessions/s1/cancel", json={"reason": "enough"})
        assert r.status_code == 202 and r.json() == {"type": "cancel", "session": "s1"}
        msg = await asyncio.wait_for(got.get(), 5)
        assert msg.headers == {"Loopmesh-Recorded": "1"}
        cancel = decode(msg.data, Cancel)
        assert (cancel.tenant, cancel.session, cancel.reason) == ("acme", "s1", "enough")
        kv = await nc.jetstream().key_value(SUBJECTS.control_bucket)
        assert decode((await kv.get("acme.s1")).value or b"", Cancel) == cancel

        for kind in ("pause", "resume"):
            r = await client.post(f"/v1/sessions/s1/{kind}")
            assert r.status_code == 202 and r.json()["type"] == kind
            msg = await asyncio.wait_for(got.get(), 5)
            assert msg.data.startswith(b'{"type":"%s"' % kind.encode())

        r = await client.post(
            "/v1/sessions/s1/approvals/c-1", json={"approve": False, "reason": "no"}
        )
        assert r.status_code == 202
        assert r.json() == {"type": "deny", "session": "s1", "call_id": "c-1"}
        decision = decode((await asyncio.wait_for(got.get(), 5)).data, ApprovalDecision)
        assert (decision.call_id, decision.approved, decision.reason) == ("c-1", False, "no")
        stored = await kv.get("acme.s1.approval.c-1")
        assert decode(stored.value or b"", ApprovalDecision) == decision
    finally:
        await nc.close()


async def test_the_tool_catalog_lists_registered_tools(client: httpx.AsyncClient, nats_url: str):
    assert (await client.get("/v1/tools")).json() == {"tools": []}
    nc = await connect_fast(nats_url)
    try:
        await register_tool(nc, ToolSpec(server="local", name="echo", description="echo it"))
        await register_tool(nc, ToolSpec(server="local", name="aaa", needs_approval=True))
    finally:
        await nc.close()
    tools = (await client.get("/v1/tools")).json()["tools"]
    assert [(t["server"], t["name"]) for t in tools] == [("local", "aaa"), ("local", "echo")]
    assert tools[0]["needs_approval"] is True


async def test_latest_events_are_the_tenants_own_with_their_sequence(
    client: httpx.AsyncClient, nats_url: str
):
    nc = await connect_fast(nats_url)
    try:
        js = nc.jetstream()
        for tenant, turn in [("acme", "t1"), ("globex", "g1"), ("acme", "t2")]:
            event = LoopStart(tenant=tenant, session="s1", turn_id=turn, ts=time.time())
            await js.publish(SUBJECTS.event(tenant, "s1", "loop_start"), encode(event))
    finally:
        await nc.close()
    r = await client.get("/v1/events/latest", params={"limit": 5})
    assert r.status_code == 200
    events = r.json()
    assert [(e["seq"], e["turn_id"], e["type"]) for e in events] == [
        (1, "t1", "loop_start"), (3, "t2", "loop_start")
    ]  # fmt: skip
    r = await client.get("/v1/events/latest", params={"limit": 1})
    assert [e["turn_id"] for e in r.json()] == ["t2"]


async def test_health_readiness_metrics_openapi_and_docs_answer(
    client: httpx.AsyncClient, nats_url: str
):
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"status": "ready"}
    metrics = (await client.get("/metrics")).text
    assert "loopmesh_gateway_sse_clients 0.0" in metrics
    spec = (await client.get("/openapi.json")).json()
    assert spec["openapi"] == "3.1.0"
    assert "/v1/sessions/{session}/turns" in spec["paths"]
    assert "PostTurn" in spec["components"]["schemas"]
    page = await client.get("/docs")
    assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text
    assert "http" not in page.text.split("<body>")[1]  # no CDN
    asset = await client.get("/docs/assets/swagger-ui-bundle.js")
    assert asset.status_code == 200 and len(asset.content) > 100_000


async def test_readiness_fails_when_a_stream_is_missing(client: httpx.AsyncClient, nats_url: str):
    nc = await connect_fast(nats_url)
    try:
        await nc.jetstream().delete_stream(SUBJECTS.events_stream)
    finally:
        await nc.close()
    r = await client.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {"status": "unavailable", "detail": "stream LOOPMESH_EVENTS is missing"}


async def test_the_key_is_required_but_health_is_public(gateway):
    async with httpx.AsyncClient(base_url=gateway.url) as anon:
        assert (await anon.get("/healthz")).status_code == 200
        r = await anon.get("/v1/sessions")
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["message"].startswith("missing API key")


async def test_a_posted_turn_carries_its_passages_and_content_parts(
    client: httpx.AsyncClient, nats_url: str
):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = {
        "input": "what is in the picture?",
        "context": [{"text": "The picture was taken in Lima.", "source": "notes://7"}],
        "parts": [image],
    }
    r = await client.post("/v1/sessions/s1/turns", json=body)
    assert r.status_code == 202, r.text
    [(turn, _)] = await turns_in_stream(nats_url)
    assert [(p.text, p.source) for p in turn.context] == [
        ("The picture was taken in Lima.", "notes://7")
    ]
    assert encode(turn.parts[0]) == encode(image)
    bad = {"input": "x", "parts": [{"type": "image_url", "image_url": {"url": "file:///etc"}}]}
    r = await client.post("/v1/sessions/s1/turns", json=bad)
    assert r.status_code == 400, r.text
    assert "parts[0].image_url.url" in r.text
