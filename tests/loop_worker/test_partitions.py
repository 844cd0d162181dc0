"""``[nats] partitions = 3`` end to end, on real loop-worker and tool-worker processes:
sessions of every partition run turns with a tool call to their ``loop_end`` and keep
all their events in their own partition's stream; an agent call whose child session
is in another partition than its parent completes; the exporter counts the turns of
every partition; a webhook is delivered for a session of a non-zero partition; the
Python client over NATS runs a turn (and refuses a server made for another count)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loopmesh import Client
from loopmesh.client import ClientError
from loopmesh.errors import ProvisionError
from loopmesh.exporter import Exporter, ExporterSettings
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import (
    Proc,
    connect_fast,
    provision_short,
    stream_events,
    wait_for,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import Subjects, Webhook
from schemas.events import LoopEnd, LoopStart, ToolCallEvent
from schemas.ids import call_id
from tests.loop_worker.durable import Watch, count_task, send_turn, turn
from tests.loop_worker.test_agent_calls import AGENTS, ask_calc
from tests.loopmesh.test_partitions import sessions_in_every_partition
from tests.webhooks.conftest import settings as webhook_settings
from tests.webhooks.receiver import receiving
from webhooks.service import WebhookService

pytestmark = pytest.mark.slow

S = Subjects(partitions=3)
READY = "loop worker ready"


class Mesh:
    def __init__(self, url: str, nc: Any, procs: list[Proc]) -> None:
        self.url, self.nc, self.procs = url, nc, procs
        self.nats = NatsSettings(url=url, reconnect_wait_s=0.05, partitions=3)


@pytest.fixture
async def mesh(nats_server, tmp_path) -> AsyncIterator[Mesh]:
    """Provisioned with three partitions; a tool worker and two loop workers (processes,
    told ``LOOPMESH_NATS__PARTITIONS=3``) against the fake LLM."""
    nc = await connect_fast(nats_server.url)
    await provision_short(nc, subjects=S)
    config = tmp_path / "loopmesh.toml"
    config.write_text(AGENTS)
    procs: list[Proc] = []
    try:
        async with FakeLLM(default=auto()) as llm:
            tools = Proc(
                "-m", "tool_worker", "--nats-url", nats_server.url, "--no-provision",
                "--module", "tests.loop_worker.tools",
                env={"LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2", "LOOPMESH_NATS__PARTITIONS": "3"},
            )  # fmt: skip
            procs.append(tools)
            await tools.start("serving pool=default")
            for name in ("w1", "w2"):
                env = worker_env(nats_server.url, llm.base_url, partitions=3, name=name)
                env |= {
                    "LOOPMESH_CONFIG": str(config),
                    "LOOPMESH_WEBHOOKS__ALLOW_HTTP": "true",  # the receiver is on loopback
                    "LOOPMESH_WEBHOOKS__ALLOWLIST": "127.0.0.1",
                }
                proc = Proc("-m", "loop_worker", env=env)
                procs.append(proc)
                await proc.start(READY)
            yield Mesh(nats_server.url, nc, procs)
    finally:
        for proc in reversed(procs):
            await proc.close()
        await nc.close()


async def sessions_in_stream(nc: Any, stream: str) -> set[str]:
    """The sessions that have events in ``stream``."""
    info = await nc.jetstream().stream_info(stream, subjects_filter=">")
    return {subject.split(".")[3] for subject in info.state.subjects or {}}


async def run_turn(nc: Any, turn_id: str, task: str, session: str, **kw: Any) -> LoopEnd:
    async with Watch(nc, "acme", session, subjects=S) as watch:
        await send_turn(nc, turn(turn_id, task, session=session, **kw), subjects=S)
        end = await watch.wait("loop_end", turn_id, timeout=60)
    assert isinstance(end, LoopEnd), end
    return end


async def test_sessions_of_every_partition_run_and_keep_their_events_in_their_stream(
    mesh: Mesh, tmp_path: Path
):
    sessions = sessions_in_every_partition(S)
    assert sorted(sessions) == [0, 1, 2]
    registry = CollectorRegistry()
    exporter = Exporter(mesh.nc, mesh.nats, ExporterSettings(), registry)
    stop = asyncio.Event()
    exporting = asyncio.create_task(exporter.run(stop))
    try:
        ends = await asyncio.gather(*(
            run_turn(mesh.nc, f"t{k}", count_task(tmp_path / f"n{k}", f"p{k}"), session)
            for k, session in sessions.items()
        ))  # fmt: skip
        assert [e.reason for e in ends] == ["task_completion"] * 3
        for k, session in sessions.items():
            assert (tmp_path / f"n{k}").read_text() == f"p{k}\n"  # the tool ran, once
            stored = [e for e, _ in await stream_events(mesh.nc, "acme", session, S)]
            types = [e.type for e in stored]
            assert types[0] == "turn_accepted" and types[-1] == "loop_end", types
            assert "tool_call" in types and "tool_result" in types
            assert await sessions_in_stream(mesh.nc, f"LOOPMESH_EVENTS_{k}") == {session}

        def turns() -> float:
            found = registry.get_sample_value(
                "loopmesh_turns_total", {"outcome": "task_completion", "tenant": "acme"}
            )
            return found or 0.0

        await wait_for(lambda: turns() == 3, timeout=20, what="the exporter counting 3 turns")
        for stream in S.events_streams:
            info = await mesh.nc.jetstream().consumer_info(stream, "metrics-exporter")
            assert info.num_pending == 0  # every partition read
    finally:
        stop.set()
        await exporting


def parent_with_child_elsewhere() -> str:
    """A parent session whose first agent call's child session (the call's id: the
    fake model calls at the first iteration, 0 or 1) is in another partition."""
    for i in range(1000):
        session = f"boss{i}"
        home = S.partition("acme", session)
        children = {S.partition("acme", call_id("acme", session, "t1", it, 0)) for it in (0, 1)}
        if home not in children:
            return session
    raise AssertionError("no such session")


async def test_an_agent_call_whose_child_is_in_another_partition_completes(
    mesh: Mesh, tmp_path: Path
):
    parent = parent_with_child_elsewhere()
    ledger = tmp_path / "count"
    async with Watch(mesh.nc, "acme", parent, subjects=S) as watch:
        await send_turn(
            mesh.nc, turn("t1", ask_calc(ledger, 0), session=parent, agent="boss"), subjects=S
        )
        call = await watch.wait("tool_call", timeout=30)
        end = await watch.wait("loop_end", "t1", timeout=60)
    assert isinstance(call, ToolCallEvent) and call.server == "agents", call
    child = call.call_id
    assert S.partition("acme", child) != S.partition("acme", parent)
    assert isinstance(end, LoopEnd) and end.reason == "task_completion", end
    assert "counted a" in end.content  # the child's answer, read from its own stream
    stored = [e for e, _ in await stream_events(mesh.nc, "acme", child, S)]
    start = next(e for e in stored if isinstance(e, LoopStart))
    assert start.parent is not None and start.parent.session == parent
    assert child in await sessions_in_stream(mesh.nc, S.events_stream_of("acme", child))
    assert child not in await sessions_in_stream(mesh.nc, S.events_stream_of("acme", parent))


async def test_a_webhook_is_delivered_for_a_session_in_a_nonzero_partition(
    mesh: Mesh, tmp_path: Path
):
    session = sessions_in_every_partition(S)[2]
    client = await connect_fast(mesh.url, name="webhooks")
    service = WebhookService(client, S, webhook_settings())
    stop, ready = asyncio.Event(), asyncio.Event()
    delivering = asyncio.create_task(service.run(stop, ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        async with receiving() as receiver:
            hook = Webhook(url=receiver.url, events=("loop_end",))
            end = await run_turn(mesh.nc, "t1", count_task(tmp_path / "n"), session, webhook=hook)
            assert end.reason == "task_completion", end
            await receiver.wait(lambda r: len(r.delivered) >= 1, "the loop_end's delivery")
        [request] = receiver.delivered
        assert b'"loop_end"' in request.body and session.encode() in request.body
        assert request.headers["webhook-id"].split("-")[1] == "2"  # <stored>-<partition>-<seq>
    finally:
        stop.set()
        await delivering
        await client.close()


async def test_the_python_client_over_nats_runs_a_turn_with_three_partitions(
    mesh: Mesh, tmp_path: Path
):
    session = sessions_in_every_partition(S)[1]
    async with Client(nats=mesh.nats, tenant="acme") as client:
        async with asyncio.timeout(60):
            events = [e async for e in client.run(count_task(tmp_path / "n"), session=session)]
    assert isinstance(events[-1], LoopEnd) and events[-1].reason == "task_completion"
    assert (tmp_path / "n").read_text() == "a\n"
    # a client (or the exporter) told another count refuses the server at once
    with pytest.raises(ClientError, match="partitions is 2") as refused:
        async with Client(nats=NatsSettings(url=mesh.url, partitions=2), tenant="acme"):
            pass
    assert refused.value.code == "partitions"
    with pytest.raises(ProvisionError, match="LOOPMESH_EVENTS_0, LOOPMESH_EVENTS_1"):
        exporter = Exporter(
            mesh.nc, NatsSettings(url=mesh.url), ExporterSettings(), CollectorRegistry()
        )
        await exporter.run(asyncio.Event())
