"""A mesh with two named agents and the NATS Agent Protocol host serving them, and the
protocol's real client (``synadia-ai-agents``) on a connection of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from synadia_ai.agents import Agent, Agents

from loopmesh.agents import apply_agents
from loopmesh.nats import connect
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import SUBJECTS, connect_fast
from nats_agents.service import NatsAgents
from nats_agents.settings import NatsAgentsConfig, NatsAgentsSettings
from tests.loop_worker.durable import Mesh, mesh_on
from tests.loop_worker.test_agents import CALC, WRITER  # two agents, each its model

TENANT = "acme"


@contextlib.asynccontextmanager
async def host_on(url: str, **settings: Any) -> AsyncIterator[NatsAgents]:
    """The protocol host for tenant ``acme`` on ``url``, every agent registered."""
    settings.setdefault("tenant", TENANT)
    settings.setdefault("drain_s", 1.0)
    config = NatsAgentsConfig(
        nats=NatsSettings(url=url, reconnect_wait_s=0.05),
        nats_agents=NatsAgentsSettings(**settings),
    )
    nc = await connect(config.nats, name="nats-agents")
    host = NatsAgents(nc, config)
    stop = asyncio.Event()
    task = asyncio.create_task(host.run(stop))
    try:
        ready = asyncio.ensure_future(host.ready.wait())
        await asyncio.wait({ready, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if task.done():
            task.result()
        assert host.ready.is_set(), "the protocol host did not register the agents in 30 s"
        yield host
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()


@pytest.fixture
async def mesh(nats_server: Any) -> AsyncIterator[Mesh]:
    """Two named agents, a tool worker and a loop worker (against the fake LLM)."""
    async with mesh_on(nats_server.url) as mesh:
        await apply_agents(mesh.nc.jetstream(), SUBJECTS, [CALC, WRITER])
        await mesh.tool_worker()
        await mesh.loop_worker()
        yield mesh


@pytest.fixture
async def host(mesh: Mesh) -> AsyncIterator[NatsAgents]:
    async with host_on(mesh.url) as host:
        yield host


@pytest.fixture
async def caller(mesh: Mesh) -> AsyncIterator[Client]:
    """A plain NATS connection, as any protocol caller has."""
    nc = await connect_fast(mesh.url, name="caller")
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
async def agents(caller: Client) -> AsyncIterator[Agents]:
    agents = Agents(nc=caller)
    try:
        yield agents
    finally:
        await agents.close()


async def discover(agents: Agents) -> dict[str, Agent]:
    """loopmesh's agents the client discovers, by the last token of their subjects."""
    return {a.session_name: a for a in await agents.discover() if a.agent == "loopmesh"}
