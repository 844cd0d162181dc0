"""Auth, tenant isolation and every limit, each with its status code and message."""

from __future__ import annotations

import logging

import httpx
import pytest

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.errors import ConfigError
from loopmesh.settings import NatsSettings, TenantSettings
from loopmesh.testing.durable import connect_fast, provision_short, tenant_consumer_of
from schemas import Subjects
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, KEYS, auth

SUBJECTS = Subjects()


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


async def turns_stored(url: str) -> int:
    nc = await connect_fast(url)
    try:
        return (await nc.jetstream().stream_info(SUBJECTS.turns_stream)).state.messages
    finally:
        await nc.close()


# -- keys and tenants -------------------------------------------------------------------


async def test_an_unknown_or_malformed_key_is_refused(gateway):
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.get("/v1/sessions", headers=auth("not-a-key"))
        assert r.status_code == 401 and error(r) == {
            "code": "unauthorized", "message": "unknown API key"
        }  # fmt: skip
        r = await c.get("/v1/sessions", headers={"Authorization": f"Basic {ACME_KEY}"})
        assert r.status_code == 401
        assert error(r)["message"] == "malformed Authorization header: use `Bearer <key>`"


async def test_a_key_never_sees_another_tenants_sessions(gateway, nats_url):
    url = gateway.url
    async with httpx.AsyncClient(base_url=url, headers=auth(ACME_KEY)) as acme, \
            httpx.AsyncClient(base_url=url, headers=auth(GLOBEX_KEY)) as globex:  # fmt: skip
        assert (await globex.post("/v1/sessions", json={"session": "theirs"})).status_code == 201
        assert (await acme.get("/v1/sessions")).json() == {"sessions": [], "next_cursor": None}
        not_found = {"code": "not_found", "message": "no session 'theirs'"}
        for method, path, body in [
            ("GET", "/v1/sessions/theirs", None),
            ("GET", "/v1/sessions/theirs/events", None),
            ("POST", "/v1/sessions/theirs/cancel", {}),
            ("POST", "/v1/sessions/theirs/pause", {}),
            ("POST", "/v1/sessions/theirs/resume", {}),
            ("POST", "/v1/sessions/theirs/approvals/c1", {"approve": True}),
            ("PATCH", "/v1/sessions/theirs", {"title": "mine now"}),
            ("DELETE", "/v1/sessions/theirs", None),
        ]:
            r = await acme.request(method, path, json=body)
            assert (r.status_code, error(r)) == (404, not_found), path
        # a turn posted to the same name is acme's own session, on acme's subject
        r = await acme.post("/v1/sessions/theirs/turns", json={"input": "hi"})
        assert r.status_code == 202
        nc = await connect_fast(nats_url)
        try:
            msg = await nc.jetstream().get_last_msg(SUBJECTS.turns_stream, "loopmesh.turns.>")
            assert msg.subject == "loopmesh.turns.acme.theirs"
        finally:
            await nc.close()
        theirs = (await globex.get("/v1/sessions/theirs")).json()
        assert theirs["tenant"] == "globex" and theirs["turns"] == 0
        assert [s["session"] for s in (await globex.get("/v1/sessions")).json()["sessions"]] == [
            "theirs"
        ]


async def test_no_auth_mode_makes_every_request_tenant_local_and_says_so(gateway_at, caplog):
    caplog.set_level(logging.WARNING, logger="loopmesh.gateway")
    async with gateway_at(no_auth=True) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/sessions", json={"session": "s1"})
        assert r.status_code == 201
        assert r.json() == {"tenant": "local", "session": "s1", "agent": "default"}
    assert any("NO-AUTH mode" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"no_auth": True, "host": "0.0.0.0"}, "not a loopback address"),
        ({"no_auth": True, "host": "10.1.2.3"}, "not a loopback address"),
        ({}, "no api_keys configured"),
        ({"no_auth": True, "api_keys": KEYS}, "pick one"),
    ],
)
def test_unsafe_auth_settings_are_refused(settings, message):
    config = GatewayConfig(
        nats=NatsSettings(url="nats://127.0.0.1:1"), gateway=GatewaySettings(**settings)
    )
    with pytest.raises(ConfigError, match=message):
        GatewayServer(config)


