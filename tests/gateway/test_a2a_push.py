"""A2A push notifications through the gateway with the official ``a2a-sdk`` client, on
real servers (fixtures of :mod:`tests.gateway.test_a2a`): a receiver the egress rule
allows gets the task's updates and a private one is refused; a receiver that stalls
holds no task and still gets its end."""

from __future__ import annotations

import pytest
from a2a.types import (
    DeleteTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    SendMessageConfiguration,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError

from loopmesh.testing.fake_replies import text
from tests.gateway.a2a_client import Webhook, a2a_client, follow, message
from tests.gateway.conftest import ACME_KEY, GatewayFactory
from tests.gateway.test_a2a import ANSWER, mesh
from tests.loop_worker.durable import Mesh

__all__ = ["mesh"]  # the fixture, shared


async def test_push_notifications_reach_an_allowed_webhook_and_a_private_one_is_refused(
    mesh: Mesh, gateway_at: GatewayFactory
):
    async with Webhook() as hook:
        push = TaskPushNotificationConfig(id="hook-1", url=hook.url, token="tok-123")
        async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY) as client:
            request = message("say hi")
            request.configuration.CopyFrom(
                SendMessageConfiguration(task_push_notification_config=push)
            )
            with pytest.raises(InvalidParamsError, match="loopback address"):
                await follow(client.send_message(request))
        async with (
            gateway_at(push_allowlist=("127.0.0.1",)) as gw,
            a2a_client(gw.url, ACME_KEY) as client,
        ):
            got = await follow(client.send_message(request))
            assert got.state == TaskState.TASK_STATE_COMPLETED

            def completed(received: list[tuple[dict[str, str], bytes]]) -> bool:
                return any(b"TASK_STATE_COMPLETED" in body for _, body in received)

            await hook.wait(completed)
            assert {h.get("x-a2a-notification-token") for h, _ in hook.received} == {"tok-123"}
            configs = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=got.task_id)
            )
            assert [(c.id, c.url) for c in configs.configs] == [("hook-1", hook.url)]
            await client.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=got.task_id, id="hook-1")
            )
            configs = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=got.task_id)
            )
            assert list(configs.configs) == []


async def test_a_stalled_push_receiver_never_holds_the_task_and_gets_its_end(
    mesh: Mesh, gateway_at: GatewayFactory
):
    assert mesh.fake is not None
    reply = text(ANSWER, chunk_size=2)
    mesh.fake.script(reply, reply)  # the first is retracted by the loop's reminder
    async with Webhook() as hook:
        hook.open.clear()  # it reads each notification and answers none
        async with (
            gateway_at(push_allowlist=("127.0.0.1",), push_timeout_s=600, push_queue=2) as gw,
            a2a_client(gw.url, ACME_KEY) as client,
        ):
            request = message("say it slowly")
            push = TaskPushNotificationConfig(id="slow", url=hook.url, token="t")
            request.configuration.CopyFrom(
                SendMessageConfiguration(task_push_notification_config=push)
            )
            got = await follow(client.send_message(request), timeout=30)
            assert got.state == TaskState.TASK_STATE_COMPLETED  # the stream never waited
            assert len(got.events) > 4, got.kinds  # more updates than the queue holds
            assert len(hook.received) <= 1  # the first, unanswered, or not yet there
            hook.open.set()

            def completed(received: list[tuple[dict[str, str], bytes]]) -> bool:
                return any(b"TASK_STATE_COMPLETED" in body for _, body in received)

            await hook.wait(completed)
        # the one in flight, then at most the queue's 2: the oldest updates dropped,
        # the end kept, once, and last
        bodies = [body for _, body in hook.received]
        assert len(bodies) <= 3, bodies
        assert bodies and b"TASK_STATE_COMPLETED" in bodies[-1]
        assert sum(b"TASK_STATE_COMPLETED" in body for body in bodies) == 1
