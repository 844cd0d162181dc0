"""The fast paths, against a real nats-server: what arrives is what nats-py
would have sent, and whatever it cannot send safely is left to ``Client.publish``."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from loopmesh.fastpath import header_bytes, publish, publish_async, subscribe_inline
from loopmesh.nats import connect
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from tests.loopmesh.conditions import wait_until


async def test_messages_arrive_with_payload_reply_and_headers(nc: Client) -> None:
    sub = await nc.subscribe("lm.events.>")
    await nc.flush()
    assert publish(nc, "lm.events.t.s.loop_start", b'{"a":1}')
    assert publish(nc, "lm.events.t.s.reply", b"x", reply="_INBOX.abc.7")
    assert publish(
        nc, "lm.events.t.s.hdr", b"", headers={"Nats-Msg-Id": "t1:0:loop_start:0", "K": "v w"}
    )
    first = await sub.next_msg(timeout=2)
    assert (first.subject, first.data, first.reply, first.headers) == (
        "lm.events.t.s.loop_start", b'{"a":1}', "", None,
    )  # fmt: skip
    second = await sub.next_msg(timeout=2)
    assert (second.data, second.reply) == (b"x", "_INBOX.abc.7")
    third = await sub.next_msg(timeout=2)
    assert third.data == b""
    assert third.headers == {"Nats-Msg-Id": "t1:0:loop_start:0", "K": "v w"}
    assert nc.stats["out_msgs"] >= 3


async def test_many_messages_keep_their_order(nc: Client) -> None:
    sub = await nc.subscribe("order")
    await nc.flush()
    for i in range(2_000):
        assert publish(nc, "order", str(i).encode(), headers={"Nats-Msg-Id": f"m{i}"})
        if i % 100 == 0:
            await asyncio.sleep(0)
    got = [int((await sub.next_msg(timeout=2)).data) for _ in range(2_000)]
    assert got == list(range(2_000))


async def test_jetstream_takes_the_msg_id_for_deduplication(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(name="DEDUP", subjects=["dedup.>"])
    for _ in range(3):
        assert publish(nc, "dedup.a", b"once", headers={"Nats-Msg-Id": "same"})
    await js.publish("dedup.b", b"after")  # acked: the three before it are stored
    info = await js.stream_info("DEDUP")
    assert info.state.messages == 2


@pytest.mark.parametrize(
    "subject", ["", "has space", "tab\there", "crlf\r\nPUB x 1", "nl\nx"], ids=repr
)
async def test_an_unsafe_subject_is_left_to_nats_py(nc: Client, subject: str) -> None:
    assert not publish(nc, subject, b"x")
    with pytest.raises(nats.errors.BadSubjectError):
        await publish_async(nc, subject, b"x")


def test_headers_that_would_break_the_protocol_are_refused() -> None:
    for headers in ({"K": "a\r\nPUB x 1"}, {"K\n": "v"}, {"": "v"}, {"a:b": "v"}):
        with pytest.raises(ValueError, match="cannot be sent"):
            header_bytes(headers)
    assert header_bytes({"Nats-Msg-Id": "x"}) == b"NATS/1.0\r\nNats-Msg-Id: x\r\n\r\n"


async def test_a_payload_over_the_limit_gets_nats_pys_error(nc: Client) -> None:
    big = b"x" * (nc.max_payload + 1)
    assert not publish(nc, "big", big)
    with pytest.raises(nats.errors.MaxPayloadError):
        await publish_async(nc, "big", big)


async def test_while_reconnecting_publish_async_buffers_like_nats_py(
    nats_server: NatsServer,
) -> None:
    settings = NatsSettings(url=nats_server.url, reconnect_wait_s=0.05)
    watcher = await connect(settings, name="watcher")
    nc = await connect(settings, name="publisher")
    try:
        await nats_server.stop()
        await wait_until(lambda: not nc.is_connected, what="the disconnect")
        assert not publish(nc, "buffered", b"held")
        await publish_async(nc, "buffered", b"held")  # nats-py keeps it while away
        await nats_server.start()
        await wait_until(lambda: nc.is_connected and watcher.is_connected, what="reconnects")
        await nc.flush(timeout=5)  # is_connected turns true mid-reconnect: let it finish
        sub = await watcher.subscribe("buffered")
        await watcher.flush()
        assert publish(nc, "buffered", b"fast again")
        msg = await sub.next_msg(timeout=5)
        if msg.data == b"held":  # the buffered one went out after the subscription
            msg = await sub.next_msg(timeout=5)
        assert msg.data == b"fast again"
    finally:
        await nc.close()
        await watcher.close()


async def test_an_inline_subscription_gets_every_message_in_order(nc: Client) -> None:
    got: list[tuple[str, bytes, dict[str, str] | None]] = []
    sub = await subscribe_inline(
        nc, "inbox.*", lambda m: got.append((m.subject, m.data, m.headers))
    )
    for i in range(100):
        await nc.publish(f"inbox.{i}", str(i).encode(), headers={"N": str(i)} if i % 2 else None)
    await nc.flush()
    await wait_until(lambda: len(got) == 100, what="100 messages")
    assert [int(data) for _, data, _ in got] == list(range(100))
    assert got[3] == ("inbox.3", b"3", {"N": "3"}) and got[4][2] is None
    await sub.unsubscribe()
    await nc.publish("inbox.x", b"after")
    await nc.flush()
    await asyncio.sleep(0.05)
    assert len(got) == 100


async def test_a_failing_inline_handler_does_not_break_the_connection(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    got: list[bytes] = []

    def handler(msg: nats.aio.msg.Msg) -> None:
        if msg.data == b"bad":
            raise RuntimeError("handler bug")
        got.append(msg.data)

    await subscribe_inline(nc, "h", handler)
    for data in (b"one", b"bad", b"two"):
        await nc.publish("h", data)
    await nc.flush()
    await wait_until(lambda: len(got) == 2, what="the good messages")
    assert got == [b"one", b"two"] and nc.is_connected
    assert "handler bug" in caplog.text
