import asyncio

import nats
import nats.js.errors
import pytest
from nats.js import api

from loopmesh.errors import ProvisionError
from loopmesh.provision import (
    PIN_HEADERS,
    ensure_bucket,
    ensure_consumer,
    ensure_stream,
    provision,
    provision_all,
)
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import tenant_consumer_of
from schemas import ConsumerDef, KVDef, StreamDef, Subjects, definitions, pool_consumer
from tests.conftest import skip_without_msg_ttl


async def test_provisioning_twice_changes_nothing_the_second_time(nc):
    defs = definitions(Subjects())
    first = await provision(nc.jetstream(), defs)
    assert len(first) == len(defs.streams) + len(defs.consumers) + len(defs.buckets)
    assert all(a.startswith("created ") for a in first)
    assert await provision(nc.jetstream(), defs) == []


async def test_streams_have_their_retention_max_age_and_duplicate_window(nc):
    js = nc.jetstream()
    s = Subjects()
    await provision(js, definitions(s, events_max_age_s=3600, duplicate_window_s=30))
    turns = await js.stream_info(s.turns_stream)
    tools = await js.stream_info(s.tools_stream)
    events = await js.stream_info(s.events_stream)
    assert turns.config.retention == api.RetentionPolicy.WORK_QUEUE
    assert tools.config.retention == api.RetentionPolicy.WORK_QUEUE
    assert events.config.retention == api.RetentionPolicy.LIMITS
    assert events.config.max_age == 3600
    assert turns.config.subjects == [s.stored_turns]
    assert {turns.config.duplicate_window, events.config.duplicate_window} == {30}


async def test_a_republished_message_id_is_stored_once(nc):
    js = nc.jetstream()
    s = Subjects()
    await provision(js, definitions(s))
    subject = s.turn("acme", "s1")
    first = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "turn-1"})
    again = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "turn-1"})
    assert again.duplicate and again.seq == first.seq
    assert (await js.stream_info(s.turns_stream)).state.messages == 1


async def test_a_tenants_consumer_reads_its_turns_alone_and_replaces_the_shared_one(nc):
    js = nc.jetstream()
    s = Subjects()
    await provision(js, definitions(s))
    # a deployment from before: one consumer all workers shared, overlapping every tenant's
    await js.add_consumer(
        s.turns_stream,
        api.ConsumerConfig(durable_name=s.legacy_turns_consumer, ack_policy="explicit"),
    )
    with pytest.raises(ProvisionError, match="turns-acme"):  # a work queue allows no overlap
        await tenant_consumer_of(nc, "acme")
    assert await provision(js, definitions(s)) == [
        f"deleted consumer {s.turns_stream}/{s.legacy_turns_consumer} (replaced)"
    ]
    name = await tenant_consumer_of(nc, "acme", ack_wait_s=12, max_deliver=4)
    info = await js.consumer_info(s.turns_stream, name)
    assert name == "turns-acme" and info.config.filter_subject == "loopmesh.turns.acme.*"
    assert s.tenant_of_filter(info.config.filter_subject) == "acme"
    assert info.config.deliver_subject is None
    assert info.config.ack_policy == api.AckPolicy.EXPLICIT
    assert info.config.ack_wait == 12 and info.config.max_deliver == 4
    await tenant_consumer_of(nc, "globex")  # another tenant's does not overlap
    await js.publish(s.turn("acme", "s1"), b"{}")
    await js.publish(s.turn("globex", "s1"), b"{}")
    assert (await js.consumer_info(s.turns_stream, name)).num_pending == 1
    # a subject with no session is no turn, and no stream keeps it
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await js.publish("loopmesh.turns.acme", b"{}")


def test_a_tenant_that_is_no_valid_id_still_gets_a_consumer_name_and_reads_its_own_filter():
    s = Subjects()
    name = s.tenant_consumer("bad/name")
    assert name.startswith("turns-bad_name") and "/" not in name
    assert s.tenant_of_filter(s.tenant_turns("bad/name")) == "bad/name"
    assert s.tenant_of_filter(s.lane_turns("bad/name", "batch")) == "bad/name"
    assert s.tenant_consumer("bad/name", "batch").startswith("batch-bad_name")
    assert s.tenant_of_filter("loopmesh.events.acme.>") is None


async def test_kv_buckets_have_their_ttl_and_history(nc):
    js = nc.jetstream()
    s = Subjects()
    await provision(js, definitions(s, lease_ttl_s=15, effects_ttl_s=600))
    leases = await js.stream_info(f"KV_{s.leases_bucket}")
    effects = await js.stream_info(f"KV_{s.effects_bucket}")
    sessions = await js.stream_info(f"KV_{s.sessions_bucket}")
    assert leases.config.max_age == 15
    assert effects.config.max_age == 600
    assert sessions.config.max_age == 0
    assert sessions.config.max_msgs_per_subject == 1
    assert effects.config.allow_direct  # reads are one direct get
    kv = await js.key_value(s.sessions_bucket)
    await kv.put("acme.s1", b"snapshot")
    assert (await kv.get("acme.s1")).value == b"snapshot"


