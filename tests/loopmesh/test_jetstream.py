"""``loopmesh.jetstream.kv_values`` on a real nats-server: a whole bucket, read at once."""

from __future__ import annotations

from nats.js.api import KeyValueConfig

from loopmesh.jetstream import kv_values


async def test_every_live_key_is_read_with_its_last_value(nc):
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="things", history=5))
    for i in range(600):  # more than one fetch, and more than a client reads at once
        await kv.put(f"acme.k{i}", b"old")
        await kv.put(f"acme.k{i}", f"v{i}".encode())
    await kv.put("other.k0", b"theirs")
    await kv.delete("acme.k1")
    await kv.purge("acme.k2")
    for _ in range(3):
        values = await kv_values(js, "things", "acme.*")
        assert len(values) == 598
        assert values["acme.k599"] == b"v599"
        assert "acme.k1" not in values and "acme.k2" not in values
    assert (await kv_values(js, "things"))["other.k0"] == b"theirs"
    assert (await js.stream_info("KV_things")).state.consumer_count == 0  # nothing left behind


async def test_an_empty_bucket_or_filter_reads_as_nothing(nc):
    js = nc.jetstream()
    await js.create_key_value(KeyValueConfig(bucket="empty"))
    assert await kv_values(js, "empty") == {}
    assert await kv_values(js, "empty", "acme.*") == {}
