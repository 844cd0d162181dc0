"""Fixtures every test package shares: a real nats-server (or a real 3-node cluster) and
a fake LLM per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from hypothesis import HealthCheck, settings
from nats.aio.client import Client

from loopmesh.cluster import NatsCluster
from loopmesh.ports import free_ports, share_range
from loopmesh.server import NatsServer
from loopmesh.testing.durable import connect_fast
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.shared_cluster import SharedCluster
from schemas import Subjects
from tests.certs import Certs, make_certs

T = TypeVar("T")

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
        help="also seeds 2 and 3 of the chaos and partition runs (tests/chaos; seed 1 always)",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker picks the ports of its servers from a slice of its
    own: two workers never hand out the same port before its server binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1...
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count:
        share_range(int(worker.removeprefix("gw")), int(count))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``serial`` (kills, handovers, chaos, load: each wants the machine's
    attention) form one xdist group: under ``-n N --dist loadgroup`` a single worker runs
    them one after another while the other workers run the rest."""
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A fresh nats-server with JetStream on free ports and a temporary store."""
    async with restartable_server(tmp_path / "nats") as server:
        yield server


def restartable_server(store_dir: Path, mappings: Mapping[str, str] | None = None) -> NatsServer:
    """A nats-server on ports below the ephemeral range: one restarted finds its port
    free, where a port the kernel picked could meanwhile be any outgoing connection's."""
    port, monitor_port = free_ports(2)
    return NatsServer(store_dir, port=port, monitor_port=monitor_port, mappings=mappings)


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    """A private CA with a server certificate for loopback and a client certificate."""
    return make_certs(tmp_path / "certs")


@pytest.fixture
async def mtls_server(tmp_path: Path, certs: Certs) -> AsyncIterator[NatsServer]:
    """A nats-server with JetStream that requires TLS and a client certificate signed by
    ``certs``' CA (mutual TLS); ``url`` is ``tls://``. Restartable, as ``nats_server``."""
    port, monitor_port = free_ports(2)
    server = NatsServer(
        tmp_path / "nats-tls", port=port, monitor_port=monitor_port, tls=certs.server_tls()
    )
    async with server:
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
    shared: SharedCluster | None = None  # the cluster's own loop, when a module shares it
    turn_partitions: int = 1  # the servers' turn mappings: [nats] turn_partitions
    _stopped: NatsServer | None = field(default=None, repr=False)

    async def restart(self, stream: str = "LOOPMESH_TURNS") -> None:
        """Restart the server, or the cluster node that leads ``stream``."""
        if self.server is not None:
            await self.server.restart()
        else:
            await self.stop(stream)
            await self.start()

    async def stop(self, stream: str = "LOOPMESH_TURNS", *, node: NatsServer | None = None) -> None:
        """Stop the server, or the cluster node that leads ``stream`` (or ``node``), until
        :meth:`start`."""
        if self.server is not None:
            self._stopped = self.server
        elif node is not None:
            self._stopped = node
        else:
            assert self.cluster is not None
            self._stopped = self.cluster.node(await self.cluster.leader_of(stream))
        await self._on_loop(self._stopped.stop())

    async def start(self) -> None:
        """Start what :meth:`stop` stopped, with its store; on the cluster, wait until
        every node is healthy again."""
        assert self._stopped is not None, "nothing stopped"
        stopped, self._stopped = self._stopped, None
        await self._on_loop(stopped.start())
        if self.cluster is not None:
            await self._on_loop(self.cluster.wait_ready())

    async def follower(self, stream: str) -> NatsServer:
        """A node that does not lead ``stream`` (the server itself on one server)."""
        if self.server is not None:
            return self.server
        assert self.cluster is not None
        leader = await self.cluster.leader_of(stream)
        return next(n for n in self.cluster.nodes if n.name != leader)

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await (self.shared.run(coro) if self.shared is not None else coro)


#: ``@pytest.mark.parametrize("durable", BOTH, indirect=True)``: once on one server,
#: once on the cluster (started for the test).
BOTH = ["single", "cluster"]


def durable_nc() -> Any:
    """An ``nc`` fixture on ``durable`` (one server or the cluster), reconnecting at
    once, for a module whose tests run on both: ``nc = durable_nc()``."""

    async def nc(durable: Durable) -> AsyncIterator[Client]:
        client = await connect_fast(durable.url)
        try:
            yield client
        finally:
            await client.close()

    return pytest.fixture(nc)


#: As :data:`BOTH`, but the module's tests share one cluster (``shared_cluster``): each
#: gets it with every bucket emptied and every other stream that held anything deleted,
#: so none sees what another left (a bucket's sequence numbers go on, though).
BOTH_SHARED = ["single", pytest.param("shared", id="cluster")]

#: As :data:`BOTH`, and again with the turns over two streams (the servers' mappings,
#: ``durable.turn_partitions``, which the services must be given).
WITH_TURN_PARTITIONS = [*BOTH, "single-turnp", "cluster-turnp"]
TURN_PARTITIONS = 2


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    """One 3-node cluster for a module's tests (``BOTH_SHARED``), on a loop of its own."""
    with SharedCluster(tmp_path_factory.mktemp("cluster")) as shared:
        yield shared


@pytest.fixture
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Durable]:
    """One nats-server, or (parametrized ``"cluster"``, or ``"shared"``: the module's
    cluster, emptied) three, with replicas to match."""
    kind = getattr(request, "param", "single")
    mappings = Subjects(turn_partitions=TURN_PARTITIONS).turn_mappings
    if kind == "single-turnp":
        async with restartable_server(tmp_path / "nats", mappings) as server:
            yield Durable("single", server.url, 1, server=server, turn_partitions=2)
    elif kind == "cluster-turnp":
        async with NatsCluster(tmp_path / "cluster", mappings=mappings) as cluster:
            yield Durable("cluster", cluster.url, 3, cluster=cluster, turn_partitions=2)
    elif kind == "shared":
        shared: SharedCluster = request.getfixturevalue("shared_cluster")
        await shared.clear()
        yield Durable("cluster", shared.cluster.url, 3, cluster=shared.cluster, shared=shared)
    elif kind == "cluster":
        async with NatsCluster(tmp_path / "cluster") as cluster:
            yield Durable("cluster", cluster.url, 3, cluster=cluster)
    else:
        async with restartable_server(tmp_path / "nats") as server:
            yield Durable("single", server.url, 1, server=server)


@pytest.fixture
async def fake_llm() -> AsyncIterator[FakeLLM]:
    """A fake OpenAI-compatible server on a free loopback port; script it per test."""
    async with FakeLLM() as server:
        yield server
