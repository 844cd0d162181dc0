"""A turn that waits says so: the gateway accepts a turn behind turns of its tenant that
no loop worker holds yet with a ``turn_queued`` event naming how many are ahead; its
``turn_accepted`` follows once a loop worker takes it. Another tenant's turns are not
counted. Against a real nats-server, gateway and loop worker."""

from __future__ import annotations

import httpx

from loopmesh.testing.durable import stream_events, wait_for
from schemas.events import LoopEnd, TurnQueued
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, KEYS, auth
from tests.loop_worker.durable import gateway_on, mesh_on


async def types(nc, tenant: str, session: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [e.type for e, _ in await stream_events(nc, tenant, session)]


async def test_a_turn_behind_its_tenants_waiting_turns_says_how_many_are_ahead(nats_server):
    async with (
        mesh_on(nats_server.url) as mesh,
        gateway_on(mesh.url, api_keys=KEYS) as gw,
        httpx.AsyncClient(base_url=gw.url) as c,
    ):
        for session in ("s1", "s2", "s3"):  # no loop worker runs yet: they wait
            r = await c.post(
                f"/v1/sessions/{session}/turns", json={"input": "hi"}, headers=auth(ACME_KEY)
            )
            assert r.status_code == 202, r.text
        r = await c.post("/v1/sessions/g1/turns", json={"input": "hi"}, headers=auth(GLOBEX_KEY))
        assert r.status_code == 202
        assert await types(mesh.nc, "acme", "s1") == []  # nothing ahead of it
        queued = [e for e, _ in await stream_events(mesh.nc, "acme", "s3")]
        assert len(queued) == 1 and isinstance(queued[0], TurnQueued) and queued[0].ahead == 2
        [second] = [e for e, _ in await stream_events(mesh.nc, "acme", "s2")]
        assert isinstance(second, TurnQueued) and second.ahead == 1
        assert await types(mesh.nc, "globex", "g1") == []  # acme's turns are not globex's

        await mesh.loop_worker()

        async def ended() -> bool:
            return "loop_end" in await types(mesh.nc, "acme", "s3")

        await wait_for(ended, timeout=30, what="the queued turn to run")
        events = [e for e, _ in await stream_events(mesh.nc, "acme", "s3")]
        assert [e.type for e in events][:2] == ["turn_queued", "turn_accepted"]
        assert isinstance(events[-1], LoopEnd) and events[-1].turn_id == events[0].turn_id