async def test_a_retention_change_is_refused_and_the_stream_keeps_its_messages(nc):
    js = nc.jetstream()
    stream = StreamDef(name="S", subjects=("s.>",), retention="limits")
    await ensure_stream(js, stream)
    await js.publish("s.a", b"kept")
    with pytest.raises(ProvisionError) as info:
        await ensure_stream(js, msgspec_replace(stream, retention="workqueue"))
    assert info.value.name == "S"
    assert "retention" in str(info.value) and "1" in str(info.value)
    after = await js.stream_info("S")
    assert after.config.retention == api.RetentionPolicy.LIMITS
    assert after.state.messages == 1


async def test_a_storage_change_is_refused(nc):
    js = nc.jetstream()
    stream = StreamDef(name="S", subjects=("s.>",), storage="file")
    await ensure_stream(js, stream)
    with pytest.raises(ProvisionError, match="storage"):
        await ensure_stream(js, msgspec_replace(stream, storage="memory"))
    assert (await js.stream_info("S")).config.storage == api.StorageType.FILE


async def test_dropping_a_subject_that_holds_messages_is_refused_but_an_empty_one_is_dropped(nc):
    js = nc.jetstream()
    await ensure_stream(js, StreamDef(name="S", subjects=("a.>", "b.>", "c.>")))
    await js.publish("b.x", b"held")
    with pytest.raises(ProvisionError, match=r"'b\.>'.*1 messages"):
        await ensure_stream(js, StreamDef(name="S", subjects=("a.>",)))
    assert (await js.stream_info("S")).config.subjects == ["a.>", "b.>", "c.>"]
    action = await ensure_stream(js, StreamDef(name="S", subjects=("a.>", "b.>")))
    assert action.startswith("updated stream S")
    assert (await js.stream_info("S")).config.subjects == ["a.>", "b.>"]


async def test_safe_stream_changes_are_applied_and_reported(nc):
    js = nc.jetstream()
    stream = StreamDef(name="S", subjects=("s.>",), max_age_s=3600, duplicate_window_s=60)
    await ensure_stream(js, stream)
    await js.publish("s.a", b"kept")
    changed = msgspec_replace(
        stream, max_age_s=7200, duplicate_window_s=10, description="now described"
    )
    action = await ensure_stream(js, changed)
    assert action.startswith("updated stream S")
    assert "max_age" in action and "duplicate_window" in action and "description" in action
    info = await js.stream_info("S")
    assert (info.config.max_age, info.config.duplicate_window) == (7200, 10)
    assert info.config.description == "now described"
    assert info.state.messages == 1
    assert await ensure_stream(js, changed) == ""


async def test_a_consumer_change_of_ack_wait_is_applied(nc):
    js = nc.jetstream()
    s = Subjects()
    await provision(js, definitions(s))
    consumer = pool_consumer(s, "gpu", ack_wait_s=30)
    assert await ensure_consumer(js, consumer) == "created consumer LOOPMESH_TOOLS/pool-gpu"
    action = await ensure_consumer(js, msgspec_replace(consumer, ack_wait_s=90))
    assert action.startswith("updated consumer LOOPMESH_TOOLS/pool-gpu")
    info = await js.consumer_info(s.tools_stream, "pool-gpu")
    assert info.config.ack_wait == 90
    assert info.config.filter_subject == s.pool_tools("gpu")


async def test_a_push_consumer_in_the_way_is_refused(nc):
    js = nc.jetstream()
    await ensure_stream(js, StreamDef(name="S", subjects=("s.>",)))
    await js.add_consumer("S", durable_name="d", deliver_subject="push.here")
    with pytest.raises(ProvisionError, match="pull consumer"):
        await ensure_consumer(js, ConsumerDef(stream="S", durable="d"))


async def test_a_bucket_ttl_change_is_applied_but_shrinking_history_is_refused(nc):
    js = nc.jetstream()
    bucket = KVDef(bucket="b", ttl_s=300, history=5)
    assert await ensure_bucket(js, bucket) == "created bucket b"
    assert (await ensure_bucket(js, msgspec_replace(bucket, ttl_s=20))).startswith(
        "updated bucket b"
    )
    info = await js.stream_info("KV_b")
    assert info.config.max_age == 20
    assert info.config.duplicate_window == 20
    with pytest.raises(ProvisionError, match="revisions"):
        await ensure_bucket(js, msgspec_replace(bucket, ttl_s=20, history=1))
    assert (await js.stream_info("KV_b")).config.max_msgs_per_subject == 5


