"""``loopmesh webhooks``: deliver turns' events to their webhooks (see :mod:`.service`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec

from loopmesh.cli import add_metrics_options, config_from_args, metrics_changes
from loopmesh.metrics import MetricsServer
from loopmesh.nats import connect
from loopmesh.provision import provision_all
from loopmesh.settings import NatsSettings, replace
from loopmesh.shutdown import shutdown_on_signals
from loopmesh.webhook import WebhookSettings, new_secret

from .service import WebhookService

log = logging.getLogger("loopmesh.webhooks")

HELP = """Deliver turns' events to their webhooks: signed POSTs, retried with backoff.

Reads the events stream through a durable consumer (resuming where it acked), POSTs each
event a turn's webhook asks for, signed the Standard Webhooks way with the tenant's
secret ([webhooks] secret, tenant_secrets), and dead-letters an event after [webhooks]
max_attempts failed tries, with an error event on the turn's session. Run one per mesh
(more share the consumer). SIGTERM stops it."""


class WebhooksConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    webhooks: WebhookSettings = WebhookSettings()


def configure(parser: argparse.ArgumentParser) -> None:
    add_metrics_options(parser)
    parser.add_argument(
        "--no-provision", action="store_true",
        help="do not create missing streams, consumers and buckets",
    )  # fmt: skip
    parser.add_argument(
        "--new-secret", action="store_true",
        help="print a new webhook secret (for [webhooks] secret) and exit",
    )  # fmt: skip


def config_of(args: argparse.Namespace) -> WebhooksConfig:
    """The configuration from ``--config``, the environment and the command line."""
    config = config_from_args(WebhooksConfig, args)
    settings = replace(config.webhooks, "the command line", **metrics_changes(args))
    return msgspec.structs.replace(config, webhooks=settings)


async def serve(
    config: WebhooksConfig,
    stop: asyncio.Event,
    *,
    provision: bool = True,
    ready: asyncio.Event | None = None,
    unsigned_level: int = logging.WARNING,
) -> None:
    """Connect, optionally provision, and deliver until ``stop`` is set (the command,
    ``loopmesh up`` and tests)."""
    settings = config.webhooks
    nc = await connect(config.nats, name="webhooks")
    try:
        if provision:
            for action in await provision_all(nc, config.nats):  # a change is never silent
                log.info("%s", action)
        service = WebhookService(nc, config.nats.subjects, settings, unsigned_level=unsigned_level)
        async with contextlib.AsyncExitStack() as stack:
            if settings.metrics_port is not None:
                server = await stack.enter_async_context(
                    MetricsServer(
                        settings.metrics_host,
                        settings.metrics_port,
                        healthy=lambda: nc.is_connected,
                    )
                )
                print(f"webhooks  metrics at {server.url}/metrics", flush=True)
            await service.run(stop, ready)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The webhooks service as a service of ``loopmesh up`` (which has provisioned)."""

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        config = config_of(args)
        config = msgspec.structs.replace(
            config, nats=msgspec.structs.replace(config.nats, url=nats_url)
        )
        await serve(config, stop, provision=False, unsigned_level=logging.INFO)

    return service


async def main(args: argparse.Namespace) -> int:
    if getattr(args, "new_secret", False):
        print(new_secret())
        return 0
    config = config_of(args)
    async with shutdown_on_signals() as stop:
        await serve(config, stop, provision=not getattr(args, "no_provision", False))
    return 0
