"""The exporter: events from the stream, through a durable consumer, into metrics."""

from __future__ import annotations

import asyncio

import msgspec
from prometheus_client import CollectorRegistry

from loopmesh.exporter import Exporter, ExporterSettings
from loopmesh.provision import ensure_consumer, provision_all
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import wait_for
from loopmesh.turns import publish_turn
from schemas import Turn
from schemas.events import (
    LLMRequest,
    LLMResponse,
    LoopEnd,
    LoopStart,
    ToolErrorEvent,
    ToolResultEvent,
    Usage,
)
from schemas.streams import pool_consumer
from schemas.streams import tenant_consumer as lane_consumer
from schemas.subjects import Subjects
from tests.turns_consumers import tenant_consumer

S = Subjects()


async def publish(nc, *events) -> None:
    js = nc.jetstream()
    for e in events:
        await js.publish(S.event(e.tenant, e.session, e.type), msgspec.json.encode(e))


def turn(session: str, t0: float) -> list:
    ids = {"tenant": "acme", "session": session, "turn_id": f"t-{session}"}
    return [
        LoopStart(**ids, model="m1", ts=t0),
        LLMRequest(**ids, model="m1", iteration=1, ts=t0),
        LLMResponse(**ids, model="m1", iteration=1, ts=t0 + 2, latency_ms=2000.0,
                    usage=Usage(prompt_tokens=10, completion_tokens=5)),
        ToolResultEvent(**ids, call_id=f"c-{session}", server="builtin", tool="calculator",
                        duration_ms=30.0),
        ToolErrorEvent(**ids, call_id=f"d-{session}", server="builtin", tool="calculator",
                       code="bad_arguments"),
        LoopEnd(**ids, reason="task_completion", iterations=2),
    ]  # fmt: skip


async def run_until(exporter: Exporter, n: int) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))
    try:
        await wait_for(lambda: exporter.consumed >= n, timeout=20, what=f"{n} events consumed")
    finally:
        stop.set()
        await task


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_events_become_metrics_and_a_restarted_exporter_resumes_where_it_acked(nc):
    settings = NatsSettings(url="nats://unused")
    await provision_all(nc, settings)
    await publish(nc, *turn("s1", 1000.0))
    first = CollectorRegistry()
    await run_until(Exporter(nc, settings, ExporterSettings(), first), 6)
    assert value(first, "loopmesh_turns_total", outcome="task_completion", tenant="acme") == 1
    assert value(first, "loopmesh_turn_iterations_sum") == 2
    model = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "m1"}
    assert value(first, "gen_ai_client_operation_duration_seconds_sum", **model) == 2.0
    assert value(first, "gen_ai_client_operation_time_to_first_chunk_seconds_sum", **model) == 2.0
    assert value(first, "gen_ai_client_token_usage_sum", **model, gen_ai_token_type="output") == 5
    tool = {"gen_ai_tool_name": "calculator", "server": "builtin"}
    assert value(first, "gen_ai_execute_tool_duration_seconds_sum", **tool) == 0.03
    assert value(first, "loopmesh_tool_errors_total", **tool, code="bad_arguments") == 1

    # A new exporter process on the same durable consumer sees only the new turn.
    await publish(nc, *turn("s2", 2000.0))
    second = CollectorRegistry()
    await run_until(Exporter(nc, settings, ExporterSettings(), second), 6)
    assert value(second, "loopmesh_turns_total", outcome="task_completion", tenant="acme") == 1
    assert value(second, "loopmesh_events_total", type="loop_start") == 1


async def test_the_pool_backlog_is_pending_plus_ack_pending(nc):
    settings = NatsSettings(url="nats://unused")
    await provision_all(nc, settings)
    js = nc.jetstream()
    await ensure_consumer(js, pool_consumer(S, "slow"))
    for i in range(3):
        await js.publish(S.tool("slow", "srv", "t"), b"{}", headers={"Nats-Msg-Id": f"c{i}"})
    registry = CollectorRegistry()
    exporter = Exporter(nc, settings, ExporterSettings(backlog_interval_s=0.05), registry)
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))
    try:
        await wait_for(
            lambda: value(registry, "loopmesh_tool_pool_backlog", pool="slow") == 3,
            timeout=20,
            what="backlog 3",
        )
    finally:
        stop.set()
        await task


