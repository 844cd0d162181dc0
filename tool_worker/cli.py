"""``loopmesh tool-worker``: serve one pool's tools (local and MCP) from NATS."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client

from loopmesh.cli import config_from_args, modules_from_cwd
from loopmesh.metrics import MetricsServer
from loopmesh.nats import connect
from loopmesh.provision import provision_all
from loopmesh.settings import replace
from loopmesh.shutdown import shutdown_on_signals

from .builtins import builtin_tools
from .config import ToolWorkerConfig, ToolWorkerSettings
from .entrypoints import load_entry_points
from .errors import ToolWorkerError
from .files import fs_tools
from .local import load_module
from .mcp import McpServer
from .pool import provision_pool
from .registry import Registry, Tool
from .service import ToolWorker

log = logging.getLogger("tool_worker")

HELP = """Serve a pool of tools (local Python tools and MCP servers) from NATS.

The worker pulls tool-call requests from the pool's durable consumer, runs each call
once (results are recorded by call id), publishes the tool events and replies to the
requester. SIGTERM stops it gracefully."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool", help="the pool to serve (default: [tool_worker] pool); the tools of "
        "--module join it, as [tool_worker] assign would put them there",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, help="calls run at once (default 64)")
    parser.add_argument(
        "--module", action="append", default=[], metavar="PKG.MODULE",
        help="import tools from this module, found from the current folder too (repeatable; "
        "adds to [tool_worker] modules); with --pool P they are served in pool P",
    )  # fmt: skip
    parser.add_argument(
        "--entry-point", action="append", default=[], metavar="NAME",
        help="serve the tools of this 'loopmesh.tools' entry point ('*': all installed; "
        "repeatable; adds to [tool_worker] entry_points)",
    )  # fmt: skip
    parser.add_argument("--fs-root", metavar="DIR", help="serve fs_* tools under DIR")
    parser.add_argument("--metrics-port", type=int, help="serve /metrics on this port")
    parser.add_argument(
        "--no-provision", action="store_true",
        help="do not create missing streams and buckets (the pool's consumer is always ensured)",
    )  # fmt: skip
    parser.add_argument(
        "--provision-only", action="store_true",
        help="create the pool's consumer and put its tools in the catalog (pinned if "
        "[tool_worker] pinned), then exit: a pool KEDA scales to zero needs both up front",
    )  # fmt: skip


def config_of(args: argparse.Namespace) -> ToolWorkerConfig:
    """The configuration from ``--config``, the environment and the command line (an
    option ``args`` lacks, as under ``loopmesh up``, leaves its setting alone). Command-line
    values are validated like the file's. ``--pool P --module M`` assigns M's tools to P
    (an ``assign`` entry of the configuration that names one of them still wins); raises
    :class:`~tool_worker.errors.ToolModuleError` for a module that cannot be imported."""
    config = config_from_args(ToolWorkerConfig, args)
    s = config.tool_worker
    changes: dict[str, object] = {}
    pool = getattr(args, "pool", None)
    if pool is not None:
        changes["pool"] = pool
    if getattr(args, "concurrency", None) is not None:
        changes["concurrency"] = args.concurrency
    if modules := getattr(args, "module", None):
        modules_from_cwd()
        changes["modules"] = (*s.modules, *modules)
        if pool is not None:
            changes["assign"] = {**assigned(modules, pool), **s.assign}
    if getattr(args, "entry_point", None):
        changes["entry_points"] = (*s.entry_points, *args.entry_point)
    if getattr(args, "fs_root", None):
        changes["fs_root"] = args.fs_root
    if getattr(args, "metrics_port", None) is not None:
        changes["metrics_port"] = args.metrics_port
    settings = replace(s, "the command line", **changes)
    return msgspec.structs.replace(config, tool_worker=settings)


def assigned(modules: list[str], pool: str) -> dict[str, str]:
    """``assign`` entries that put every tool of ``modules`` in ``pool``."""
    return {f"{t.server}.{t.name}": pool for module in modules for t in load_module(module)}


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
    local += load_entry_points(settings.entry_points)
    registry = Registry(t for t in local if settings.pool_of(t.server, t.name) == settings.pool)
    servers = [McpServer(m, registry) for m in settings.mcp_servers if m.pool == settings.pool]
    if not registry and not servers:
        _say_no_tools(settings, local)
    return registry, servers


def _say_no_tools(settings: ToolWorkerSettings, local: list[Tool]) -> None:
    """A WARNING for a worker that serves nothing: a tool joins a pool other than
    ``default`` only through ``assign`` (or ``--pool P --module M``)."""
    elsewhere = sorted({settings.pool_of(t.server, t.name) for t in local})
    loaded = f"the tools loaded are in pool {', '.join(elsewhere)}" if local else "none loaded"
    example = f"{local[0].server}.{local[0].name}" if local else "local.my_tool"
    log.warning(
        "pool %s serves no tools (%s) and runs no MCP server: serve a module's tools in "
        "it with `loopmesh tool-worker --pool %s --module PKG.MODULE`, or assign tools to "
        "it in [tool_worker] assign, e.g. assign = { \"%s\" = \"%s\" }",
        settings.pool, loaded, settings.pool, example, settings.pool,
    )  # fmt: skip


