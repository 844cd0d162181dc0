"""``[nats] partitions``: provisioning makes one events stream and one webhooks consumer
per partition, a session's events are stored in its partition's stream, and a server
made for another count is refused without changing anything on it."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from loop_worker.sink import JetStreamEvents
from loopmesh.errors import ProvisionError
from loopmesh.exporter import Exporter, ExporterSettings
from loopmesh.jetstream import Publisher
from loopmesh.provision import check_partitions, provision_all
from loopmesh.scheduler import Scheduler
from loopmesh.schedules import new_schedule, run_ends
from loopmesh.settings import NatsSettings, SchedulerSettings
from loopmesh.testing.durable import connect_fast, provision_short, stream_events
from loopmesh.usage import read_days
from schemas import Subjects, encode
from schemas.events import LoopEnd
from schemas.subjects import MAX_PARTITIONS
from tests.conftest import BOTH_SHARED
from tests.loopmesh.test_exporter import run_until
from tests.loopmesh.test_exporter import turn as exporter_turn
from tests.loopmesh.test_scheduler import T0, Clock


def sessions_in_every_partition(subjects: Subjects, tenant: str = "acme") -> dict[int, str]:
    """A session id landing in each partition (the first ``s<i>`` that does)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < subjects.partitions:
        found.setdefault(subjects.partition(tenant, f"s{i}"), f"s{i}")
        i += 1
    return found


async def stream_names(nc) -> set[str]:
    return {info.config.name for info in await nc.jetstream().streams_info()}


async def test_three_partitions_make_three_events_streams_and_three_webhooks_consumers(nc):
    settings = NatsSettings(partitions=3)
    s = settings.subjects
    await provision_all(nc, settings)
    js = nc.jetstream()
    names = await stream_names(nc)
    assert {"LOOPMESH_EVENTS_0", "LOOPMESH_EVENTS_1", "LOOPMESH_EVENTS_2"} <= names
    assert "LOOPMESH_EVENTS" not in names
    for k, stream in enumerate(s.events_streams):
        info = await js.stream_info(stream)
        assert info.config.subjects == [f"loopmesh.events.*.*.*.{k}"]
        consumer = await js.consumer_info(stream, s.webhooks_consumer)
        filters = consumer.config.filter_subjects or [consumer.config.filter_subject]
        assert filters and all(f.endswith(f".{k}") for f in filters)


async def test_each_sessions_events_are_stored_in_the_stream_its_partition_names(nc):
    settings = NatsSettings(partitions=3)
    s = settings.subjects
    await provision_all(nc, settings)
    js = nc.jetstream()
    sessions = sessions_in_every_partition(s)
    for k, session in sessions.items():
        ack = await js.publish(s.event("acme", session, "loop_start"), b"{}")
        assert ack.stream == s.events_stream_of("acme", session) == f"LOOPMESH_EVENTS_{k}"
    for stream in s.events_streams:
        assert (await js.stream_info(stream)).state.messages == 1


@pytest.mark.parametrize(("made", "asked"), [(1, 3), (3, 2), (3, 1), (2, 3)])
async def test_another_partition_count_is_refused_and_changes_nothing(nc, made, asked):
    await provision_all(nc, NatsSettings(partitions=made))
    before = await stream_names(nc)
    held = Subjects(partitions=made).events_streams
    with pytest.raises(ProvisionError) as refused:
        await provision_all(nc, NatsSettings(partitions=asked))
    message = str(refused.value)
    assert f"partitions is {asked}" in message
    assert all(name in message for name in held)
    assert await stream_names(nc) == before
    with pytest.raises(ProvisionError):
        await check_partitions(nc.jetstream(), Subjects(partitions=asked))
    await check_partitions(nc.jetstream(), Subjects(partitions=made))  # the same: fine


async def test_a_server_with_no_events_streams_takes_any_count(nc):
    await check_partitions(nc.jetstream(), Subjects(partitions=5))
    assert await stream_names(nc) == set()


@pytest.mark.parametrize("bad", [0, -1, MAX_PARTITIONS + 1])
def test_a_partition_count_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=f"partitions must be 1 to {MAX_PARTITIONS}"):
        Subjects(partitions=bad)


def test_partition_is_stable_and_in_range():
    s = Subjects(partitions=7)
    seen = {s.partition("acme", f"s{i}") for i in range(500)}
    assert seen == set(range(7))  # every partition gets sessions
    assert s.partition("acme", "s1") == Subjects("other", 7).partition("acme", "s1")
    assert [s.partition("acme", "s1") for _ in range(3)] == [s.partition("acme", "s1")] * 3
    assert Subjects().partition("acme", "s1") == 0
    assert s.event("acme", "s1", "loop_end").split(".")[-1] == str(s.partition("acme", "s1"))
    assert Subjects().event("acme", "s1", "loop_end") == "loopmesh.events.acme.s1.loop_end"
    with pytest.raises(ValueError, match=r"partition 7 is not one of 0\.\.6"):
        s.partition_stream(7)


