from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from loopmesh.provision import has_msg_ttl, provision
from schemas import definitions

from .harness import SUBJECTS, EventLog, Requester


@pytest.fixture
def replicas() -> int:
    """The replicas of every stream and bucket: a module that also runs on the cluster
    overrides it (and ``nc``) from ``durable``."""
    return 1


@pytest.fixture
async def js(nc: Client, replicas: int) -> JetStreamContext:
    """The client's JetStream context, with every loopmesh stream and bucket provisioned
    (a short catalog TTL so that expiry is quick to observe)."""
    js = nc.jetstream()
    defs = definitions(SUBJECTS, catalog_ttl_s=3.0, replicas=replicas)
    await provision(js, defs, msg_ttl=has_msg_ttl(nc))
    return js


@pytest.fixture
async def requester(nc: Client, js: JetStreamContext) -> AsyncIterator[Requester]:
    async with Requester(nc) as r:
        yield r


@pytest.fixture
async def events(nc: Client, js: JetStreamContext) -> AsyncIterator[EventLog]:
    async with EventLog(nc) as log:
        yield log