async def test_a_server_refusal_becomes_a_provision_error_naming_the_stream(nc):
    js = nc.jetstream()
    with pytest.raises(ProvisionError, match="cannot create stream R3") as info:
        await ensure_stream(js, StreamDef(name="R3", subjects=("r.>",), replicas=3))
    assert info.value.name == "R3"


async def test_provision_all_uses_the_configured_prefix_and_event_max_age(nc):
    settings = NatsSettings(prefix="other", events_max_age_s=60)
    actions = await provision_all(nc, settings)
    assert "created stream OTHER_EVENTS" in actions
    events = await nc.jetstream().stream_info("OTHER_EVENTS")
    assert events.config.max_age == 60
    assert events.config.duplicate_window == 60  # never longer than the max age
    assert await provision_all(nc, settings) == []


async def test_the_events_stream_is_bounded_in_size_and_session_snapshots_expire(nc):
    settings = NatsSettings(events_max_bytes=64 * 2**20, sessions_ttl_s=3600)
    await provision_all(nc, settings)
    js = nc.jetstream()
    s = Subjects()
    events = await js.stream_info(s.events_stream)
    assert events.config.max_bytes == 64 * 2**20
    assert events.config.discard == api.DiscardPolicy.OLD
    assert (await js.stream_info(f"KV_{s.sessions_bucket}")).config.max_age == 3600
    dead = await js.stream_info(s.deadletter_stream)
    assert dead.config.subjects == [s.all_deadletter] and dead.config.max_age > 0


async def test_a_changed_size_limit_or_session_ttl_is_applied_and_reported(nc):
    await provision_all(nc, NatsSettings())
    s = Subjects()
    changed = NatsSettings(events_max_bytes=2**20, sessions_ttl_s=120)
    actions = await provision_all(nc, changed)
    assert any(a.startswith(f"updated stream {s.events_stream} (max_bytes") for a in actions)
    assert any(f"bucket {s.sessions_bucket}" in a and "max_age" in a for a in actions)
    js = nc.jetstream()
    assert (await js.stream_info(s.events_stream)).config.max_bytes == 2**20
    assert (await js.stream_info(f"KV_{s.sessions_bucket}")).config.max_age == 120
    assert await provision_all(nc, changed) == []


def test_storage_limits_out_of_range_are_refused():
    import msgspec

    for bad in ({"events_max_bytes": 1000}, {"events_max_bytes": -1}, {"sessions_ttl_s": -5}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, NatsSettings)


def msgspec_replace(obj, **changes):
    import msgspec

    return msgspec.structs.replace(obj, **changes)


async def test_a_bucket_made_without_per_message_ttl_gets_it_for_pinned_entries(nc):
    """Pinned catalog entries are put with ``Nats-TTL: never``, which a stream refuses
    unless it allows per-message TTLs: provisioning turns that on in an older bucket."""
    await skip_without_msg_ttl(nc.connected_url.geturl())
    js = nc.jetstream()
    await js.add_stream(
        api.StreamConfig(
            name="KV_old", subjects=["$KV.old.>"], max_age=30, max_msgs_per_subject=1,
            allow_direct=True, allow_rollup_hdrs=True, deny_delete=True,
            discard=api.DiscardPolicy.NEW,
        )
    )  # fmt: skip
    with pytest.raises(Exception, match=r"(?i)ttl"):
        await js.publish("$KV.old.a", b"x", headers=PIN_HEADERS)
    assert await ensure_bucket(js, KVDef(bucket="old", ttl_s=30)) == (
        "updated bucket old (allow_msg_ttl False → True)"
    )
    await js.publish("$KV.old.a", b"x", headers=PIN_HEADERS)
    assert await ensure_bucket(js, KVDef(bucket="old", ttl_s=30)) == ""


async def test_a_consumer_made_while_the_server_restarts_waits_for_it(nats_server):
    """A worker starting beside its servers: each request meets a closed connection
    for longer than its timeout, and is retried until the server is back."""
    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        s = Subjects()
        await provision(nc.jetstream(), definitions(s))
        js = nc.jetstream(timeout=0.5)  # far shorter than the server is away
        await nats_server.stop()
        made = asyncio.create_task(ensure_consumer(js, pool_consumer(s, "gpu", ack_wait_s=30)))
        await asyncio.sleep(1.5)
        assert not made.done()  # neither failed nor done while the server is down
        await nats_server.start()
        assert await asyncio.wait_for(made, 30) == "created consumer LOOPMESH_TOOLS/pool-gpu"
        info = await nc.jetstream().consumer_info(s.tools_stream, "pool-gpu")
        assert info.config.filter_subject == s.pool_tools("gpu")
    finally:
        await nc.close()
