"""Deliveries: one signed POST per event after the receiver's failures, dead letters after
``max_attempts``, egress refused at delivery, and a slow receiver holding up no other."""

from __future__ import annotations

import logging

import msgspec
import pytest
from nats.aio.client import Client
from standardwebhooks.webhooks import Webhook as ReferenceVerifier

from loopmesh.testing.durable import SUBJECTS, provision_short, stream_events, wait_for
from schemas import Webhook
from schemas.events import Error

from .conftest import (
    SECRET,
    assert_webhook_id,
    consumer_settled,
    delivering,
    documented_verify,
    publish,
    settings,
    turn_events,
)
from .receiver import HANG, receiving


async def test_a_receiver_that_fails_first_gets_one_signed_delivery_per_loop_end(
    nc: Client, nats_url: str
) -> None:
    verify = documented_verify()
    # t1's first try is a 500, its second times out; t2's third try is its first 2xx
    async with receiving(500, HANG, default=200) as receiver:
        hook = Webhook(url=receiver.url)
        t1, t2 = turn_events("t1", hook), turn_events("t2", hook, session="s2")
        async with delivering(nats_url, settings(timeout_s=0.5)):
            seqs = await publish(nc, *t1)
            await receiver.wait(lambda r: len(r.delivered) == 1, "t1 delivered")
            seqs += await publish(nc, *t2)
            await receiver.wait(lambda r: len(r.delivered) == 2, "t2 delivered")
            await wait_for(lambda: consumer_settled(nc), what="every event settled")

    end1, end2 = seqs[1], seqs[3]
    assert [r.answer for r in receiver.requests] == [500, HANG, 200, 200]
    # only the loop_ends (the default events): each the same event on every try
    ids = [r.headers["webhook-id"] for r in receiver.requests]
    id1, id2 = ids[0], ids[3]
    assert ids == [id1] * 3 + [id2]
    await assert_webhook_id(nc, id1, end1)
    await assert_webhook_id(nc, id2, end2)
    js = nc.jetstream()
    for request, seq in zip(receiver.delivered, (end1, end2), strict=True):
        stored = await js.get_msg(SUBJECTS.events_stream, seq)
        assert request.body == stored.data  # the event as the stream stores it
        assert request.headers["content-type"] == "application/json"
        assert verify(SECRET, request.headers, request.body)
        ReferenceVerifier(SECRET).verify(request.body, request.headers)  # raises if not
        assert not verify(SECRET, request.headers, request.body + b" ")
        assert not verify(SECRET.replace("whsec_", "whsec_A"), request.headers, request.body)
    stale = {**receiver.delivered[0].headers, "webhook-timestamp": "1000000000"}
    assert not verify(SECRET, stale, receiver.delivered[0].body)  # a replay, years later
    assert msgspec.json.decode(receiver.delivered[1].body)["turn_id"] == "t2"


async def test_a_receiver_that_never_succeeds_is_dead_lettered_with_an_error_event(
    nc: Client, nats_url: str
) -> None:
    async with receiving(default=503) as receiver:
        hook = Webhook(url=receiver.url, events=("loop_end", "error"))
        async with delivering(nats_url, settings(max_attempts=3)) as service:
            _, end = await publish(nc, *turn_events("t1", hook))
            await wait_for(lambda: service.stats.dead_lettered == 1, what="a dead letter")
            await wait_for(lambda: consumer_settled(nc), what="every event settled")

    assert [r.answer for r in receiver.requests] == [503, 503, 503]  # its own error: not sent
    errors = [e for e, _ in await stream_events(nc, "acme", "s1") if isinstance(e, Error)]
    (error,) = errors
    assert error.code == "webhook_failed" and error.turn_id == "t1" and not error.fatal
    assert f"event {end} (loop_end) to {receiver.url}" in error.message
    assert "given up after 3 tries: the receiver answered 503" in error.message
    dead = await nc.jetstream().get_last_msg(
        SUBJECTS.deadletter_stream, SUBJECTS.deadletter(SUBJECTS.events_stream)
    )
    assert dead.headers is not None
    assert dead.headers["Loopmesh-Seq"] == str(end)
    assert dead.headers["Loopmesh-Deliveries"] == "3"
    assert dead.headers["Loopmesh-Webhook-Url"] == receiver.url
    assert dead.data == (await nc.jetstream().get_msg(SUBJECTS.events_stream, end)).data