def worker_of(
    nc: Client, config: ToolWorkerConfig, registry: Registry, servers: list[McpServer]
) -> ToolWorker:
    """The worker that ``config`` describes: the one place settings become arguments."""
    settings = config.tool_worker
    return ToolWorker(
        nc,
        registry,
        pool=settings.pool,
        subjects=config.nats.subjects,
        concurrency=settings.concurrency,
        ack_wait_s=settings.ack_wait_s,
        pull_expires_s=settings.pull_expires_s,
        drain_timeout_s=settings.drain_timeout_s,
        mcp=servers,
        mcp_start_timeout_s=settings.mcp_start_timeout_s,
        pinned=settings.pinned,
        event_max_chars=settings.event_max_chars,
        confirm_events=settings.confirm_events,
    )


async def serve(
    config: ToolWorkerConfig,
    stop: asyncio.Event,
    *,
    provision: bool,
    ready: asyncio.Event | None = None,
    announce: bool = False,
) -> None:
    """Connect, optionally provision, and serve the pool until ``stop`` is set: the
    standalone command and ``loopmesh up`` both run this. ``ready`` is set once the
    worker serves and its tools are in the catalog; ``announce`` prints the tools."""
    settings = config.tool_worker
    registry, servers = build(settings)
    if announce:
        names = ", ".join(sorted(f"{t.server}.{t.name}" for t in registry))
        mcp = f" + MCP: {', '.join(m.name for m in servers)}" if servers else ""
        print(f"tools     pool {settings.pool}: {names}{mcp}", flush=True)
    nc = await connect(config.nats, name=f"tool-worker-{settings.pool}")
    try:
        if provision:
            for action in await provision_all(nc, config.nats):  # a change is never silent
                log.log(
                    logging.WARNING if action.startswith("updated") else logging.INFO, "%s", action
                )
        worker = worker_of(nc, config, registry, servers)
        async with contextlib.AsyncExitStack() as stack:
            if settings.metrics_port is not None:
                await stack.enter_async_context(
                    MetricsServer(
                        settings.metrics_host,
                        settings.metrics_port,
                        healthy=lambda: nc.is_connected,
                    )
                )
            async with asyncio.TaskGroup() as tg:
                running = tg.create_task(worker.run(stop))
                if ready is not None:
                    await _first(worker.ready.wait(), running)
                    ready.set()
    finally:
        await nc.drain()


async def _first(*aws: Awaitable[object]) -> None:
    """Wait until one of ``aws`` is done; cancel the others (tasks are left running)."""
    futures = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future, aw in zip(futures, aws, strict=True):
            if future is not aw:
                future.cancel()


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The tool worker of ``[tool_worker]`` (the built-in tools by default, and ``up``'s
    ``--fs-root`` / ``--tools-module``), as a service of ``loopmesh up`` (which has
    provisioned already). Its ``ready`` event is set once its tools are in the catalog,
    so that ``up`` starts the loop worker after that (a loop worker reads the catalog
    when it starts, then only every ``catalog_refresh_s``)."""
    ready = asyncio.Event()

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        config = config_of(args)
        nats = msgspec.structs.replace(config.nats, url=nats_url)
        config = msgspec.structs.replace(config, nats=nats)
        await serve(config, stop, provision=False, ready=ready, announce=True)

    service.ready = ready  # type: ignore[attr-defined]
    return service


async def provision_only(config: ToolWorkerConfig, *, provision: bool) -> list[str]:
    """What ``--provision-only`` does: see :mod:`tool_worker.pool`."""
    settings = config.tool_worker
    registry, servers = build(settings)
    nc = await connect(config.nats, name=f"tool-worker-{settings.pool}-provision")
    try:
        actions = await provision_all(nc, config.nats) if provision else []
        return actions + await provision_pool(
            nc,
            config.nats.subjects,
            registry,
            pool=settings.pool,
            pinned=settings.pinned,
            ack_wait_s=settings.ack_wait_s,
            mcp=servers,
            mcp_start_timeout_s=settings.mcp_start_timeout_s,
        )
    finally:
        await nc.drain()


async def main(args: argparse.Namespace) -> int:
    try:
        config = config_of(args)
        if args.provision_only:
            for action in await provision_only(config, provision=not args.no_provision):
                print(action, flush=True)
            return 0
        async with shutdown_on_signals() as stop:
            await serve(config, stop, provision=not args.no_provision)
    except ToolWorkerError as exc:  # tools that cannot be loaded: refuse to serve without them
        print(f"loopmesh tool-worker: error: {exc}", file=sys.stderr, flush=True)
        return 1
    log.info("tool worker stopped pool=%s", config.tool_worker.pool)
    return 0
