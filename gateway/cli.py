"""``loopmesh gateway``: the HTTP gateway (sessions, turns, SSE events, controls)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from loopmesh.cli import config_from_args
from loopmesh.settings import replace
from loopmesh.shutdown import shutdown_on_signals

from .server import GatewayServer
from .settings import GatewayConfig

HELP = """Serve the HTTP gateway: sessions, turns, SSE event streams, controls.

API keys ([gateway] api_keys, stored as SHA-256) map to tenants; --no-auth makes every
request tenant 'local' and is refused on a non-loopback host unless
[gateway] no_auth_any_host is also set. The API is at /docs and /openapi.json."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (default: [gateway] host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: [gateway] port, 8080)")
    parser.add_argument(
        "--no-auth", action="store_true",
        help="no API keys: every request is tenant 'local' (loopback only)",
    )  # fmt: skip


def config_of(args: argparse.Namespace) -> GatewayConfig:
    config = config_from_args(GatewayConfig, args)
    changes: dict[str, object] = {}
    if getattr(args, "host", None):
        changes["host"] = args.host
    if getattr(args, "port", None) is not None:
        changes["port"] = args.port
    if getattr(args, "no_auth", False):
        changes["no_auth"] = True
    return msgspec.structs.replace(
        config, gateway=replace(config.gateway, "the command line", **changes)
    )


async def main(args: argparse.Namespace) -> int:
    config = config_of(args)
    async with shutdown_on_signals() as stop, GatewayServer(config) as gateway:
        print(f"gateway   {gateway.url} (API docs at {gateway.url}/docs)", flush=True)
        print(f"web view  {gateway.url}/", flush=True)
        await stop.wait()
    return 0


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The gateway as a service of ``loopmesh up``: no-auth, on loopback, port 8080
    (``[gateway]`` settings apply, but no-auth is forced and the host kept loopback)."""

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        config = config_from_args(GatewayConfig, args)
        gateway_settings = config.gateway
        if not gateway_settings.api_keys:
            gateway_settings = msgspec.structs.replace(
                gateway_settings, no_auth=True, no_auth_any_host=False
            )
        config = msgspec.structs.replace(
            config,
            nats=msgspec.structs.replace(config.nats, url=nats_url),
            gateway=gateway_settings,
        )
        async with GatewayServer(config) as gateway:
            auth = "no auth, tenant local" if gateway_settings.no_auth else "API keys"
            print(f"gateway   {gateway.url} ({auth}; API docs at {gateway.url}/docs)", flush=True)
            print(f"web view  {gateway.url}/", flush=True)
            await stop.wait()

    return service
