"""A JetStream cluster of ``nats-server`` processes on loopback, for tests and benches.

Three nodes by default, each with its own store and server name, joined by cluster
routes. Every port is picked free beforehand (every node must know its peers' route
ports before it starts: a JetStream cluster refuses to start without routes), below the
kernel's ephemeral range, so that no outgoing connection holds a port a node restarts
on; a start that loses a port to another process is retried with new ones. A node
restarted (or killed and started again) keeps its ports and its store, as a real one
would::

    async with NatsCluster(tmp_path / "cluster") as cluster:
        nc = await nats.connect(cluster.url)   # every node's URL, comma-separated
        await cluster.node(await cluster.leader_of("LOOPMESH_EVENTS")).restart()

:meth:`NatsCluster.start` returns once a meta leader is elected and every node says
JetStream is current (``/healthz``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from types import TracebackType

import httpx
import nats
from nats.js.api import StorageType
from nats.js.errors import BadRequestError

from .errors import NatsServerError
from .ports import free_ports
from .provision import NO_PEERS_ERR_CODE
from .server import NatsServer

_START_ATTEMPTS = 3  # a free port picked beforehand may be taken before the node binds it
_UNPLACEABLE = "the cluster places no stream"
#: Why a fresh cluster is started again: a port taken meanwhile, no placement yet, or a
#: node whose JetStream never caught up with the meta leader in ``ready_timeout``
#: (seen on nats-server 2.10 at a first start).
_START_AGAIN = ("address already in use", _UNPLACEABLE, "cluster not ready")
_PLACEMENT_S = 15.0
_PROBE = "LOOPMESH_PLACEMENT_PROBE"


class ClusterNode(NatsServer):
    """One node: a :class:`~loopmesh.server.NatsServer` that also listens for routes."""

    # nats-server binds its route port after it says it is ready, and exits if it cannot
    ready_lines = (*NatsServer.ready_lines, b"Listening for route connections")

    def __init__(
        self,
        store_dir: Path,
        *,
        name: str,
        cluster: str,
        host: str,
        mappings: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(store_dir, host=host, mappings=mappings)
        self.name = name
        self.cluster_name = cluster
        self.route_port = -1
        self.peers: list[ClusterNode] = []
        self.paused = False

    async def start(self) -> None:
        if self.running:
            return
        routes = ",".join(f"nats://{p.host}:{p.route_port}" for p in self.peers)
        self.extra_args = (
            "--server_name", self.name, "--cluster_name", self.cluster_name,
            "--cluster", f"nats://{self.host}:{self.route_port}", "--routes", routes,
        )  # fmt: skip
        await super().start()

    async def stop(self, timeout: float = 10.0) -> None:
        self.resume()  # a paused process would not stop
        await super().stop(timeout)

    async def crash(self) -> None:
        """SIGKILL, as a crash would, and reap the process; the store is kept, and
        :meth:`start` brings the node back with it."""
        self.resume()
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the node stops answering, its connections stay open."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self.paused = False

    def _signal(self, sig: signal.Signals) -> None:
        if self.pid is not None and self.running:
            os.kill(self.pid, sig)

    async def jsz(self) -> dict[str, object]:
        async with httpx.AsyncClient(timeout=5.0) as http:
            r = await http.get(f"{self.monitor_url}/jsz", params={"streams": "true"})
            r.raise_for_status()
            data: dict[str, object] = r.json()
            return data


class NatsCluster:
    """``size`` nats-server nodes named ``n1``… in one cluster, JetStream on each."""

    def __init__(
        self,
        root: str | Path,
        *,
        size: int = 3,
        name: str = "loopmesh",
        host: str = "127.0.0.1",
        ready_timeout: float = 30.0,
        mappings: Mapping[str, str] | None = None,
    ) -> None:
        """``mappings``: each node's subject mappings (``Subjects.turn_mappings``)."""
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, not {size}")
        self.root = Path(root)
        self.ready_timeout = ready_timeout
        self.nodes = [
            ClusterNode(
                self.root / f"n{i}", name=f"n{i}", cluster=name, host=host, mappings=mappings
            )
            for i in range(1, size + 1)
        ]
        for node in self.nodes:
            node.peers = [n for n in self.nodes if n is not node]

    @property
    def up(self) -> list[ClusterNode]:
        """The nodes running and not paused."""
        return [n for n in self.nodes if n.running and not n.paused]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``[nats] url`` accepts)."""
        return ",".join(self.urls)

    @property
    def urls(self) -> list[str]:
        """The client URL of each node started at least once (one yet to start has no
        port yet)."""
        return [n.url for n in self.nodes if n.port > 0]

    def node(self, name: str) -> ClusterNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in {[n.name for n in self.nodes]}")

    async def start(self, *, down: Collection[str] = ()) -> None:
        """Start every node but those named in ``down`` (a node yet to join: start it
        with ``node.start()``); return once the cluster is ready."""
        for attempt in range(1, _START_ATTEMPTS + 1):
            self.assign_ports()
            try:
                await asyncio.gather(*(n.start() for n in self.nodes if n.name not in down))
                await self.wait_ready()
                if not down and len(self.nodes) > 1:
                    await self.wait_placeable()
                return
            except NatsServerError as exc:
                await self.stop()
                if attempt == _START_ATTEMPTS or not any(why in str(exc) for why in _START_AGAIN):
                    raise
            except BaseException:
                await self.stop()
                raise

    def assign_ports(self) -> None:
        """Give each node its client, monitor and route ports: free ones, drawn again at
        each attempt to start."""
        ports = free_ports(3 * len(self.nodes), self.nodes[0].host)
        for i, node in enumerate(self.nodes):
            node.port, node.monitor_port, node.route_port = ports[3 * i : 3 * i + 3]

    async def wait_placeable(self, replicas: int = 0, timeout: float = _PLACEMENT_S) -> None:
        """Until the meta leader places a stream of ``replicas`` (default: every node): a
        probe stream, created and deleted. In CI, nats-server 2.10.25 once refused every
        R3 stream ("no suitable peers for placement", 10005) for 150 s, on a cluster
        whose routes were all up and whose meta leader listed every peer as current;
        :meth:`start` begins such a start again rather than hand it to a test."""
        replicas = replicas or len(self.nodes)
        deadline = time.monotonic() + timeout
        nc = await nats.connect(servers=self.urls)
        try:
            js = nc.jetstream()
            while True:
                try:
                    await js.add_stream(
                        name=_PROBE, storage=StorageType.MEMORY, num_replicas=replicas
                    )
                    await js.delete_stream(_PROBE)
                    return
                except BadRequestError as exc:
                    if exc.err_code != NO_PEERS_ERR_CODE or time.monotonic() > deadline:
                        raise NatsServerError(
                            f"{_UNPLACEABLE}: R{replicas} refused for {timeout:g} s "
                            f"({exc.description})"
                        ) from exc
                await asyncio.sleep(0.2)  # no event says the leader knows its peers
        finally:
            await nc.close()

    async def stop(self) -> None:
        """Stop every node. Idempotent."""
        await asyncio.gather(*(n.stop() for n in self.nodes), return_exceptions=True)

    async def restart(self, node: ClusterNode) -> None:
        """Stop ``node`` and start it again with its ports and store; wait until the
        cluster is whole again, every stream led (as a rolling restart waits before it
        takes down the next node)."""
        await node.stop()
        await node.start()
        await self.wait_ready()
        await self.wait_led()

    async def wait_led(self, timeout: float | None = None) -> None:
        """Until every stream the nodes up know of has a leader."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while True:
            leaderless: set[str] = set()
            for node in self.up:
                try:
                    jsz = await node.jsz()
                except httpx.HTTPError:
                    leaderless.add(f"(node {node.name})")
                    continue
                for account in jsz.get("account_details") or []:  # type: ignore[attr-defined]
                    for s in account.get("stream_detail") or []:
                        if not (s.get("cluster") or {}).get("leader"):
                            leaderless.add(str(s.get("name")))
            if not leaderless:
                return
            if time.monotonic() > deadline:
                raise NatsServerError(f"streams without a leader: {sorted(leaderless)}")
            await asyncio.sleep(0.05)  # polling a monitor: there is no event to wait on

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until every running node is healthy (JetStream current, a meta leader known)."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        waiting = self.up
        last = ""
        async with httpx.AsyncClient(timeout=5.0) as http:
            while waiting:
                node = waiting[0]
                try:
                    r = await http.get(f"{node.monitor_url}/healthz")
                    jsz = (await http.get(f"{node.monitor_url}/jsz")).json()
                    leader = (jsz.get("meta_cluster") or {}).get("leader")
                    if r.status_code == 200 and leader:
                        waiting.pop(0)
                        continue
                    last = f"{node.name}: {r.text.strip()} meta leader {leader!r}"
                except httpx.HTTPError as exc:
                    last = f"{node.name}: {exc!r}"
                if time.monotonic() > deadline:
                    raise NatsServerError(f"cluster not ready: {last}")
                await asyncio.sleep(0.05)  # polling a monitor: there is no event to wait on
            # The meta leader should know every node (nats-server 2.10 refuses to place
            # an R3 stream with "no suitable peers" until it does). Best effort: a view
            # that lags past the deadline is left to the callers' retries.
            while time.monotonic() < deadline:
                if await self._meta_whole(http):
                    break
                await asyncio.sleep(0.05)  # polling a monitor, as above

    async def _meta_whole(self, http: httpx.AsyncClient) -> bool:
        """Whether the meta leader, as the nodes up see it, lists every other node up as
        a current peer."""
        up = self.up
        for node in up:
            try:
                meta = (await http.get(f"{node.monitor_url}/jsz")).json().get("meta_cluster")
            except (httpx.HTTPError, ValueError):
                return False
            if not meta or meta.get("leader") != node.name:
                continue  # not the leader's own view
            current = {r.get("name") for r in meta.get("replicas") or () if r.get("current")}
            return {n.name for n in up} - {node.name} <= current
        return len(up) <= 1

    async def leader_of(self, stream: str, *, other_than: str = "") -> str:
        """The name of the node that leads ``stream`` as the nodes up see it (waits out an
        election, and for a leader other than ``other_than``)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            for node in self.up:
                try:
                    jsz = await node.jsz()
                except httpx.HTTPError:
                    continue
                for account in jsz.get("account_details") or []:  # type: ignore[attr-defined]
                    for s in account.get("stream_detail") or []:
                        leader = (s.get("cluster") or {}).get("leader")
                        if s.get("name") == stream and leader and leader != other_than:
                            return str(leader)
            if time.monotonic() > deadline:
                raise NatsServerError(f"no leader for stream {stream}")
            await asyncio.sleep(0.05)

    async def __aenter__(self) -> NatsCluster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
