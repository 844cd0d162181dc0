"""Retention: idle sessions expire, by their tenant's ``[tenants]`` setting or their
agent's own. ``snapshot`` keeps the last snapshot (and its title and labels) and erases
the events; ``delete`` erases the session. Each expiry is audited once, even though the
gateway sweeps again and again; a tenant without retention keeps its sessions. On a real
nats-server, with a retention of a second and a sweep every fifth of one."""

from __future__ import annotations

import httpx
import msgspec
from nats.aio.client import Client

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.agents import apply_agents
from loopmesh.kv import kv_values
from loopmesh.settings import NatsSettings, TenantSettings
from loopmesh.testing.durable import SUBJECTS, stream_events, wait_for
from schemas import AgentSpec
from schemas.audit import SessionErased
from tests.gateway.conftest import ACME_KEY, API_POLL_S, GLOBEX_KEY, KEYS, auth, publish
from tests.gateway.test_erase import stored_messages

EPHEMERAL = AgentSpec(name="ephemeral", session_retention_s=1.0, retention="delete")


async def audited(nc: Client) -> list[SessionErased]:
    return [
        msgspec.json.decode(raw[raw.index(b"{") :], type=SessionErased)
        async for _, raw in stored_messages(nc, SUBJECTS.audit_stream)
    ]


async def test_idle_sessions_expire_to_their_snapshot_or_are_deleted(nats_url: str, nc: Client):
    await apply_agents(nc.jetstream(), SUBJECTS, [EPHEMERAL])
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS, retention_sweep_s=0.2),
        tenants={"acme": TenantSettings(session_retention_s=1.0, retention="snapshot")},
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as acme,
        httpx.AsyncClient(base_url=gw.url, headers=auth(GLOBEX_KEY)) as globex,
    ):
        assert gw.retention is not None
        made = [
            (acme, {"session": "kept", "title": "Kept", "labels": {"k": "v"}}),
            (acme, {"session": "gone", "agent": "ephemeral"}),
            (globex, {"session": "forever"}),
        ]
        for client, body in made:
            assert (await client.post("/v1/sessions", json=body)).status_code == 201
        await publish(nc, 3, session="kept")
        await publish(nc, 3, session="gone")
        await publish(nc, 3, tenant="globex", session="forever")

        async def both_expired() -> bool:
            kept = (await acme.get("/v1/sessions")).json()["sessions"]
            return [(s["session"], s["expired"]) for s in kept] == [("kept", True)]

        await wait_for(both_expired, timeout=30, every=API_POLL_S, what="both to expire")
        assert (await acme.get("/v1/sessions/gone")).status_code == 404
        view = (await acme.get("/v1/sessions/kept")).json()
        assert (view["title"], view["labels"]) == ("Kept", {"k": "v"})
        assert await stream_events(nc, "acme", "kept") == []
        assert await stream_events(nc, "acme", "gone") == []
        assert len(await stream_events(nc, "globex", "forever")) == 3
        assert (await globex.get("/v1/sessions/forever")).status_code == 200

        sweeps = gw.retention.sweeps
        await wait_for(lambda: gw.retention.sweeps >= sweeps + 3, timeout=30, what="3 sweeps")
        records = {r.session: r for r in await audited(nc)}
        assert len(await audited(nc)) == 2  # each expiry once
        assert (records["kept"].mode, records["kept"].reason) == ("snapshot", "retention")
        assert (records["gone"].mode, records["gone"].by) == ("delete", "retention")
        assert records["kept"].removed["events"] == 3


async def test_memories_older_than_their_tenants_retention_are_erased(nats_url: str, nc: Client):
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS, retention_sweep_s=0.2),
        tenants={"acme": TenantSettings(memory_retention_s=1.0)},
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as acme,
        httpx.AsyncClient(base_url=gw.url, headers=auth(GLOBEX_KEY)) as globex,
    ):
        for client in (acme, globex):
            r = await client.post("/v1/memory", json={"user": "ada", "text": "Ada keeps bees."})
            assert r.status_code == 201

        async def forgotten() -> bool:
            return (await acme.get("/v1/memory", params={"user": "ada"})).json()["memories"] == []

        await wait_for(forgotten, timeout=20, every=API_POLL_S, what="acme's memory to expire")
        # the bucket keeps nothing of it; globex, with no retention, keeps its own
        left = await kv_values(nc.jetstream(), SUBJECTS.memory_bucket)
        assert [k.split(".")[0] for k in left] == ["globex"]
        kept = (await globex.get("/v1/memory", params={"user": "ada"})).json()["memories"]
        assert [m["text"] for m in kept] == ["Ada keeps bees."]
