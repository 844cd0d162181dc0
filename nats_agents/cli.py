"""``loopmesh nats-agents``: every named agent on the NATS Agent Protocol."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from loopmesh.cli import add_metrics_options, config_from_args, metrics_changes
from loopmesh.settings import replace
from loopmesh.shutdown import shutdown_on_signals

from .service import serve, tenant_of
from .settings import NatsAgentsConfig

HELP = """Serve every named agent on the NATS Agent Protocol (Synadia, version 0.3).

Each agent of the agents bucket is registered as a protocol agent, so any NATS client
finds it with `Agents(nc=nc).discover()` (synadia-ai-agents) and prompts it: a prompt
runs a turn of the agent in the configured tenant ([nats_agents] tenant, required) and
streams its reply. Run one or many per mesh (prompts are shared out between them).
SIGTERM stops it after prompts in flight end ([nats_agents] drain_s)."""

#: The tenant of ``loopmesh up``'s protocol prompts when none is configured and ``up``
#: runs its own server (on loopback): the gateway's no-auth tenant there, so the
#: sessions show in the web view.
UP_TENANT = "local"


def configure(parser: argparse.ArgumentParser) -> None:
    add_metrics_options(parser)
    parser.add_argument(
        "--tenant", help="the tenant prompts run in (default: [nats_agents] tenant; required)"
    )


def config_of(args: argparse.Namespace) -> NatsAgentsConfig:
    config = config_from_args(NatsAgentsConfig, args)
    changes = metrics_changes(args)
    if getattr(args, "tenant", None):
        changes["tenant"] = args.tenant
    settings = replace(config.nats_agents, "the command line", **changes)
    return msgspec.structs.replace(config, nats_agents=settings)


async def main(args: argparse.Namespace) -> int:
    config = config_of(args)
    tenant = tenant_of(config)
    async with shutdown_on_signals() as stop:
        print(f"nats-agents serving the agents of tenant {tenant}", flush=True)
        await serve(config, stop)
    return 0


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The host as a service of ``loopmesh up``. With no ``[nats_agents] tenant``, it
    serves tenant ``local`` when ``up`` runs its own server (loopback only, as the
    gateway's no-auth), and does not run on a server ``up`` was pointed at."""

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        config = config_from_args(NatsAgentsConfig, args)
        settings = config.nats_agents
        if settings.tenant is None:
            if config.nats.url:
                print(
                    "agents    not on the NATS Agent Protocol: set [nats_agents] tenant "
                    "(LOOPMESH_NATS_AGENTS__TENANT) to serve them on this server",
                    flush=True,
                )
                await stop.wait()
                return
            settings = msgspec.structs.replace(settings, tenant=UP_TENANT)
        config = msgspec.structs.replace(
            config,
            nats=msgspec.structs.replace(config.nats, url=nats_url),
            nats_agents=settings,
        )
        print(
            f"agents    on the NATS Agent Protocol, tenant {settings.tenant} "
            "(Agents(nc=nc).discover() in synadia-ai-agents)",
            flush=True,
        )
        await serve(config, stop)

    return service
