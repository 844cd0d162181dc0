"""A turn's webhook at the gateway: checked against the egress policy when the turn is
posted (422 naming ``webhook.url``), carried on the published turn when allowed, and an
agent's webhook kept from tenants."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from nats.aio.client import Client

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.agents import apply_agents
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import SUBJECTS
from loopmesh.webhook import WebhookSettings
from schemas import AgentSpec, Webhook
from tests.gateway.conftest import ACME_KEY, KEYS, auth
from tests.gateway.test_api import turns_in_stream


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway whose webhooks may be http, and reach 127.0.0.1 (nothing else private)."""
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
        webhooks=WebhookSettings(allow_http=True, allowlist=("127.0.0.1",)),
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        yield c


async def post(client: httpx.AsyncClient, webhook: object) -> httpx.Response:
    return await client.post("/v1/sessions/s1/turns", json={"input": "hi", "webhook": webhook})


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://10.0.0.1/hook", "host '10.0.0.1' is not in the allowlist (127.0.0.1)"),
        ("http://169.254.169.254/latest/", "not in the allowlist"),
        ("http://[::1]:8222/", "host '::1' is not in the allowlist"),
        ("ftp://example.com/", "Expected `str` matching regex"),
        ("http://user:pw@127.0.0.1/", "must not carry a user or password"),
    ],
)
async def test_a_webhook_the_egress_policy_refuses_is_refused_naming_the_field(
    client: httpx.AsyncClient, nc: Client, url: str, said: str
):
    r = await post(client, {"url": url})
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert error["field"] == "webhook.url", error
    assert said in error["message"]
    info = await nc.jetstream().stream_info(SUBJECTS.turns_stream)
    assert info.state.messages == 0  # nothing published


async def test_a_name_resolving_to_a_private_address_is_refused(nats_url: str):
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
        webhooks=WebhookSettings(allow_http=True),  # no allowlist: public addresses only
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        r = await post(c, {"url": "http://localhost:9/hook"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "webhook.url"
        assert "localhost resolves to" in error["message"] and "loopback" in error["message"]
        r = await post(c, {"url": "https://127.0.0.1/hook"})
        assert r.status_code == 422 and "127.0.0.1 is a loopback address" in r.text


async def test_http_is_refused_unless_allowed(nats_url: str):
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        r = await post(c, {"url": "http://hooks.example.com/x"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "webhook.url"
        assert "must be https, not 'http'" in r.text and "allow_http" in r.text


async def test_an_allowed_webhook_goes_with_the_published_turn(
    client: httpx.AsyncClient, nats_url: str
):
    r = await post(client, {"url": "http://127.0.0.1:9/hook", "events": ["loop_end", "error"]})
    assert r.status_code == 202, r.text
    [(turn, _)] = await turns_in_stream(nats_url)
    assert turn.webhook == Webhook(url="http://127.0.0.1:9/hook", events=("loop_end", "error"))
    r = await post(client, {"url": "http://127.0.0.1:9/hook", "events": ["content_delta"]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "webhook.events[0]", r.text
    r = await post(client, {"url": "http://127.0.0.1:9/hook", "event": ["error"]})  # misspelt
    assert r.status_code == 400 and r.json()["error"]["field"] == "webhook.event", r.text


async def test_an_agents_webhook_is_not_shown_to_tenants(client: httpx.AsyncClient, nc: Client):
    hooked = AgentSpec(name="hooked", webhook=Webhook(url="https://ops.example.com/hook"))
    await apply_agents(nc.jetstream(), SUBJECTS, [hooked])
    r = await client.get("/v1/agents/hooked")
    assert r.status_code == 200 and r.json()["webhook"] is None
    listed = {a["name"]: a for a in (await client.get("/v1/agents")).json()["agents"]}
    assert listed["hooked"]["webhook"] is None


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("[fec0::1]", "site-local"),
        ("[feff:ffff::1]", "site-local"),
        ("[3ffe:b00::1]", "6bone"),
        ("[3fff:1::1]", "documentation"),
        ("192.88.99.1", "6to4 relay anycast"),
        ("[2002:c058:6301::1]", "6to4 relay anycast"),  # 6to4 of 192.88.99.1
        ("[::ffff:0:808:808]", "reserved"),  # SIIT's ::ffff:0:0/96
        ("[100::1]", "private"),  # discard-only
        ("[2001:db8::1]", "private"),  # documentation, as Python knows it
    ],
)
async def test_deprecated_and_special_addresses_are_refused_without_an_allowlist(
    nats_url: str, nc: Client, address: str, kind: str
):
    config = GatewayConfig(
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=KEYS),
        webhooks=WebhookSettings(allow_http=True),  # no allowlist: public addresses only
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as c,
    ):
        r = await post(c, {"url": f"http://{address}/hook"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "webhook.url"
        assert kind in error["message"]
    info = await nc.jetstream().stream_info(SUBJECTS.turns_stream)
    assert info.state.messages == 0  # nothing published
