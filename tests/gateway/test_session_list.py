"""``GET /v1/sessions`` filtered by agent, labels and last activity, paged with a cursor;
a session's title and labels set at creation and with ``PATCH``; their checks (422
naming the field) and another tenant's key, and the erase on the tenant's audit records
(``GET /v1/audit``), against a real nats-server."""

from __future__ import annotations

import httpx
from nats.aio.client import Client

from loopmesh.agents import apply_agents
from loopmesh.testing.durable import SUBJECTS
from schemas import AgentSpec
from tests.gateway.conftest import GLOBEX_KEY, auth


async def listed(client: httpx.AsyncClient, **params: object) -> list[str]:
    r = await client.get("/v1/sessions", params=params)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return [s["session"] for s in r.json()["sessions"]]


async def test_sessions_are_filtered_by_agent_labels_and_activity(
    client: httpx.AsyncClient, nc: Client
):
    await apply_agents(nc.jetstream(), SUBJECTS, [AgentSpec(name="calc")])
    made = [
        ("s1", None, {"team": "red"}),
        ("s2", "calc", {"team": "blue", "case": "42"}),
        ("s3", "calc", {}),
        ("s4", None, {"team": "red", "case": "7"}),
    ]
    for session, agent, labels in made:
        body = {"session": session, "agent": agent, "labels": labels, "title": f"about {session}"}
        assert (await client.post("/v1/sessions", json=body)).status_code == 201

    assert await listed(client) == ["s4", "s3", "s2", "s1"]  # most recently active first
    assert await listed(client, agent="calc") == ["s3", "s2"]
    assert await listed(client, label="team=red") == ["s4", "s1"]
    assert await listed(client, label="case") == ["s4", "s2"]  # any value
    r = await client.get("/v1/sessions", params=[("label", "team=red"), ("label", "case=7")])
    assert [s["session"] for s in r.json()["sessions"]] == ["s4"]
    assert await listed(client, agent="calc", label="team=red") == []

    sessions = {s["session"]: s for s in (await client.get("/v1/sessions")).json()["sessions"]}
    s2 = sessions["s2"]
    assert s2["title"] == "about s2" and s2["labels"] == {"team": "blue", "case": "42"}
    assert (s2["turns"], s2["tokens"], s2["last_turn"], s2["status"]) == (0, 0, None, "idle")
    since = sessions["s3"]["updated_at"]
    assert await listed(client, active_after=since) == ["s4", "s3"]
    assert await listed(client, active_before=since) == ["s2", "s1"]


async def test_a_list_is_paged_with_its_cursor(client: httpx.AsyncClient):
    for n in range(7):
        assert (await client.post("/v1/sessions", json={"session": f"p{n}"})).status_code == 201
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        body = (await client.get("/v1/sessions", params=params)).json()
        seen += [s["session"] for s in body["sessions"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert pages == 3 and seen == [f"p{n}" for n in reversed(range(7))]


async def test_patch_sets_a_title_and_replaces_the_labels(client: httpx.AsyncClient):
    body = {"session": "s1", "labels": {"a": "1"}}
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    r = await client.patch("/v1/sessions/s1", json={"title": "Quarterly numbers"})
    assert r.status_code == 200, r.text
    assert (r.json()["title"], r.json()["labels"]) == ("Quarterly numbers", {"a": "1"})
    r = await client.patch("/v1/sessions/s1", json={"labels": {"b": "2"}})
    assert (r.json()["title"], r.json()["labels"]) == ("Quarterly numbers", {"b": "2"})
    view = (await client.get("/v1/sessions/s1")).json()
    assert (view["title"], view["labels"]) == ("Quarterly numbers", {"b": "2"})
    assert await listed(client, label="b=2") == ["s1"]
    assert await listed(client, label="a") == []


async def test_bad_filters_titles_and_labels_are_refused_naming_the_field(
    client: httpx.AsyncClient,
):
    assert (await client.post("/v1/sessions", json={"session": "s1"})).status_code == 201
    for params, field in [
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "2.5"}, "limit"),
        ({"active_after": "soon"}, "active_after"),
        ({"active_before": "-1"}, "active_before"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"agent": "a b"}, "agent"),
        ({"label": "no spaces=1"}, "label"),
        ({"label": "k=" + "v" * 257}, "label"),
    ]:
        r = await client.get("/v1/sessions", params=params)
        assert r.status_code == 422, (params, r.text)
        assert r.json()["error"]["field"] == field, (params, r.text)
    for body, field in [
        ({"title": "t" * 201}, "title"),
        ({"labels": {"bad key": "1"}}, "labels.bad key"),
        ({"labels": {f"k{n}": "v" for n in range(33)}}, "labels"),
    ]:
        r = await client.patch("/v1/sessions/s1", json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["field"] == field
        r = await client.post("/v1/sessions", json={"session": "s2", **body})
        assert r.status_code == 422 and r.json()["error"]["field"] == field
    r = await client.patch("/v1/sessions/s1", json={"colour": "red"})
    assert r.status_code == 400  # an unknown field
    r = await client.patch("/v1/sessions/nobody", json={"title": "x"})
    assert r.status_code == 404
    r = await client.patch("/v1/sessions/no.way", json={"title": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "session"
    r = await client.delete("/v1/sessions/no.way")
    assert r.status_code == 422 and r.json()["error"]["field"] == "session"


async def test_another_tenants_key_neither_lists_nor_changes_nor_erases_a_session(
    client: httpx.AsyncClient,
):
    body = {"session": "s1", "title": "acme's", "labels": {"k": "v"}}
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    globex = auth(GLOBEX_KEY)
    assert (await client.get("/v1/sessions", headers=globex)).json()["sessions"] == []
    r = await client.patch("/v1/sessions/s1", json={"title": "mine"}, headers=globex)
    assert r.status_code == 404
    assert (await client.delete("/v1/sessions/s1", headers=globex)).status_code == 404
    view = (await client.get("/v1/sessions/s1")).json()
    assert view["title"] == "acme's"
    r = await client.delete("/v1/sessions/s1")
    assert r.status_code == 200 and r.json()["children"] == []
    assert await listed(client) == []
    # the erase is on acme's audit record, which globex does not see
    [record] = (await client.get("/v1/audit")).json()["records"]
    assert (record["type"], record["session"], record["reason"]) == (
        "session_erased",
        "s1",
        "request",
    )
    assert record["by"] == "key acme-ci" and record["removed"]["sessions"] >= 2
    assert (await client.get("/v1/audit", headers=globex)).json() == {"records": []}
    r = await client.get("/v1/audit", params={"limit": 0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "limit"
