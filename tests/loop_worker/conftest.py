"""Fixtures of the durable loop-worker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from loopmesh.server import NatsServer
from tests.loop_worker.durable import Mesh, mesh_on


@pytest.fixture
async def mesh(nats_server: NatsServer) -> AsyncIterator[Mesh]:
    """An in-process mesh on a provisioned nats-server against the fake LLM
    (``mesh.fake``, answering by ``auto()``); a test starts the services it needs."""
    async with mesh_on(nats_server.url) as mesh:
        yield mesh
