"""The gateway's named agents: ``GET /v1/agents``, ``GET /v1/agents/{agent}``, sessions
created for an agent, and turns that name one, against a real nats-server."""

from __future__ import annotations

from typing import Any

import httpx
from nats.aio.client import Client

from loopmesh.agents import apply_agents
from loopmesh.testing.durable import SUBJECTS
from schemas import AgentSpec
from tests.gateway.test_api import turns_in_stream

CALC = AgentSpec(
    name="calc",
    description="Does arithmetic with the calculator tool.",
    instructions="You are a careful calculator.",
    tools=("local.calculator",),
)


async def test_the_default_agent_is_listed_before_any_is_provisioned(client: httpx.AsyncClient):
    r = await client.get("/v1/agents")
    assert r.status_code == 200, r.text
    [default] = r.json()["agents"]
    assert default["name"] == "default" and default["revision"] == 0
    assert default["instructions"] is None  # null: the deployment's [loop]
    r = await client.get("/v1/agents/default")
    assert r.status_code == 200 and r.json() == default


async def test_agents_are_listed_and_read_with_their_revisions(
    client: httpx.AsyncClient, nc: Client
):
    await apply_agents(nc.jetstream(), SUBJECTS, [CALC])
    r = await client.get("/v1/agents")
    assert r.status_code == 200
    agents = {a["name"]: a for a in r.json()["agents"]}
    assert list(agents) == ["default", "calc"]
    calc = agents["calc"]
    assert calc["description"] == CALC.description and calc["tools"] == ["local.calculator"]
    assert calc["revision"] > 0 and agents["default"]["revision"] > 0

    r = await client.get("/v1/agents/calc")
    assert r.status_code == 200 and r.json() == calc
    r = await client.get("/v1/agents/nobody")
    assert r.status_code == 404 and "no agent 'nobody'" in r.json()["error"]["message"]
    r = await client.get("/v1/agents/no.way")
    assert r.status_code == 422 and r.json()["error"]["field"] == "agent"


async def test_a_session_created_for_an_agent_runs_its_turns_as_that_agent(
    client: httpx.AsyncClient, nc: Client, nats_url: str
):
    await apply_agents(nc.jetstream(), SUBJECTS, [CALC])
    r = await client.post("/v1/sessions", json={"session": "s1", "agent": "calc"})
    assert r.status_code == 201, r.text
    assert r.json() == {"tenant": "acme", "session": "s1", "agent": "calc"}
    assert (await client.get("/v1/sessions/s1")).json()["agent"] == "calc"
    [listed] = (await client.get("/v1/sessions")).json()["sessions"]
    assert listed["agent"] == "calc"

    # a turn that names no agent runs the session's (its worker reads the snapshot)
    r = await client.post("/v1/sessions/s1/turns", json={"input": "2+2?"})
    assert r.status_code == 202, r.text
    r = await client.post("/v1/sessions/s2/turns", json={"input": "3+3?", "agent": "calc"})
    assert r.status_code == 202, r.text
    turns = [t for t, _ in await turns_in_stream(nats_url)]
    assert [(t.session, t.agent) for t in turns] == [("s1", None), ("s2", "calc")]
    # a session a turn creates belongs to the turn's agent
    assert (await client.get("/v1/sessions/s2")).json()["agent"] == "calc"


async def test_an_agent_nobody_defined_is_refused_naming_the_field(client: httpx.AsyncClient):
    r = await client.post("/v1/sessions", json={"session": "s1", "agent": "nobody"})
    assert r.status_code == 422
    error: dict[str, Any] = r.json()["error"]
    assert error["field"] == "agent" and "no agent 'nobody' is defined" in error["message"]
    r = await client.post("/v1/sessions/s1/turns", json={"input": "hi", "agent": "nobody"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "agent"
    r = await client.post("/v1/sessions/s1/turns", json={"input": "hi", "agent": "a b"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "agent"
    assert (await client.get("/v1/sessions/s1")).status_code == 404  # nothing was created


async def test_the_agents_endpoints_need_a_key_and_are_in_the_openapi_document(
    gateway: Any,
):
    async with httpx.AsyncClient(base_url=gateway.url) as anonymous:
        assert (await anonymous.get("/v1/agents")).status_code == 401
        assert (await anonymous.get("/v1/agents/default")).status_code == 401
        spec = (await anonymous.get("/openapi.json")).json()
    assert spec["paths"]["/v1/agents"]["get"]["tags"] == ["agents"]
    assert "404" in spec["paths"]["/v1/agents/{agent}"]["get"]["responses"]
    assert "agent" in spec["components"]["schemas"]["PostTurn"]["properties"]
    assert "agent" in spec["components"]["schemas"]["CreateSession"]["properties"]
