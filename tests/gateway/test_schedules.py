"""``/v1/schedules``: create (each bad field named), list, read with the runs and what
became of them, pause, resume, delete; one tenant never sees another's, nor counts
against its ``[scheduler] max_per_tenant``. The gateway's own scheduler fires them (no
loop worker runs here: a run's turn stays in the stream)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import pytest
from nats.aio.client import Client

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.agents import apply_agents
from loopmesh.settings import NatsSettings, SchedulerSettings, TenantSettings
from loopmesh.testing.durable import SUBJECTS, wait_for
from schemas import AgentSpec, encode
from schemas.events import LoopEnd
from tests.gateway.conftest import ACME_KEY, API_POLL_S, GLOBEX_KEY, KEYS, GatewayFactory, auth
from tests.gateway.test_api import turns_in_stream

EVERY_SECOND = "* * * * * *"


async def test_a_bad_field_is_a_422_naming_it(client: httpx.AsyncClient) -> None:
    good = {"cron": "0 9 * * 1-5", "timezone": "Europe/Paris", "input": "report"}
    for change, field in [
        ({"cron": "0 25 * * *"}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"input": " "}, "input"),
        ({"agent": "nobody"}, "agent"),
        ({"id": "a.b"}, "id"),
        ({"session": "s 1"}, "session"),
        ({"catch_up_s": -5}, "catch_up_s"),
    ]:
        r = await client.post("/v1/schedules", json={**good, **change})
        assert r.status_code == 422, (change, r.text)
        assert r.json()["error"]["field"] == field, (change, r.json())
    r = await client.post("/v1/schedules", json={**good, "policy": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "policy"
    r = await client.post("/v1/schedules", json={**good, "when": "now"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "when"


@pytest.mark.parametrize(
    ("cron", "gap"),
    [
        (EVERY_SECOND, "1 s"),
        ("*/10 * * * * *", "10 s"),  # an interval written as a step
        ("0,30 * * * * *", "30 s"),  # and as a list
        ("0 0,59 * * * *", None),  # :59:00, then the next hour's :00:00: 60 s
        ("30,59 59 * * * *", "29 s"),  # :59:30 and :59:59 of every hour
        ("59 59 23 * * *", None),  # once a day
        ("0 * * * * *", None),  # every minute: the default minimum
        ("* * * * *", None),  # five fields: every minute too
    ],
)
async def test_a_schedule_firing_more_often_than_the_tenants_minimum_is_a_422_naming_it(
    client: httpx.AsyncClient, cron: str, gap: str | None
) -> None:
    r = await client.post("/v1/schedules", json={"cron": cron, "input": "x"})
    if gap is None:
        assert r.status_code == 201, r.text
        return
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "cron"
    assert f"ticks {gap} apart" in error["message"], error
    assert "min_schedule_interval_s = 60" in error["message"], error
    assert '[tenants."acme"]' in error["message"] and '[tenants."*"]' in error["message"]
    assert (await client.get("/v1/schedules")).json() == {"schedules": []}


async def test_the_minimum_between_ticks_is_each_tenants_setting(nats_url: str) -> None:
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
        scheduler=SchedulerSettings(enabled=False),
        tenants={
            "globex": TenantSettings(min_schedule_interval_s=7200),
            "*": TenantSettings(min_schedule_interval_s=0),
        },
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as acme,
        httpx.AsyncClient(base_url=gw.url, headers=auth(GLOBEX_KEY)) as globex,
    ):
        r = await acme.post("/v1/schedules", json={"cron": EVERY_SECOND, "input": "x"})
        assert r.status_code == 201, r.text  # "*": no minimum
        for cron, status in [
            ("0 0 */2 * * *", 201),  # every two hours
            ("0 0 */3 * * 1", 201),
            ("0 0 0,23 * * *", 422),  # 23:00 to the next day's 00:00: one hour
            ("0 0 0,23 * * 1", 201),  # on Mondays only: 23:00 to the next Monday
            ("0 0 0,23 * * 1,2", 422),  # Monday 23:00 to Tuesday 00:00
            ("0 0 0,23 1,L * *", 422),  # the month's last day, then the next one's first
            ("0 0 0,23 1 * *", 201),  # the first of the month only
        ]:
            r = await globex.post("/v1/schedules", json={"cron": cron, "input": "x"})
            assert r.status_code == status, (cron, r.text)
            if status == 422:
                assert "ticks 3600 s apart" in r.text, r.text
                assert "min_schedule_interval_s = 7200" in r.text


async def test_a_schedule_is_created_listed_read_paused_resumed_and_deleted(
    client: httpx.AsyncClient,
) -> None:
    body = {"id": "weekday", "cron": "0 9 * * 1-5", "timezone": "Europe/Paris", "input": "hi"}
    r = await client.post("/v1/schedules", json=body)
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["id"] == "weekday" and made["policy"] == "skip" and made["session"] is None
    assert made["priority"] == "batch"  # a schedule's turns, unless it says otherwise
    assert "09:00 on Monday through Friday" in made["explain"]  # cronsim's words
    assert made["next_tick"] > time.time() and made["runs"] == []
    r = await client.post("/v1/schedules", json=body)
    assert r.status_code == 409 and r.json()["error"]["field"] == "id"

    r = await client.get("/v1/schedules")
    assert [s["id"] for s in r.json()["schedules"]] == ["weekday"]
    r = await client.post("/v1/schedules/weekday/pause")
    assert r.status_code == 200 and r.json()["paused"] and r.json()["next_tick"] is None
    r = await client.post("/v1/schedules/weekday/resume")
    assert r.status_code == 200 and not r.json()["paused"]
    assert (await client.get("/v1/schedules/weekday")).json()["paused"] is False

    r = await client.delete("/v1/schedules/weekday")
    assert r.status_code == 204
    assert (await client.get("/v1/schedules/weekday")).status_code == 404
    assert (await client.delete("/v1/schedules/weekday")).status_code == 404
    assert (await client.post("/v1/schedules/weekday/pause")).status_code == 404
    assert (await client.get("/v1/schedules")).json() == {"schedules": []}


async def test_a_schedule_may_send_interactive_turns(client: httpx.AsyncClient) -> None:
    body = {"id": "now", "cron": "0 9 * * *", "input": "hi", "priority": "interactive"}
    r = await client.post("/v1/schedules", json=body)
    assert r.status_code == 201, r.text
    assert (await client.get("/v1/schedules/now")).json()["priority"] == "interactive"


async def test_a_tenant_sees_only_its_own_schedules(client, gateway) -> None:
    r = await client.post("/v1/schedules", json={"id": "mine", "cron": "0 0 * * *", "input": "x"})
    assert r.status_code == 201
    async with httpx.AsyncClient(base_url=gateway.url, headers=auth(GLOBEX_KEY)) as other:
        assert (await other.get("/v1/schedules")).json() == {"schedules": []}
        assert (await other.get("/v1/schedules/mine")).status_code == 404
        assert (await other.delete("/v1/schedules/mine")).status_code == 404
        r = await other.post(
            "/v1/schedules", json={"id": "mine", "cron": "0 0 * * *", "input": "y"}
        )
        assert r.status_code == 201  # the same id in another tenant is another schedule


async def test_past_max_per_tenant_a_create_is_a_429_naming_the_setting(nats_url: str) -> None:
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
        scheduler=SchedulerSettings(enabled=False, max_per_tenant=2),
    )
    body = {"cron": "0 0 * * *", "input": "x"}
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as acme,
        httpx.AsyncClient(base_url=gw.url, headers=auth(GLOBEX_KEY)) as globex,
    ):
        for id in ("a", "b"):
            assert (await acme.post("/v1/schedules", json={**body, "id": id})).status_code == 201
        r = await acme.post("/v1/schedules", json={**body, "id": "c"})
        assert r.status_code == 429 and "retry-after" not in r.headers  # waiting will not help
        assert r.json() == {
            "error": {
                "code": "quota_exceeded",
                "message": "tenant acme has 2 schedule(s), the most allowed ([scheduler] "
                "max_per_tenant = 2): delete one first",
            }
        }
        r = await acme.post("/v1/schedules", json={**body, "id": "a"})
        assert r.status_code == 409  # an id taken is said first
        assert (await acme.post("/v1/schedules/a/pause")).status_code == 200
        assert (await globex.post("/v1/schedules", json=body)).status_code == 201
        assert (await acme.delete("/v1/schedules/b")).status_code == 204
        assert (await acme.post("/v1/schedules", json={**body, "id": "c"})).status_code == 201


async def test_a_session_of_another_agent_is_refused(client: httpx.AsyncClient, nc: Client):
    await apply_agents(nc.jetstream(), SUBJECTS, [AgentSpec(name="calc")])
    assert (await client.post("/v1/sessions", json={"session": "s1"})).status_code == 201
    body = {"cron": "0 0 * * *", "input": "x", "session": "s1", "agent": "calc"}
    r = await client.post("/v1/schedules", json=body)
    assert r.status_code == 422 and r.json()["error"]["field"] == "session"
    r = await client.post("/v1/schedules", json={**body, "session": "s2"})
    assert r.status_code == 201  # a new session is made for the agent
    assert (await client.get("/v1/sessions/s2")).json()["agent"] == "calc"


@pytest.fixture
async def every_second(gateway_at: GatewayFactory) -> AsyncIterator[httpx.AsyncClient]:
    """Tenant acme's client of a gateway whose tenants' schedules may tick every second."""
    no_minimum = {"*": TenantSettings(min_schedule_interval_s=0)}
    async with (
        gateway_at(tenants=no_minimum) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as client,
    ):
        yield client


async def test_runs_are_listed_with_what_became_of_them(
    every_second: httpx.AsyncClient, nc: Client, nats_url: str
):
    client = every_second
    body = {"id": "often", "cron": EVERY_SECOND, "input": "tick", "session": "s1"}
    r = await client.post("/v1/schedules", json=body)
    assert r.status_code == 201

    async def runs() -> list[dict]:
        r = await client.get("/v1/schedules/often")
        assert r.status_code == 200, r.text
        return r.json()["runs"]

    async def fired() -> bool:
        return any(r["outcome"] == "fired" and r["published"] for r in await runs())

    await wait_for(fired, timeout=15, what="a run", every=API_POLL_S)
    first = next(r for r in await runs() if r["outcome"] == "fired")
    assert first["end"] is None and first["session"] == "s1"
    assert [t.id for t, _ in await turns_in_stream(nats_url)] == [first["turn_id"]]

    async def skipped() -> bool:  # policy skip: the run has not ended
        return any(r["outcome"] == "skipped" for r in await runs())

    await wait_for(skipped, timeout=15, what="a skipped tick", every=API_POLL_S)
    end = LoopEnd(tenant="acme", session="s1", turn_id=first["turn_id"], reason="task_completion")
    await nc.jetstream().publish(SUBJECTS.event("acme", "s1", "loop_end"), encode(end))

    async def ended() -> bool:
        return any(r["end"] == "task_completion" for r in await runs())

    await wait_for(ended, timeout=15, what="the run's end", every=API_POLL_S)
    assert (await client.post("/v1/schedules/often/pause")).status_code == 200
    listed = (await client.get("/v1/schedules")).json()["schedules"]
    assert len(listed[0]["runs"]) == 1 and listed[0]["runs"][0]["end"] is None
