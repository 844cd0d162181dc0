"""Fixtures every test package shares: a real nats-server (or a real 3-node cluster) and
a fake LLM per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from hypothesis import HealthCheck, settings
from nats.aio.client import Client

from loopmesh.cluster import NatsCluster
from loopmesh.server import NatsServer
from loopmesh.testing.fake_llm import FakeLLM

# Fuzz tests without their own ``@settings`` run this many examples: modest in CI;
# ``pytest --hypothesis-profile=deep`` runs many more.
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("deep", max_examples=2_000, deadline=None)
settings.load_profile("ci")


async def skip_without_msg_ttl(url: str) -> None:
    """Skip a test of pinned pools on a nats-server before 2.11 (the floor's 2.10), which
    has no per-message TTL; there a pinned pool is refused with an error saying so."""
    nc = await nats.connect(url)
    try:
        version = nc.connected_server_version
    finally:
        await nc.close()
    if (version.major, version.minor) < (2, 11):
        found = f"{version.major}.{version.minor}.{version.patch}"
        pytest.skip(f"nats-server {found} has no per-message TTL (2.11+) for pinned pools")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos", action="store_true",
        help="also run the chaos suite's seeded run (tests/chaos; python -m tests.chaos)",
    )  # fmt: skip


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A fresh nats-server with JetStream on free ports and a temporary store."""
    async with NatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client connected to :func:`nats_server`."""
    client = await nats.connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    """Three nats-server nodes on loopback with routes, JetStream and their own stores,
    ready (meta leader elected); connect with ``nats_cluster.url`` (every node's URL)."""
    async with NatsCluster(tmp_path / "cluster") as cluster:
        yield cluster


@dataclass
class Durable:
    """Where a durability test runs: one server (R1) or the 3-node cluster (R3)."""

    kind: str
    url: str
    replicas: int
    server: NatsServer | None = None
    cluster: NatsCluster | None = None

    async def restart(self, stream: str = "LOOPMESH_TURNS") -> None:
        """Restart the server, or the cluster node that leads ``stream``."""
        if self.server is not None:
            await self.server.restart()
        else:
            assert self.cluster is not None
            leader = self.cluster.node(await self.cluster.leader_of(stream))
            await self.cluster.restart(leader)


#: ``@pytest.mark.parametrize("durable", BOTH, indirect=True)``: once on one server,
#: once on the cluster.
BOTH = ["single", "cluster"]


@pytest.fixture
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Durable]:
    """One nats-server, or (parametrized ``"cluster"``) three, with replicas to match."""
    if getattr(request, "param", "single") == "cluster":
        async with NatsCluster(tmp_path / "cluster") as cluster:
            yield Durable("cluster", cluster.url, 3, cluster=cluster)
    else:
        async with NatsServer(tmp_path / "nats") as server:
            yield Durable("single", server.url, 1, server=server)


@pytest.fixture
async def fake_llm() -> AsyncIterator[FakeLLM]:
    """A fake OpenAI-compatible server on a free loopback port; script it per test."""
    async with FakeLLM() as server:
        yield server