def test_no_auth_on_another_host_needs_a_second_explicit_setting():
    settings = GatewaySettings(no_auth=True, host="0.0.0.0", no_auth_any_host=True)
    GatewayServer(GatewayConfig(gateway=settings))  # accepted


# -- limits -----------------------------------------------------------------------------


async def test_a_body_over_the_size_limit_is_413(gateway_at):
    async with (
        gateway_at(max_body_bytes=1000) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x" * 2000})
        assert r.status_code == 413
        assert error(r) == {
            "code": "payload_too_large",
            "message": f"body of {len(r.request.content)} bytes is over the limit of 1000 bytes",
        }

        async def chunked():  # no Content-Length: counted as it arrives
            for _ in range(20):
                yield b"x" * 100

        r = await c.post("/v1/sessions/s1/turns", content=chunked())
        assert r.status_code == 413
        assert error(r)["message"] == "body is over the limit of 1000 bytes"


async def test_input_over_its_length_limit_is_422_naming_the_field(gateway_at):
    async with (
        gateway_at(max_input_chars=10, max_instructions_chars=5) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x" * 11})
        assert r.status_code == 422 and error(r) == {
            "code": "invalid", "field": "input",
            "message": "`input` is 11 characters, over the limit of 10",
        }  # fmt: skip
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x", "instructions": "y" * 6})
        assert (r.status_code, error(r)["field"]) == (422, "instructions")
        r = await c.post("/v1/sessions/s1/turns", json={"input": "  "})
        assert (r.status_code, error(r)["message"]) == (422, "`input` must not be empty")
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x", "max_iterations": 0})
        assert (r.status_code, error(r)["field"]) == (422, "max_iterations")
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x", "planner_model": "a b"})
        assert (r.status_code, error(r)["field"]) == (422, "planner_model")
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x", "executor_model": " "})
        assert (r.status_code, error(r)["field"]) == (422, "executor_model")
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x", "mode": "swarm"})
        assert r.status_code == 400
        r = await c.post("/v1/sessions/s1/turns", json={"input": "x", "tools": ["ok", "a.b.c"]})
        assert (r.status_code, error(r)["field"]) == (422, "tools[1]")


@pytest.mark.parametrize(
    ("body", "message", "field"),
    [
        (b"{not json", "body is not valid JSON: JSON is malformed: object keys must be strings "
         "(byte 1)", None),
        (b'{"input": 5}', "invalid body: Expected `str`, got `int` - at `$.input`", "input"),
        (b'{"input": "x", "tools": ["a", 3]}',
         "invalid body: Expected `str`, got `int` - at `$.tools[1]`", "tools[1]"),
        (b'{"input": "x", "extra": 1}', "invalid body: Object contains unknown field `extra`",
         "extra"),
        (b"{}", "invalid body: Object missing required field `input`", "input"),
        (b"[]", "invalid body: Expected `object`, got `array`", None),
    ],
)  # fmt: skip
async def test_bad_json_is_400_with_the_path_of_the_bad_field(client, body, message, field):
    r = await client.post(
        "/v1/sessions/s1/turns", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    expected = {"code": "bad_request", "message": message}
    if field is not None:
        expected["field"] = field
    assert error(r) == expected


HOSTILE = ["a.b", "*", ">", "a b", "x" * 65, "loopmesh.turns.>"]


@pytest.mark.parametrize("bad", HOSTILE)
async def test_hostile_ids_are_422_and_never_a_subject(client, nats_url, bad):
    quoted = httpx.URL("/v1/sessions/").join(bad.replace(" ", "%20").replace(">", "%3E")).path
    r = await client.post(f"{quoted}/turns", json={"input": "x"})
    assert r.status_code == 422, r.text
    assert error(r)["field"] == "session"
    assert "must be 1-64 characters from A-Z a-z 0-9 _ -" in error(r)["message"]
    r = await client.post(
        "/v1/sessions/ok/turns", json={"input": "x"}, headers={"Idempotency-Key": bad}
    )
    assert (r.status_code, error(r)["field"]) == (422, "Idempotency-Key")
    r = await client.post("/v1/sessions", json={"session": bad})
    assert (r.status_code, error(r)["field"]) == (422, "session")
    r = await client.get("/v1/sessions/ok/events", params={"turn": bad})
    assert (r.status_code, error(r)["field"]) == (422, "turn")
    r = await client.post(
        f"/v1/sessions/ok/approvals/{quoted.rsplit('/', 1)[1]}", json={"approve": True}
    )
    assert (r.status_code, error(r)["field"]) == (422, "call_id")
    assert await turns_stored(nats_url) == 0


async def test_a_hostile_call_id_is_422(client):
    await client.post("/v1/sessions", json={"session": "ok"})
    r = await client.post("/v1/sessions/ok/approvals/a.b", json={"approve": True})
    assert (r.status_code, error(r)["field"]) == (422, "call_id")


async def test_sequences_must_be_numbers(client):
    await client.post("/v1/sessions", json={"session": "ok"})
    r = await client.get("/v1/sessions/ok/events", params={"since": "-1"})
    assert (r.status_code, error(r)) == (422, {
        "code": "invalid", "field": "since", "message": "`since` must be a non-negative integer"
    })  # fmt: skip
    r = await client.get("/v1/sessions/ok/events", headers={"Last-Event-ID": "x"})
    assert (r.status_code, error(r)["field"]) == (422, "Last-Event-ID")


async def test_the_rate_limit_is_per_key_and_says_when_to_retry(gateway_at):
    async with (
        gateway_at(rate_per_s=0.5, rate_burst=2) as gw,
        httpx.AsyncClient(base_url=gw.url) as c,
    ):
        for _ in range(2):
            assert (await c.get("/v1/sessions", headers=auth(ACME_KEY))).status_code == 200
        r = await c.get("/v1/sessions", headers=auth(ACME_KEY))
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        assert error(r)["code"] == "rate_limited"
        assert error(r)["message"].startswith(
            "rate limit of 0.5 requests/s (burst 2) exceeded for this key; retry in "
        )
        assert (await c.get("/v1/sessions", headers=auth(GLOBEX_KEY))).status_code == 200


async def test_a_tenant_with_its_backlog_full_is_refused_and_nothing_is_published(nats_server):
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    config = GatewayConfig(
        nats=NatsSettings(url=nats_server.url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
        tenants={"acme": TenantSettings(max_backlog=2)},
    )
    async with GatewayServer(config) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        for i in range(2):  # no loop worker runs: the turns wait
            r = await c.post(
                f"/v1/sessions/s{i}/turns", json={"input": "hi"}, headers=auth(ACME_KEY)
            )
            assert r.status_code == 202, r.text
        r = await c.post("/v1/sessions/s9/turns", json={"input": "hi"}, headers=auth(ACME_KEY))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert error(r) == {
            "code": "backlog_full",
            "message": "tenant acme has 2 turns waiting, its limit ([tenants] max_backlog = 2);"
            " try again once some have run",
        }
        assert await turns_stored(nats_server.url) == 2
        # once a worker made the tenant's consumer, its count of turns waiting is read
        try:
            await tenant_consumer_of(nc, "acme")
            sub = await nc.jetstream().pull_subscribe_bind("turns-acme", SUBJECTS.turns_stream)
            [taken] = await sub.fetch(1, timeout=5)  # held by a worker: no longer waiting
            r = await c.post("/v1/sessions/s9/turns", json={"input": "hi"}, headers=auth(ACME_KEY))
            assert r.status_code == 202, r.text
            await taken.ack()
        finally:
            await nc.close()
        r = await c.post("/v1/sessions/x/turns", json={"input": "hi"}, headers=auth(GLOBEX_KEY))
        assert r.status_code == 202  # another tenant has no such limit
