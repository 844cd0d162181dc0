"""The 3-node cluster fixture, and provisioning's replica setting on it."""

import asyncio
import socket

import pytest

from loopmesh import cluster as cluster_module
from loopmesh.cluster import NatsCluster
from loopmesh.errors import NatsServerError, ProvisionError
from loopmesh.jetstream import KVEntry, Publisher, open_kv
from loopmesh.ports import free_ports
from loopmesh.provision import provision_all
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import connect_fast, tenant_consumer_of, wait_for
from schemas import Subjects
from tests.conftest import BOTH

pytestmark = pytest.mark.slow

S = Subjects()


async def test_three_nodes_elect_a_meta_leader_and_hold_r3_streams_on_every_node(nats_cluster):
    assert len(nats_cluster.urls) == 3 and nats_cluster.url.count(",") == 2
    nc = await connect_fast(nats_cluster.url)
    try:
        actions = await provision_all(nc, NatsSettings(replicas=3))
        assert f"created stream {S.events_stream}" in actions
        info = await nc.jetstream().stream_info(S.events_stream)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.name == "loopmesh"
        peers = {info.cluster.leader} | {p.name for p in info.cluster.replicas or []}
        assert peers == {"n1", "n2", "n3"}
        bucket = await nc.jetstream().stream_info(f"KV_{S.sessions_bucket}")
        assert bucket.config.num_replicas == 3
    finally:
        await nc.close()


async def test_a_changed_replica_count_is_applied_and_reported_never_ignored(nats_cluster):
    nc = await connect_fast(nats_cluster.url)
    js = nc.jetstream()
    try:
        await provision_all(nc, NatsSettings(replicas=3))
        consumer = await tenant_consumer_of(nc, "acme")  # as a worker makes it
        down = await provision_all(nc, NatsSettings(replicas=1))
        assert f"updated stream {S.turns_stream} (num_replicas 3 → 1)" in down
        assert f"updated bucket {S.leases_bucket} (num_replicas 3 → 1)" in down
        assert (await js.stream_info(S.turns_stream)).config.num_replicas == 1
        up = await provision_all(nc, NatsSettings(replicas=3))
        assert len(up) == len(down) and all("num_replicas 1 → 3" in a for a in up)
        assert (await js.stream_info(f"KV_{S.leases_bucket}")).config.num_replicas == 3

        async def consumer_on_three() -> bool:  # a tenant's consumer follows its stream
            info = await js.consumer_info(S.turns_stream, consumer)
            return info.cluster is not None and len(info.cluster.replicas or []) == 2

        await wait_for(consumer_on_three, timeout=15, what="the consumer on three nodes")
        assert await provision_all(nc, NatsSettings(replicas=3)) == []
    finally:
        await nc.close()


async def test_a_restarted_node_keeps_its_ports_and_store_and_rejoins(tmp_path):
    async with NatsCluster(tmp_path / "c") as cluster:
        nc = await connect_fast(cluster.url)
        try:
            await provision_all(nc, NatsSettings(replicas=3))
            js = nc.jetstream()
            await js.publish(S.event("acme", "s1", "loop_end"), b"{}")
            leader = cluster.node(await cluster.leader_of(S.events_stream))
            port, route = leader.port, leader.route_port
            await cluster.restart(leader)
            assert (leader.port, leader.route_port) == (port, route)
            await js.publish(S.event("acme", "s1", "loop_end"), b"{}")
            assert (await js.stream_info(S.events_stream)).state.messages == 2
            other = next(n for n in cluster.nodes if n is not leader)
            other.pause()
            other.resume()
            await cluster.wait_ready()
        finally:
            await nc.close()


async def test_a_start_that_loses_a_route_port_begins_again_with_new_ones(tmp_path, monkeypatch):
    """Route ports are picked free before the nodes start, and another process (or a
    node's own client port) can take one first. nats-server binds its route port after
    it logs that it is ready, then exits; the start sees the exit and its reason, and
    begins again with new ports."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: list[list[int]] = []

    def first_route_port_taken(count: int, host: str) -> list[int]:
        ports = free_ports(count, host)
        if not picks:
            ports[2] = taken.getsockname()[1]  # n1's route port
        picks.append(ports)
        return ports

    monkeypatch.setattr(cluster_module, "free_ports", first_route_port_taken)
    try:
        async with NatsCluster(tmp_path / "c") as cluster:
            assert len(picks) == 2
            assert [n.route_port for n in cluster.nodes] == picks[1][2::3]
            await cluster.wait_placeable()
        log = (tmp_path / "c" / "n1" / "nats-server.log").read_text()
    finally:
        taken.close()
    assert "address already in use" not in log  # the log of the second start


async def test_provisioning_waits_for_a_node_yet_to_join(tmp_path):
    cluster = NatsCluster(tmp_path / "c")
    await cluster.start(down={"n3"})  # two of three: the meta group has a quorum
    nc = await connect_fast(cluster.url)
    try:
        provisioning = asyncio.create_task(provision_all(nc, NatsSettings(replicas=3)))
        await asyncio.sleep(1)
        assert not provisioning.done()  # "no suitable peers for placement": waiting
        await cluster.node("n3").start()
        assert f"created stream {S.events_stream}" in await provisioning
        info = await nc.jetstream().stream_info(S.events_stream)
        assert info.cluster is not None
        assert {p.name for p in info.cluster.replicas or []} | {info.cluster.leader} == {
            "n1",
            "n2",
            "n3",
        }
    finally:
        await nc.close()
        await cluster.stop()


async def test_replicas_the_cluster_cannot_hold_are_refused_after_the_wait(nats_cluster):
    nc = await connect_fast(nats_cluster.url)
    try:
        with pytest.raises(ProvisionError, match="no suitable peers") as refused:
            await provision_all(nc, NatsSettings(replicas=4), placement_wait_s=1)
        assert "waited 1 s for 4 JetStream servers to be up" in str(refused.value)
        assert refused.value.name == S.turns_stream
    finally:
        await nc.close()


async def test_a_started_cluster_places_a_stream_on_every_node_and_says_when_it_cannot(
    nats_cluster,
):
    """start() probes placement (a probe it deletes); a probe the cluster cannot place
    is refused after the wait, in the words that make start() begin again."""
    await nats_cluster.wait_placeable()
    nc = await connect_fast(nats_cluster.url)
    try:
        assert await nc.jetstream().streams_info() == []  # the probe is gone
    finally:
        await nc.close()
    with pytest.raises(NatsServerError) as refused:
        await nats_cluster.wait_placeable(replicas=4, timeout=1)
    assert str(refused.value).startswith("the cluster places no stream: R4 refused for 1 s (")
    assert "no suitable peers for placement" in str(refused.value)


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_kv_reads_go_to_the_stream_leader_on_a_replicated_bucket(durable):
    nc = await connect_fast(durable.url)
    publisher = Publisher(nc)
    try:
        await provision_all(nc, NatsSettings(replicas=durable.replicas))
        kv = await open_kv(nc.jetstream(), publisher, S.sessions_bucket)
        assert kv.leader == (durable.kind == "cluster")  # followers may lag: not them
        assert await kv.entry("acme.s1") is None
        first = await kv.update("acme.s1", b"one", 0)
        assert await kv.entry("acme.s1") == KVEntry(first, b"one")
        second = await kv.update("acme.s1", b"two", first)
        assert await kv.entry("acme.s1") == KVEntry(second, b"two")
        marker = await kv.delete("acme.s1", second)
        assert await kv.entry("acme.s1") == KVEntry(marker, None)
    finally:
        await publisher.close()
        await nc.close()
