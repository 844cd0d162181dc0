"""``DELETE /v1/sessions/{session}`` on real servers: a session whose turn came as an
A2A task and called another agent (whose own turn ran a tool) is erased, and then every
stream and every KV bucket the deployment provisions is read message by message and
holds nothing of it: no subject, key, header or body names the session, its child
session, its task, its calls, or what the user wrote. Only the audit record names the
session. On one server, and on a 3-node cluster with three events partitions. The
dead-letter records of a session's turns go with it; another session's stay."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.types import TaskState
from nats.aio.client import Client

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.agents import apply_agents
from loopmesh.deadletter import record
from loopmesh.jetstream import Publisher
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import SUBJECTS, stream_events
from schemas import AgentSpec, Subjects, definitions
from schemas.events import ToolCallEvent
from tests.conftest import BOTH, Durable
from tests.gateway.a2a_client import a2a_client, follow, message
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, KEYS, auth, publish
from tests.loop_worker.durable import mesh_on

BOSS = AgentSpec(name="boss", description="Delegates counting to calc.", agents=("calc",))
CALC = AgentSpec(name="calc", description="Counts, with the count tool.", tools=("local.count",))


@asynccontextmanager
async def gateway_on(durable: Durable, subjects: Subjects, **settings: Any) -> AsyncIterator[str]:
    nats = NatsSettings(
        url=durable.url, reconnect_wait_s=0.05, replicas=durable.replicas,
        partitions=subjects.partitions,
    )  # fmt: skip
    settings.setdefault("rate_per_s", 1000)  # the tests read and poll with one key
    settings.setdefault("rate_burst", 1000)
    config = GatewayConfig(nats=nats, gateway=GatewaySettings(port=0, api_keys=KEYS, **settings))
    async with GatewayServer(config) as gw:
        yield gw.url


def ask_calc(ledger: Path, secret: str) -> str:
    """The boss's input: the fake model calls calc, whose input makes it call count."""
    count = json.dumps({"path": str(ledger), "label": secret})
    return "call agents__calc " + json.dumps({"input": f"call local__count {count}"})


async def stored_messages(nc: Client, stream: str) -> AsyncIterator[tuple[str, bytes]]:
    """Every message ``stream`` holds, as (subject, headers and body), read one by one
    from its leader."""
    info = await nc.jetstream().stream_info(stream)
    if not info.state.messages:
        return
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        reply = await nc.request(
            f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps({"seq": seq}).encode(), timeout=5
        )
        found = json.loads(reply.data)
        if "error" in found:
            assert found["error"]["code"] == 404, found
            continue
        msg = found["message"]
        raw = base64.b64decode(msg.get("hdrs") or "") + base64.b64decode(msg.get("data") or "")
        yield msg["subject"], raw


