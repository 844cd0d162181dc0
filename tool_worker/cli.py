"""``loopmesh tool-worker``: serve one pool's tools (local and MCP) from NATS."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from loopmesh.cli import config_from_args
from loopmesh.metrics import MetricsServer
from loopmesh.nats import connect
from loopmesh.provision import provision_all
from loopmesh.shutdown import shutdown_on_signals
from schemas import Subjects

from .builtins import builtin_tools
from .config import ToolWorkerConfig, ToolWorkerSettings
from .files import fs_tools
from .local import load_module
from .mcp import McpServer
from .registry import Registry
from .service import ToolWorker

log = logging.getLogger("tool_worker")

HELP = """Serve a pool of tools (local Python tools and MCP servers) from NATS.

The worker pulls tool-call requests from the pool's durable consumer, runs each call
once (results are recorded by call id), publishes the tool events and replies to the
requester. SIGTERM stops it gracefully."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", help="the pool to serve (default: [tool_worker] pool)")
    parser.add_argument("--concurrency", type=int, help="calls run at once (default 64)")
    parser.add_argument(
        "--module", action="append", default=[], metavar="PKG.MODULE",
        help="import tools from this module (repeatable; adds to [tool_worker] modules)",
    )  # fmt: skip
    parser.add_argument("--fs-root", metavar="DIR", help="serve fs_* tools under DIR")
    parser.add_argument("--metrics-port", type=int, help="serve /metrics on this port")
    parser.add_argument(
        "--no-provision", action="store_true",
        help="do not create missing streams and buckets (the pool's consumer is always ensured)",
    )  # fmt: skip


def settings_from_args(config: ToolWorkerConfig, args: argparse.Namespace) -> ToolWorkerSettings:
    s = config.tool_worker
    changes: dict[str, object] = {}
    if args.pool:
        changes["pool"] = args.pool
    if args.concurrency:
        changes["concurrency"] = args.concurrency
    if args.module:
        changes["modules"] = (*s.modules, *args.module)
    if args.fs_root:
        changes["fs_root"] = args.fs_root
    if args.metrics_port is not None:
        changes["metrics_port"] = args.metrics_port
    return msgspec.structs.replace(s, **changes) if changes else s


def build(settings: ToolWorkerSettings) -> tuple[Registry, list[McpServer]]:
    """The registry of ``settings.pool``'s local tools, and its MCP servers (not started:
    they add their tools when :class:`ToolWorker` runs them)."""
    local = builtin_tools(
        settings.builtins,
        http_allowlist=settings.http_allowlist,
        http_max_bytes=settings.http_max_bytes,
        http_timeout_s=settings.http_timeout_s,
    )
    if settings.fs_root:
        local += fs_tools(Path(settings.fs_root), max_read_bytes=settings.fs_max_bytes)
    for module in settings.modules:
        local += load_module(module)
    registry = Registry(t for t in local if settings.pool_of(t.server, t.name) == settings.pool)
    servers = [McpServer(m, registry) for m in settings.mcp_servers if m.pool == settings.pool]
    return registry, servers


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The tool worker of ``[tool_worker]`` (the built-in tools by default), as a service
    of ``loopmesh up``."""

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        config = config_from_args(ToolWorkerConfig, args)
        nats = msgspec.structs.replace(config.nats, url=nats_url)
        settings = config.tool_worker
        registry, servers = build(settings)
        nc = await connect(nats, name=f"tool-worker-{settings.pool}")
        try:
            worker = ToolWorker(
                nc,
                registry,
                pool=settings.pool,
                subjects=Subjects(nats.prefix),
                concurrency=settings.concurrency,
                ack_wait_s=settings.ack_wait_s,
                drain_timeout_s=settings.drain_timeout_s,
                mcp=servers,
                mcp_start_timeout_s=settings.mcp_start_timeout_s,
            )
            await worker.run(stop)
        finally:
            await nc.drain()

    return service


async def main(args: argparse.Namespace) -> int:
    config = config_from_args(ToolWorkerConfig, args)
    settings = settings_from_args(config, args)
    registry, servers = build(settings)
    async with shutdown_on_signals() as stop:
        nc = await connect(config.nats, name=f"tool-worker-{settings.pool}")
        try:
            if not args.no_provision:
                await provision_all(nc, config.nats)
            worker = ToolWorker(
                nc,
                registry,
                pool=settings.pool,
                subjects=Subjects(config.nats.prefix),
                concurrency=settings.concurrency,
                ack_wait_s=settings.ack_wait_s,
                pull_expires_s=settings.pull_expires_s,
                drain_timeout_s=settings.drain_timeout_s,
                mcp=servers,
                mcp_start_timeout_s=settings.mcp_start_timeout_s,
                event_max_chars=settings.event_max_chars,
                confirm_events=settings.confirm_events,
            )
            async with contextlib.AsyncExitStack() as stack:
                if settings.metrics_port is not None:
                    await stack.enter_async_context(
                        MetricsServer(port=settings.metrics_port, healthy=lambda: nc.is_connected)
                    )
                await worker.run(stop)
        finally:
            await nc.drain()
    log.info("tool worker stopped pool=%s", settings.pool)
    return 0