async def test_a_private_address_not_allowlisted_is_refused_at_delivery_and_never_tried(
    nc: Client, nats_url: str
) -> None:
    """A turn published to NATS by a client that skipped the check (or an agent's
    webhook): the service applies the egress policy itself, before connecting."""
    async with receiving() as receiver, delivering(nats_url, settings(allowlist=())) as service:
        await publish(nc, *turn_events("t1", Webhook(url=receiver.url)))
        await wait_for(lambda: service.stats.dead_lettered == 1, what="a dead letter")
    assert receiver.requests == []
    (error,) = [e for e, _ in await stream_events(nc, "acme", "s1") if isinstance(e, Error)]
    assert "given up after 1 try" in error.message
    assert "127.0.0.1 is a loopback address" in error.message
    assert "[webhooks] allowlist" in error.message


async def test_a_tenant_without_a_secret_gets_no_delivery_and_is_told_which_setting(
    nc: Client, nats_url: str
) -> None:
    config = settings(secret=None, tenant_secrets={"acme": SECRET})
    async with receiving() as receiver, delivering(nats_url, config) as service:
        hook = Webhook(url=receiver.url)
        await publish(nc, *turn_events("t1", hook, tenant="globex"))
        await publish(nc, *turn_events("t2", hook, tenant="acme"))
        await receiver.wait(lambda r: len(r.delivered) == 1, "acme's delivery")
        await wait_for(lambda: service.stats.dead_lettered == 1, what="globex dead-lettered")
    assert msgspec.json.decode(receiver.delivered[0].body)["tenant"] == "acme"
    (error,) = [e for e, _ in await stream_events(nc, "globex", "s1") if isinstance(e, Error)]
    assert "no webhook secret for tenant globex" in error.message
    assert "[webhooks.tenant_secrets] globex" in error.message


async def test_a_slow_receiver_holds_up_no_other_receiver(nc: Client, nats_url: str) -> None:
    config = settings(per_receiver=2, timeout_s=30.0)
    async with (
        receiving(default=HANG) as slow,
        receiving() as fast,
        delivering(nats_url, config) as service,
    ):
        for i in range(6):  # ahead of the fast receiver's event in the stream
            await publish(nc, *turn_events(f"slow{i}", Webhook(url=slow.url), session=f"s{i}"))
        await slow.wait(lambda r: len(r.requests) == 2, "the slow receiver's two places taken")
        await publish(nc, *turn_events("quick", Webhook(url=fast.url), session="q"))
        await fast.wait(lambda r: len(r.delivered) == 1, "the fast receiver's delivery")
        assert len(slow.requests) == 2  # its other events wait for its places, not the others
        slow.release.set()
        await wait_for(lambda: service.stats.delivered == 7, what="every event delivered")
    assert len(slow.requests) == 6


async def test_past_max_attempts_the_receiver_is_never_tried_again_while_dead_lettering_fails(
    nc: Client, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The dead-letter stream refuses the record (here: too large for it); the event is
    handed back and only the dead letter is tried again, until it is written."""
    js = nc.jetstream()
    config = (await js.stream_info(SUBJECTS.deadletter_stream)).config
    config.max_msg_size = 8
    await js.update_stream(config)
    caplog.set_level(logging.WARNING, logger="loopmesh.webhooks")
    async with receiving(default=503) as receiver:
        hook = Webhook(url=receiver.url)
        async with delivering(nats_url, settings(max_attempts=2)) as service:
            await publish(nc, *turn_events("t1", hook))
            await wait_for(
                lambda: caplog.text.count("not settled") >= 3,
                what="three failed dead letters",
            )
            assert len(receiver.requests) == 2
            config.max_msg_size = -1
            await js.update_stream(config)
            await wait_for(lambda: service.stats.dead_lettered == 1, what="the dead letter")
            await wait_for(lambda: consumer_settled(nc), what="every event settled")
    assert [r.answer for r in receiver.requests] == [503, 503]
    (error,) = [e for e, _ in await stream_events(nc, "acme", "s1") if isinstance(e, Error)]
    assert "given up after 2 tries: the receiver answered 503" in error.message


async def test_a_recreated_events_stream_gives_the_same_sequence_a_new_webhook_id(
    nc: Client, nats_url: str
) -> None:
    """A receiver that drops ids it has seen must not drop the events of a new stream
    (or of another deployment) that reuse a sequence."""
    async with receiving() as receiver:
        hook = Webhook(url=receiver.url)
        async with delivering(nats_url, settings()):
            _, first = await publish(nc, *turn_events("t1", hook))
            await receiver.wait(lambda r: len(r.delivered) == 1, "the first delivery")
        await nc.jetstream().delete_stream(SUBJECTS.events_stream)
        await provision_short(nc)
        async with delivering(nats_url, settings()):  # the deployment made again
            _, second = await publish(nc, *turn_events("t2", hook))
            await receiver.wait(lambda r: len(r.delivered) == 2, "the second delivery")
    assert first == second
    one, two = (r.headers["webhook-id"] for r in receiver.delivered)
    assert one != two
    assert one.endswith(f"-{first}") and two.endswith(f"-{second}")