async def everything_stored(nc: Client, subjects: Subjects) -> dict[str, list[tuple[str, bytes]]]:
    """Each stream and bucket the deployment provisions, with every message it holds."""
    defs = definitions(subjects)
    names = [s.name for s in defs.streams] + [f"KV_{b.bucket}" for b in defs.buckets]
    return {name: [m async for m in stored_messages(nc, name)] for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_an_erased_session_is_in_no_stream_and_no_bucket(durable: Durable, tmp_path: Path):
    partitions = 1 if durable.kind == "single" else 3
    subjects = Subjects(partitions=partitions)
    session, other = f"erase-{uuid.uuid4().hex[:12]}", f"keep-{uuid.uuid4().hex[:12]}"
    secret = f"secret-{uuid.uuid4().hex}"
    async with mesh_on(durable.url, replicas=durable.replicas, partitions=partitions) as mesh:
        await mesh.tool_worker()
        await mesh.loop_worker()
        nc = mesh.nc
        await apply_agents(nc.jetstream(), subjects, [CALC, BOSS])
        async with (
            gateway_on(durable, subjects) as url,
            httpx.AsyncClient(base_url=url, headers=auth(ACME_KEY), timeout=60) as http,
        ):
            r = await http.post(
                "/v1/sessions",
                json={"session": session, "agent": "boss", "title": "to erase",
                      "labels": {"case": secret}},
            )  # fmt: skip
            assert r.status_code == 201, r.text
            async with a2a_client(f"{url}/a2a/boss", ACME_KEY) as client:
                got = await follow(
                    client.send_message(message(ask_calc(tmp_path / "n", secret),
                                                context_id=session)),
                    timeout=90,
                )  # fmt: skip
                assert got.state == TaskState.TASK_STATE_COMPLETED, got.kinds
                kept = await follow(client.send_message(message("hello", context_id=other)))
                assert kept.state == TaskState.TASK_STATE_COMPLETED
            assert (tmp_path / "n").read_text() == f"{secret}\n"  # calc's tool ran
            [listed] = (await http.get("/v1/sessions", params={"label": f"case={secret}"})).json()[
                "sessions"
            ]
            assert (listed["session"], listed["title"], listed["turns"]) == (session, "to erase", 1)
            assert listed["last_turn"] == got.task_id and listed["last_end"] is not None
            assert listed["tokens"] > 0  # the LLM usage of its turn
            r = await http.post(f"/v1/sessions/{session}/cancel", json={"reason": secret})
            assert r.status_code == 202, r.text  # a control recorded for the session

            events = [e for e, _ in await stream_events(nc, "acme", session, subjects)]
            [child] = [e.call_id for e in events
                       if isinstance(e, ToolCallEvent) and e.server == "agents"]  # fmt: skip
            child_events = [e for e, _ in await stream_events(nc, "acme", child, subjects)]
            calls = {e.call_id for e in [*events, *child_events] if isinstance(e, ToolCallEvent)}
            assert child in calls and len(calls) >= 2
            needles = {session, child, got.task_id, secret, *calls}

            # another tenant neither sees nor erases it
            r = await http.delete(f"/v1/sessions/{session}", headers=auth(GLOBEX_KEY))
            assert r.status_code == 404
            r = await http.get("/v1/sessions", headers=auth(GLOBEX_KEY))
            assert session not in r.text
            async with httpx.AsyncClient(base_url=url) as anonymous:
                assert (await anonymous.delete(f"/v1/sessions/{session}")).status_code == 401
            assert (await http.get(f"/v1/sessions/{session}")).status_code == 200

            r = await http.delete(f"/v1/sessions/{session}")
            assert r.status_code == 200, r.text
            erased = r.json()
            assert erased["session"] == session and erased["children"] == [child]
            removed = erased["removed"]
            assert removed["events"] > 0 and removed["effects"] >= 1, removed
            assert removed["a2a_tasks"] >= 1 and removed["controls"] >= 1, removed

            assert (await http.get(f"/v1/sessions/{session}")).status_code == 404
            assert (await http.delete(f"/v1/sessions/{session}")).status_code == 404
            r = await http.get("/v1/sessions")
            assert r.status_code == 200, r.text
            listed = r.json()["sessions"]
            assert [s["session"] for s in listed] == [other]  # the other session stays

        stored = await everything_stored(nc, subjects)
        assert subjects.audit_stream in stored and f"KV_{subjects.a2a_tasks_bucket}" in stored
        for where, msgs in stored.items():
            for subject, raw in msgs:
                text = subject.encode() + b" " + raw
                found = sorted(n for n in needles if n.encode() in text)
                if where == subjects.audit_stream and set(found) == {session, child}:
                    assert b'"session_erased"' in raw and secret.encode() not in raw
                    continue
                assert not found, f"{where} {subject} still names {found}"
        [audit] = stored[subjects.audit_stream]
        assert audit[0] == subjects.audit("acme")
        # the other session, its task and events are all there
        assert any(other.encode() in s.encode() for s, _ in stored[subjects.events_stream_of(
            "acme", other)])  # fmt: skip


async def test_the_dead_letters_of_an_erased_sessions_turns_go_with_it(
    client: httpx.AsyncClient, nc: Client
):
    publisher = Publisher(nc)
    await publisher.start()
    for n, session in enumerate(["s1", "s2"], start=1):
        assert (await client.post("/v1/sessions", json={"session": session})).status_code == 201
        await record(
            publisher, SUBJECTS, stream=SUBJECTS.turns_stream, seq=n,
            subject=SUBJECTS.turn("acme", session), data=b'{"input": "poison"}',
            deliveries=5, reason="given up",
        )  # fmt: skip
    await publish(nc, 2, session="s1")
    r = await client.delete("/v1/sessions/s1")
    assert r.status_code == 200, r.text
    assert r.json()["removed"]["deadletter"] == 1 and r.json()["removed"]["events"] == 2
    left = [raw async for _, raw in stored_messages(nc, SUBJECTS.deadletter_stream)]
    assert len(left) == 1 and SUBJECTS.turn("acme", "s2").encode() in left[0]
    await publisher.close()
