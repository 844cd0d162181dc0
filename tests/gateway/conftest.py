"""A real nats-server, provisioned, and the gateway served by uvicorn on a free
loopback port; tests talk to it with httpx over TCP, and publish events to it with
:func:`publish`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
from nats.aio.client import Client

from gateway.auth import key_hash
from gateway.server import GatewayServer
from gateway.settings import ApiKey, GatewayConfig, GatewaySettings
from loopmesh.settings import NatsSettings, Tenants
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short
from schemas import encode
from schemas.events import ContentDelta

#: Two tenants' keys (the config stores only their SHA-256).
ACME_KEY = "acme-secret-key-1"
GLOBEX_KEY = "globex-secret-key-2"
KEYS = (
    ApiKey(sha256=key_hash(ACME_KEY), tenant="acme", name="acme-ci"),
    ApiKey(sha256=key_hash(GLOBEX_KEY), tenant="globex", name="globex-ci"),
)


#: How often a test may poll the gateway with one key (``wait_for(..., every=API_POLL_S)``):
#: at half the default rate limit, so that the polling alone never earns a 429.
API_POLL_S = 2 / GatewaySettings().rate_per_s


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def nats_url(nats_server: Any) -> AsyncIterator[str]:
    nc = await connect_fast(nats_server.url)
    try:
        await provision_short(nc)
    finally:
        await nc.close()
    yield nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A client of the gateway's nats-server (provisioned), reconnecting quickly."""
    client = await connect_fast(nats_url)
    try:
        yield client
    finally:
        await client.close()


async def publish(
    nc: Client,
    n: int,
    *,
    tenant: str = "acme",
    session: str = "s1",
    turn: str = "t1",
    text: str = "x",
) -> list[int]:
    """``n`` content deltas of ``turn``, as a worker publishes them; their stream
    sequences."""
    js = nc.jetstream()
    seqs = []
    for i in range(n):
        event = ContentDelta(
            tenant=tenant, session=session, turn_id=turn, iteration=i, text=text, ts=time.time()
        )
        ack = await js.publish(SUBJECTS.event(tenant, session, "content_delta"), encode(event))
        seqs.append(ack.seq)
    return seqs


GatewayFactory = Callable[..., AbstractAsyncContextManager[GatewayServer]]


@pytest.fixture
def gateway_at(nats_url: str) -> GatewayFactory:
    """``async with gateway_at(**settings) as gw``: a gateway with the two tenants' keys
    (unless given other settings) on a free port; ``tenants``: its ``[tenants]``."""

    def make(*, tenants: Tenants | None = None, **settings: Any) -> GatewayServer:
        settings.setdefault("port", 0)
        if not settings.get("no_auth"):
            settings.setdefault("api_keys", KEYS)
        config = GatewayConfig(
            nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05),
            gateway=GatewaySettings(**settings),
            tenants=tenants or {},
        )
        return GatewayServer(config)

    return make


@pytest.fixture
async def gateway(gateway_at: GatewayFactory) -> AsyncIterator[GatewayServer]:
    async with gateway_at() as gw:
        yield gw


@pytest.fixture
async def client(gateway: GatewayServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, headers=auth(ACME_KEY)) as c:
        yield c