async def test_the_exporter_counts_every_partitions_events_and_usage_once(nc):
    settings = NatsSettings(partitions=3)
    s = settings.subjects
    await provision_all(nc, settings)
    js = nc.jetstream()
    sessions = sessions_in_every_partition(s)
    for session in sessions.values():  # each stream numbers its events from 1
        for event in exporter_turn(session, 1000.0):
            await js.publish(s.event("acme", session, event.type), msgspec.json.encode(event))
    registry = CollectorRegistry()
    await run_until(Exporter(nc, settings, ExporterSettings(), registry), 6 * 3)
    turns = {"outcome": "task_completion", "tenant": "acme"}
    assert registry.get_sample_value("loopmesh_turns_total", turns) == 3
    [day] = await read_days(js, s, "acme")
    assert [(line.calls, line.prompt_tokens) for line in day.lines] == [(3, 30)]
    assert day.counted_to(0) and day.counted_to(1) and day.counted_to(2)
    # a restarted exporter resumes on every partition: nothing is counted twice
    again = Exporter(nc, settings, ExporterSettings(), CollectorRegistry())
    for session in sessions.values():
        [event] = [e for e in exporter_turn(session, 1000.0) if e.type == "llm_response"]
        await js.publish(s.event("acme", session, event.type), msgspec.json.encode(event))
    await run_until(again, 3)
    [day] = await read_days(js, s, "acme")
    assert [(line.calls, line.prompt_tokens) for line in day.lines] == [(6, 60)]


async def test_a_schedules_runs_are_followed_in_the_stream_of_their_sessions_partition(
    nats_server,
):
    s = Subjects(partitions=3)
    nc = await connect_fast(nats_server.url)
    clock = Clock()
    scheduler = Scheduler(nc, s, SchedulerSettings(), name="s1", clock=clock)
    try:
        await provision_short(nc, subjects=s)
        sessions = sessions_in_every_partition(s)
        js = nc.jetstream()
        for _ in range(20):  # partition 0's stream is ahead: its sequences mean nothing here
            await js.publish(s.event("acme", sessions[0], "content_delta"), b"{}")
        await scheduler.open()
        schedule = new_schedule(
            "acme", cron="* * * * * *", input="tick", now=T0, id="every",
            session=sessions[2], policy="skip",
        )  # fmt: skip
        await scheduler.store.create(schedule)
        clock.now = T0 + 1.5
        while await scheduler.step(schedule) <= 0:
            pass
        state, _ = await scheduler.store.state("acme", schedule.id)
        assert state is not None
        [run] = state.runs
        assert (run.outcome, run.events_seq) == ("fired", 0)  # partition 2's last sequence
        end = LoopEnd(tenant="acme", session=sessions[2], turn_id=run.turn_id or "",
                      reason="task_completion")  # fmt: skip
        await js.publish(s.event("acme", sessions[2], "loop_end"), encode(end))
        ends = await run_ends(Publisher(nc), s, "acme", state.runs)
        assert ends == {run.turn_id: "task_completion"}
        clock.now = T0 + 2.5  # the run ended (its loop_end found in partition 2): no skip
        while await scheduler.step(schedule) <= 0:
            pass
        state, _ = await scheduler.store.state("acme", schedule.id)
        assert state is not None
        assert [r.outcome for r in state.runs] == ["fired", "fired"]
    finally:
        await scheduler.close()
        await nc.close()


@pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)
async def test_partitioned_events_streams_are_replicated_and_read_from_their_leader(durable):
    settings = NatsSettings(replicas=durable.replicas, partitions=3)
    s = settings.subjects
    nc = await connect_fast(durable.url)
    try:
        await provision_all(nc, settings)
        js = nc.jetstream()
        for stream in s.events_streams:
            assert (await js.stream_info(stream)).config.num_replicas == durable.replicas
        sink = JetStreamEvents(nc, s)
        await sink.start()
        assert sink.acks_each == (durable.replicas > 1)  # every partition replicated alike
        for k, session in sessions_in_every_partition(s).items():
            end = LoopEnd(tenant="acme", session=session, turn_id=f"t{k}", reason="task_completion")
            ack = await js.publish(s.event("acme", session, "loop_end"), encode(end))
            assert ack.stream == f"LOOPMESH_EVENTS_{k}"
            [(stored, _)] = await stream_events(nc, "acme", session, s)
            assert stored == end
    finally:
        await nc.close()
