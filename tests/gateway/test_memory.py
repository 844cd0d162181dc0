"""``/v1/memory`` against a real nats-server: a user's (or an agent's) memories are
added, listed, deleted one by one and erased together; input is checked; one tenant
never sees or erases another's."""

from __future__ import annotations

import httpx
from nats.aio.client import Client

from loopmesh.kv import kv_values
from loopmesh.testing.durable import SUBJECTS
from schemas.memory import MAX_MEMORY_CHARS
from tests.gateway.conftest import GLOBEX_KEY, auth


async def test_memories_are_added_listed_deleted_and_erased(
    client: httpx.AsyncClient, nc: Client
) -> None:
    added = []
    for text in ("Ada likes teal.", "Ada plays the cello."):
        r = await client.post("/v1/memory", json={"user": "ada", "text": text})
        assert r.status_code == 201, r.text
        added.append(r.json())
    assert added[0]["kind"] == "user" and added[0]["name"] == "ada"
    assert added[0]["source"] == {"by": "api"} and "vector" not in added[0]
    r = await client.post("/v1/memory", json={"agent": "friend", "text": "I am kind."})
    assert r.status_code == 201
    r = await client.get("/v1/memory", params={"user": "ada"})
    assert [m["text"] for m in r.json()["memories"]] == ["Ada likes teal.", "Ada plays the cello."]

    r = await client.delete(f"/v1/memory/{added[0]['id']}", params={"user": "ada"})
    assert r.status_code == 204
    r = await client.delete(f"/v1/memory/{added[0]['id']}", params={"user": "ada"})
    assert r.status_code == 404
    r = await client.get("/v1/memory", params={"user": "ada"})
    assert [m["text"] for m in r.json()["memories"]] == ["Ada plays the cello."]

    r = await client.delete("/v1/memory", params={"user": "ada"})
    assert r.status_code == 200 and r.json() == {"erased": 1}
    assert (await client.get("/v1/memory", params={"user": "ada"})).json() == {"memories": []}
    left = await kv_values(nc.jetstream(), SUBJECTS.memory_bucket)
    assert [k for k in left if ".user.ada." in k] == []
    assert len(left) == 1  # the agent's memory stays


async def test_bad_requests_say_what_is_wrong(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/memory")
    assert r.status_code == 422 and "exactly one of `user` and `agent`" in r.text
    r = await client.get("/v1/memory", params={"user": "ada", "agent": "friend"})
    assert r.status_code == 422
    r = await client.get("/v1/memory", params={"user": "a b"})
    assert r.status_code == 422 and "invalid user" in r.text
    r = await client.post("/v1/memory", json={"user": "ada", "text": ""})
    assert r.status_code == 400 and "text" in r.text
    r = await client.post("/v1/memory", json={"user": "ada", "text": "x" * (MAX_MEMORY_CHARS + 1)})
    assert r.status_code == 400
    r = await client.post("/v1/memory", json={"user": "ada", "text": "hi", "vector": "AA=="})
    assert r.status_code == 400 and "vector" in r.text


async def test_a_tenant_never_reaches_another_tenants_memories(
    client: httpx.AsyncClient, gateway
) -> None:
    r = await client.post("/v1/memory", json={"user": "ada", "text": "Ada likes teal."})
    memory = r.json()["id"]
    async with httpx.AsyncClient(base_url=gateway.url, headers=auth(GLOBEX_KEY)) as globex:
        assert (await globex.get("/v1/memory", params={"user": "ada"})).json() == {"memories": []}
        r = await globex.delete(f"/v1/memory/{memory}", params={"user": "ada"})
        assert r.status_code == 404
        r = await globex.delete("/v1/memory", params={"user": "ada"})
        assert r.json() == {"erased": 0}
    r = await client.get("/v1/memory", params={"user": "ada"})
    assert [m["id"] for m in r.json()["memories"]] == [memory]
    async with httpx.AsyncClient(base_url=gateway.url) as anonymous:
        r = await anonymous.get("/v1/memory", params={"user": "ada"})
    assert r.status_code == 401
