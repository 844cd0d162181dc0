"""``loopmesh.jetstream.Publisher``'s reading of acks, against answers a nats-server 2.10
cluster gives: a duplicate of sequence 0 vouches for nothing."""

from __future__ import annotations

import pytest
from nats.js.errors import APIError

from loopmesh.jetstream import IN_PROCESS_ERR_CODE, Publisher, acked, is_transient


async def answering(nc, subject: str, answer: bytes):
    """A responder on ``subject`` that answers every publish with ``answer`` (the ack a
    stream's leader would send)."""

    async def reply(msg):
        await nc.publish(msg.reply, answer)

    return await nc.subscribe(subject, cb=reply)


async def test_a_duplicate_of_sequence_0_is_not_an_ack_and_is_worth_publishing_again(nc):
    # nats-server 2.10 answers so for a message id whose first copy its leader proposed
    # and never stored (lost with a leader change): the copy was dropped, not kept.
    await answering(nc, "acks.zero", b'{"stream":"S","seq":0,"duplicate":true}')
    await answering(nc, "acks.kept", b'{"stream":"S","seq":7,"duplicate":true}')
    publisher = Publisher(nc)
    with pytest.raises(APIError) as raised:
        await acked(publisher, "acks.zero", b"x", {"Nats-Msg-Id": "m1"})
    assert raised.value.err_code == IN_PROCESS_ERR_CODE
    assert is_transient(raised.value)  # retry() publishes it again
    ack = await acked(publisher, "acks.kept", b"x", {"Nats-Msg-Id": "m1"})
    assert (ack.seq, ack.duplicate) == (7, True)  # a true duplicate is stored: an ack
    await publisher.close()


async def test_the_in_process_error_of_newer_servers_is_worth_publishing_again(nc):
    answer = (
        b'{"stream":"S","error":{"code":409,"err_code":10158,'
        b'"description":"duplicate message id is in process"}}'
    )
    await answering(nc, "acks.in_process", answer)
    publisher = Publisher(nc)
    with pytest.raises(APIError) as raised:
        await acked(publisher, "acks.in_process", b"x", {"Nats-Msg-Id": "m1"})
    assert raised.value.err_code == IN_PROCESS_ERR_CODE and is_transient(raised.value)
    await publisher.close()
