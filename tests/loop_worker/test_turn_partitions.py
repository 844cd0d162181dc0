"""Turns over several streams (``[nats] turn_partitions``): the server's mappings route
each tenant's turns to its partition's stream, stored under the subject they were
published on; every service checks the mappings at start; loop workers serve every
partition with fair share, session order and dead letters as on one stream. On a real
nats-server and a real 3-node cluster, each started with the mappings."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loopmesh.cluster import NatsCluster
from loopmesh.errors import ProvisionError
from loopmesh.mappings import check_turn_partitions
from loopmesh.server import NatsServer
from loopmesh.testing.durable import connect_fast, drained, provision_short, wait_for
from loopmesh.testing.fake_replies import tool_calls
from loopmesh.turns import publish_turn
from schemas import Subjects
from tests.loop_worker.durable import Watch, mesh_on, send_turn, turn
from tests.loop_worker.test_poison import CrashingLLM

pytestmark = pytest.mark.slow

PARTS = 2
S = Subjects(turn_partitions=PARTS)
FLOOD = 96  # turns, over 8 sessions


def tenants_on(partition: int, count: int) -> list[str]:
    """``count`` tenant names whose turns go to ``partition``."""
    names = (f"tenant{i}" for i in range(1000))
    return [n for n in names if S.turn_partition(n) == partition][:count]


@pytest.fixture(params=["single", "cluster"])
async def mapped(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    """``(url, replicas)`` of one nats-server or a 3-node cluster with the turn mappings
    for :data:`PARTS` partitions."""
    if request.param == "single":
        async with NatsServer(tmp_path / "nats", mappings=S.turn_mappings) as server:
            yield server.url, 1
    else:
        async with NatsCluster(tmp_path / "cluster", mappings=S.turn_mappings) as cluster:
            yield cluster.url, 3


async def test_each_tenants_turns_are_stored_in_its_partitions_stream(mapped):
    url, replicas = mapped
    nc = await connect_fast(url)
    try:
        await provision_short(nc, replicas=replicas, subjects=S)
        await check_turn_partitions(nc, S)  # the mappings agree with the services
        js = nc.jetstream()
        tenants = tenants_on(0, 4) + tenants_on(1, 4)
        for tenant in tenants:
            for priority in ("interactive", "batch"):
                ack = await publish_turn(
                    js, S, turn(f"t-{priority}", "hi", tenant=tenant, priority=priority)
                )
                assert ack.stream == S.turns_stream_of(tenant)
                stored = await js.get_msg(ack.stream, ack.seq)  # under the published subject
                assert stored.subject == S.turn(tenant, "s1", priority)  # type: ignore[arg-type]
        for k in range(PARTS):  # the probes stored nothing
            info = await js.stream_info(S.turns_partition_stream(k))
            assert info.state.messages == 8
    finally:
        await nc.close()


async def test_the_check_refuses_a_server_whose_mappings_disagree(tmp_path, nats_server):
    nc = await connect_fast(nats_server.url)  # no mappings
    try:
        await provision_short(nc, subjects=S)
        with pytest.raises(ProvisionError, match=r"stores loopmesh\.turns\..* in no stream") as e:
            await check_turn_partitions(nc, S, wait_s=0.5)
        assert "mappings = {" in str(e.value) and "partition(2,1)" in str(e.value)
    finally:
        await nc.close()
    async with NatsServer(tmp_path / "mapped", mappings=S.turn_mappings) as server:
        nc = await connect_fast(server.url)
        try:
            await provision_short(nc, subjects=S)
            three = Subjects(turn_partitions=3)  # services that say 3, a server mapped for 2
            await provision_short(nc, subjects=three)
            with pytest.raises(ProvisionError, match="turn_partitions is 3"):
                await check_turn_partitions(nc, three, wait_s=0.5)
            await provision_short(nc)  # and services that say 1
            with pytest.raises(ProvisionError, match="remove the server's mappings"):
                await check_turn_partitions(nc, Subjects(), wait_s=0.5)
        finally:
            await nc.close()


async def test_the_mappings_loopmesh_prints_are_what_the_server_needs(tmp_path):
    """The server started with what ``loopmesh nats-mappings --tenant`` prints routes
    turns as the services expect, and a tenant's NATS user allowed the subject it names
    publishes its own turns, and no other tenant's."""
    [acme] = tenants_on(1, 1)
    env = {**os.environ, "LOOPMESH_NATS__TURN_PARTITIONS": str(PARTS)}
    env.pop("LOOPMESH_CONFIG", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loopmesh", "nats-mappings", "--tenant", acme, env=env,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    printed, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    allowed = printed.decode().splitlines()[-1].rpartition(" ")[2]
    assert allowed == f"loopmesh.turnp.1.{acme}.>"
    users = (
        "authorization { users: [\n  {user: svc, password: s}\n"
        f'  {{user: acme, password: a, permissions: {{publish: {{allow: ["{allowed}"]}}}}}}\n'
        "]}\n"
    )
    conf = tmp_path / "nats.conf"
    conf.write_text(printed.decode() + users)
    async with NatsServer(tmp_path / "nats", extra_args=("-c", str(conf))) as server:
        at = server.url.replace("nats://", "nats://{}@")
        nc = await connect_fast(at.format("svc:s"))
        tenant = await connect_fast(at.format("acme:a"))
        try:
            await provision_short(nc, subjects=S)
            await check_turn_partitions(nc, S)
            ack = await publish_turn(tenant.jetstream(), S, turn("t1", "hi", tenant=acme))
            assert ack.stream == S.turns_stream_of(acme)
            with pytest.raises(Exception):  # noqa: B017  (a permissions violation: no answer)
                await publish_turn(
                    tenant.jetstream(), S, turn("t1", "hi", tenant=tenants_on(1, 2)[1])
                )
        finally:
            await tenant.close()
            await nc.close()


async def test_loop_workers_serve_every_partition_in_order_and_fairly(mapped):
    """A flood of one tenant on partition 0; a tenant on each partition publishes after
    it: theirs end before the flood drains, and every session's turns run in order."""
    url, replicas = mapped
    flooder, calm0 = tenants_on(0, 2)
    [calm1] = tenants_on(1, 1)
    async with mesh_on(url, replicas=replicas, turn_partitions=PARTS) as mesh:
        # about 0.2 s a turn: 96 turns take 4 places 5 s at least
        mesh.fake.default = tool_calls(
            ("task_completion", {"result": "ok"}), content="abcd", chunk_size=1, delay_s=0.05
        )
        await mesh.tool_worker()
        await mesh.loop_worker("w1", max_active_turns=2)
        await mesh.loop_worker("w2", max_active_turns=2)
        ends: list[tuple[str, str]] = []
        seen = asyncio.Event()

        async def on_end(msg) -> None:
            tokens = msg.subject.split(".")
            ends.append((tokens[2], tokens[3]))
            seen.set()

        sub = await mesh.nc.subscribe("loopmesh.events.*.*.loop_end", cb=on_end)
        flood = [turn(f"f{i}", "hi", tenant=flooder, session=f"f{i % 8}") for i in range(FLOOD)]
        for chunk in range(0, len(flood), 16):
            await asyncio.gather(*(send_turn(mesh.nc, t, S) for t in flood[chunk : chunk + 16]))
        async with (
            Watch(mesh.nc, calm1, "c", subjects=S) as w1,
            Watch(mesh.nc, calm0, "c", subjects=S) as w0,
        ):
            for k in range(3):
                await send_turn(mesh.nc, turn(f"c{k}", "say hello", tenant=calm1, session="c"), S)
                await send_turn(mesh.nc, turn(f"c{k}", "say hello", tenant=calm0, session="c"), S)
            for watch in (w0, w1):
                for k in range(3):
                    await watch.wait("loop_end", f"c{k}", timeout=60)
                starts = [e.turn_id for e in watch.of("loop_start") if not e.resumed]
                assert starts == ["c0", "c1", "c2"]  # in order
        flooded = sum(1 for tenant, _ in ends if tenant == flooder)
        assert flooded < FLOOD // 2, flooded  # first come, first served: all of it first

        async def flood_ended() -> bool:
            return sum(1 for tenant, _ in ends if tenant == flooder) >= len(flood)

        await wait_for(flood_ended, timeout=120, what="the flood to end")
        await sub.unsubscribe()
        for session in range(8):  # each flood session's turns in the order published
            async with Watch(mesh.nc, flooder, f"f{session}", since=0, subjects=S) as watch:
                await watch.wait("loop_end", f"f{FLOOD - 8 + session}", timeout=30)
                starts = [e.turn_id for e in watch.of("loop_start") if not e.resumed]
            assert starts == [f"f{i}" for i in range(session, FLOOD, 8)]
        for stream in S.turns_streams:
            await drained(mesh.nc, stream)


async def test_a_turn_given_up_on_in_a_partition_is_dead_lettered_from_its_stream(mapped):
    url, replicas = mapped
    [tenant] = tenants_on(1, 1)
    async with mesh_on(url, replicas=replicas, turn_partitions=PARTS) as mesh:
        llm = CrashingLLM()
        await mesh.loop_worker(llm=llm, max_deliveries=2)
        js = mesh.nc.jetstream()
        async with Watch(mesh.nc, tenant, "s1", subjects=S) as watch:
            await send_turn(mesh.nc, turn("t1", "say hello", tenant=tenant), S)
            end = await watch.wait("loop_end", "t1", timeout=30)
        assert end.reason == "error" and "2 times" in (end.error or "")
        deeper = f"{S.prefix}.turns.{tenant}.s1.deeper"  # names no session: refused
        await js.publish(deeper, b'{"id": "t9", "input": "x"}')
        await drained(mesh.nc, S.turns_stream_of(tenant))

        async def both_recorded() -> bool:
            return (await js.stream_info(S.deadletter_stream)).state.messages == 2

        await wait_for(both_recorded, what="both dead-letter records")
        records = [await js.get_msg(S.deadletter_stream, seq) for seq in (1, 2)]
        assert [(r.headers or {}).get("Loopmesh-Stream") for r in records] == [
            S.turns_stream_of(tenant)
        ] * 2
        assert sorted((r.headers or {})["Loopmesh-Subject"] for r in records) == sorted(
            [S.turn(tenant, "s1"), deeper]
        )
