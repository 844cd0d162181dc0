"""The service killed while an event waits for its next try: the next process delivers it
once, and no later restart delivers it again."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client

from loopmesh.provision import ensure_consumer
from loopmesh.testing.durable import SUBJECTS, Proc, wait_for
from schemas import Webhook
from schemas.streams import webhooks_consumer

from .conftest import (
    SECRET,
    assert_webhook_id,
    consumer_settled,
    documented_verify,
    publish,
    turn_events,
)
from .receiver import receiving

pytestmark = pytest.mark.slow


def service(nats_url: str) -> Proc:
    return Proc(
        "-m", "webhooks", "--no-provision",
        env={
            "LOOPMESH_NATS__URL": nats_url,
            "LOOPMESH_NATS__RECONNECT_WAIT_S": "0.05",
            "LOOPMESH_WEBHOOKS__SECRET": SECRET,
            "LOOPMESH_WEBHOOKS__ALLOW_HTTP": "true",
            "LOOPMESH_WEBHOOKS__ALLOWLIST": "127.0.0.1",
            "LOOPMESH_WEBHOOKS__BACKOFF_S": "1.5",  # the window the kill falls in
            "LOOPMESH_WEBHOOKS__TIMEOUT_S": "1",
            "LOOPMESH_WEBHOOKS__MAX_ATTEMPTS": "5",
        },
    )  # fmt: skip


async def test_a_service_killed_mid_retry_delivers_once_and_never_again(
    nc: Client, nats_url: str
) -> None:
    # an event held by a killed process comes back after this AckWait, not 120 s
    short = msgspec.structs.replace(webhooks_consumer(SUBJECTS), ack_wait_s=3.0)
    await ensure_consumer(nc.jetstream(), short)
    verify = documented_verify()
    async with receiving(500, default=200) as receiver:
        hook = Webhook(url=receiver.url)
        first = await service(nats_url).start(ready="webhooks ready")
        try:
            _, end = await publish(nc, *turn_events("t1", hook))
            await first.wait_line("try 1 of 5 failed")  # then handed back for ~1.5 s
        finally:
            first.kill()
            await first.close()
        assert [r.answer for r in receiver.requests] == [500]

        second = await service(nats_url).start(ready="webhooks ready")
        try:
            await receiver.wait(lambda r: len(r.delivered) == 1, "the delivery after the restart")
            await wait_for(lambda: consumer_settled(nc), what="the event acked")
            assert await second.terminate() == 0
        finally:
            await second.close()

        third = await service(nats_url).start(ready="webhooks ready")
        try:  # a later event delivered, and nothing before it again
            _, probe = await publish(nc, *turn_events("t2", hook, session="s2"))
            await receiver.wait(lambda r: len(r.delivered) == 2, "the probe's delivery")
            await wait_for(lambda: consumer_settled(nc), what="the probe acked")
        finally:
            third.kill()
            await third.close()

    ids = [r.headers["webhook-id"] for r in receiver.delivered]
    assert len(ids) == 2
    await assert_webhook_id(nc, ids[0], end)
    await assert_webhook_id(nc, ids[1], probe)
    assert [r.answer for r in receiver.requests] == [500, 200, 200]
    assert all(verify(SECRET, r.headers, r.body) for r in receiver.delivered)