def test_a_tenant_is_read_from_its_consumers_filter_subject_never_its_name():
    assert S.tenant_of_filter("loopmesh.turns.acme.>") == "acme"
    assert S.tenant_of_filter(S.lane_turns("acme")) == "acme"
    assert S.tenant_of_filter(S.lane_turns("acme", "batch")) == "acme"
    assert Subjects(prefix="mesh2").tenant_of_filter("mesh2.turns.acme.>") == "acme"
    for other in (
        "",
        "loopmesh.turns.>",
        "loopmesh.turns.*.>",
        "mesh2.turns.acme.>",
        "loopmesh.turns.acme.s1",
        "loopmesh.tools.acme.>",
        "loopmesh.turns.a.b.>",
    ):
        assert S.tenant_of_filter(other) is None, other  # fmt: skip


async def test_each_tenants_turns_backlog_and_their_total_until_its_consumer_goes(nc):
    settings = NatsSettings(url="nats://unused")
    await provision_all(nc, settings)
    js = nc.jetstream()
    acme = await tenant_consumer(js, S, "acme")
    await tenant_consumer(js, S, "globex", name="turns-5d41402a")  # a hashed name
    for tenant, session, n in (("acme", "s1", 3), ("globex", "s2", 2), ("initech", "s3", 4)):
        for i in range(n):
            turn = Turn(id=f"t{i}", tenant=tenant, session=session, input="hi")
            await publish_turn(js, S, turn)
    sub = await js.pull_subscribe_bind(acme, S.turns_stream)
    (held,) = await sub.fetch(1, timeout=5)  # delivered, not acked: num_ack_pending

    registry = CollectorRegistry()
    exporter = Exporter(nc, settings, ExporterSettings(backlog_interval_s=0.05), registry)
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))

    def turns() -> dict[str, tuple[float | None, float | None]]:
        return {
            tenant: (
                value(registry, "loopmesh_turns_waiting", tenant=tenant),
                value(registry, "loopmesh_turns_backlog", tenant=tenant),
            )
            for tenant in ("acme", "globex", "initech")
        }

    try:
        await wait_for(
            lambda: value(registry, "loopmesh_turns_backlog_total") == 5, timeout=20,
            what="5 turns in the tenants' backlog",
        )  # fmt: skip
        # initech has turns but no consumer yet: no figure, and none in the total.
        assert turns() == {"acme": (2, 3), "globex": (2, 2), "initech": (None, None)}

        await js.delete_consumer(S.turns_stream, "turns-5d41402a")
        await held.ack()
        await wait_for(
            lambda: value(registry, "loopmesh_turns_backlog_total") == 2, timeout=20,
            what="globex's consumer gone, acme's held turn acked",
        )  # fmt: skip
        assert turns() == {"acme": (2, 2), "globex": (None, None), "initech": (None, None)}
    finally:
        stop.set()
        await task
        await sub.unsubscribe()


async def test_a_tenants_backlog_counts_both_of_its_lanes(nc):
    settings = NatsSettings(url="nats://unused")
    await provision_all(nc, settings)
    js = nc.jetstream()
    for priority in ("interactive", "batch"):
        c = lane_consumer(S, "acme", ack_wait_s=30.0, max_deliver=-1, priority=priority)
        await ensure_consumer(js, c)
    for i, priority in enumerate(("interactive", "interactive", "batch", "batch", "batch")):
        turn = Turn(id=f"t{i}", tenant="acme", session="s1", input="hi", priority=priority)
        await publish_turn(js, S, turn)
    registry = CollectorRegistry()
    exporter = Exporter(nc, settings, ExporterSettings(backlog_interval_s=0.05), registry)
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))
    try:
        await wait_for(
            lambda: value(registry, "loopmesh_turns_backlog_total") == 5, timeout=20,
            what="both lanes' turns",
        )  # fmt: skip
        assert value(registry, "loopmesh_turns_waiting", tenant="acme") == 5
    finally:
        stop.set()
        await task


async def test_the_turns_total_counts_more_tenants_than_the_server_lists_at_once(nc):
    """The server lists 256 consumers a page: the exporter reads every page."""
    settings = NatsSettings(url="nats://unused")
    await provision_all(nc, settings)
    js = nc.jetstream()
    tenants = [f"tenant{i}" for i in range(300)]
    for tenant in tenants:
        await publish_turn(js, S, Turn(id="t1", tenant=tenant, session="s1", input="hi"))
        await tenant_consumer(js, S, tenant)
    assert len(await js.consumers_info(S.turns_stream)) < len(tenants)  # one page
    registry = CollectorRegistry()
    exporter = Exporter(nc, settings, ExporterSettings(backlog_interval_s=0.05), registry)
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))
    try:
        await wait_for(
            lambda: value(registry, "loopmesh_turns_backlog_total") == len(tenants),
            timeout=20,
            what=f"{len(tenants)} tenants' turns",
        )
        assert value(registry, "loopmesh_turns_waiting", tenant="tenant299") == 1
    finally:
        stop.set()
        await task
