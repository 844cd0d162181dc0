"""``loopmesh run --webhook URL``, over NATS and through the gateway, as a person types it:
the turn's ``loop_end`` reaches the receiver; and ``loopmesh webhooks --new-secret``."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import pytest

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.commands.run import webhook_of
from loopmesh.errors import LoopmeshError
from loopmesh.settings import NatsSettings
from loopmesh.webhook import WebhookSettings
from schemas import Webhook
from tests.loop_worker.durable import mesh_on
from tests.loopmesh.commands.test_commands import loopmesh

from .conftest import SECRET, delivering, documented_verify, settings
from .receiver import receiving

pytestmark = pytest.mark.slow


def test_the_webhook_options_make_the_turns_webhook() -> None:
    def args(**given: Any) -> argparse.Namespace:
        return argparse.Namespace(**{"webhook": None, "webhook_events": None, **given})

    assert webhook_of(args()) is None
    assert webhook_of(args(webhook="https://h.example/x")) == Webhook(url="https://h.example/x")
    both = webhook_of(args(webhook="https://h/x", webhook_events=["error", "loop_end", "error"]))
    assert both == Webhook(url="https://h/x", events=("error", "loop_end"))
    with pytest.raises(LoopmeshError, match="--webhook-event needs --webhook URL"):
        webhook_of(args(webhook_events=["loop_end"]))
    with pytest.raises(LoopmeshError, match=r"--webhook: .* at `\$.url`"):
        webhook_of(args(webhook="ftp://h/x"))


@pytest.mark.parametrize("transport", ["nats", "gateway"])
async def test_run_with_a_webhook_gets_the_turns_loop_end_posted(
    transport: str, nats_server: Any
) -> None:
    config = settings()
    async with (
        receiving() as receiver,
        mesh_on(nats_server.url) as mesh,
        delivering(nats_server.url, config),
    ):
        await mesh.tool_worker()
        await mesh.loop_worker(webhooks=config)
        gateway_config = GatewayConfig(
            nats=NatsSettings(url=mesh.url, reconnect_wait_s=0.05),
            gateway=GatewaySettings(no_auth=True, port=0),
            webhooks=WebhookSettings(allow_http=True, allowlist=("127.0.0.1",)),
        )
        async with GatewayServer(gateway_config) as gateway:
            where = ["--gateway", gateway.url] if transport == "gateway" else []
            code, lines = await loopmesh(
                "run", "--nats-url", mesh.url, *where, "--session", "s1",
                "--webhook", receiver.url, "--webhook-event", "loop_end", "say hi",
            )  # fmt: skip
            assert code == 0, lines
            await receiver.wait(lambda r: len(r.delivered) == 1, "the loop_end")
    (delivered,) = receiver.delivered
    event = msgspec.json.decode(delivered.body)
    assert (event["type"], event["session"]) == ("loop_end", "s1")
    assert event["reason"] == "task_completion"
    assert documented_verify()(SECRET, delivered.headers, delivered.body)


async def test_new_secret_prints_a_secret_the_settings_take() -> None:
    code, lines = await loopmesh("webhooks", "--new-secret")
    assert code == 0, lines
    (secret,) = [line for line in lines if line.startswith("whsec_")]
    assert WebhookSettings(secret=secret).secret_for("anyone") == secret
