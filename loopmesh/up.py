"""``loopmesh up``: everything on one machine, until Ctrl-C.

Starts an embedded nats-server with JetStream (unless a NATS URL is configured),
provisions every stream, consumer and bucket, then runs the services of
:func:`services` as tasks of one task group. SIGINT or SIGTERM stops the services,
then closes the connection and stops the server, leaving no process behind.

Nothing runs on unseen: a child process that dies (the nats-server here, the
llama.cpp server under the loop worker) is reported with its exit status and the end
of its log, then started again on the same port (:func:`loopmesh.process.keep_running`:
after 1, 2 and 4 seconds; the fourth death in a row is given up on). A service that
fails or ends on its own, or a child given up on, is reported, everything else stops,
and ``up`` exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any

import msgspec

from .agents import Agents, check_agents
from .cli import config_from_args
from .errors import ConfigError
from .nats import connect
from .process import keep_running
from .provision import provision_all
from .server import NatsServer
from .settings import NatsSettings
from .shutdown import shutdown_on_signals
from .tls import FILES as TLS_FILES

log = logging.getLogger("loopmesh.up")

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """\
Run loopmesh on this machine until Ctrl-C.

Starts nats-server with JetStream in the store directory (unless --nats-url or
[nats] url names a server, such as tls://HOST:4222 with the [nats] tls_* files),
provisions every stream, consumer and KV bucket, and prints the URLs to connect to.
A process it started that dies (nats-server, the llama.cpp server) is reported and
started again, up to 3 times in a row; after that, or when a service fails, everything
stops and up exits 1, saying why."""

#: A service ``up`` runs: it works until ``stop`` is set, then returns.
Service = Callable[[asyncio.Event, str], Coroutine[Any, Any, None]]


class UpConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    agents: Agents = ()  # provisioned with the rest (docs/AGENTS.md)

    def __post_init__(self) -> None:
        check_agents(self.agents)


#: The services that run beside NATS: name → the module whose ``up_service(args)``
#: returns it (imported only here, so the runtime does not depend on the services).
UP_SERVICES: dict[str, str] = {
    "tool-worker": "tool_worker.cli",
    "loop-worker": "loop_worker.cli",
    "gateway": "gateway.cli",
    "exporter": "loopmesh.exporter",
    "webhooks": "webhooks.cli",
    "nats-agents": "nats_agents.cli",
}


def services(args: argparse.Namespace) -> list[tuple[str, Service]]:
    """The services that run beside NATS, by name. Each is called as
    ``service(stop, nats_url)``; read settings from ``args`` (see ``config_from_args``)."""
    return [
        (name, importlib.import_module(module).up_service(args))
        for name, module in UP_SERVICES.items()
    ]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store-dir", metavar="DIR",
        help="JetStream store of the embedded server (default: [nats] store_dir)",
    )  # fmt: skip
    parser.add_argument(
        "--port", type=int, default=4222,
        help="client port of the embedded server; -1 picks a free one (default: 4222)",
    )  # fmt: skip
    parser.add_argument(
        "--fs-root", metavar="DIR",
        help="also serve the file tools local.fs_list, local.fs_read, local.fs_write under "
        'DIR ([tool_worker] fs_root); to ask before each write set [loop] approval_tools = '
        '["local.fs_write"]',
    )  # fmt: skip
    parser.add_argument(
        "--tools-module", dest="module", action="append", default=[], metavar="PKG.MODULE",
        help="also serve the tools of this Python module, found from the current folder too "
        "(repeatable; [tool_worker] modules)",
    )  # fmt: skip
    parser.add_argument(
        "--monitor-port", type=int, default=8222,
        help="monitoring port of the embedded server; -1 picks a free one (default: 8222)",
    )  # fmt: skip


async def main(args: argparse.Namespace) -> int:
    config = config_from_args(UpConfig, args)
    settings = config.nats
    failed: list[str] = []
    async with shutdown_on_signals() as stop, AsyncExitStack() as stack:
        server: NatsServer | None = None
        if settings.url:
            url, where = settings.url, "external"
            monitor = None
        elif tls := [f for f in TLS_FILES if getattr(settings, f)]:
            raise ConfigError(
                "[nats] " + ", ".join(tls),
                "set without a NATS URL, but the server `loopmesh up` starts has no TLS: "
                "give the URL of your NATS server with TLS (--nats-url tls://HOST:4222)",
            )
        else:
            store = args.store_dir or settings.store_dir
            server = NatsServer(
                store, port=args.port, monitor_port=args.monitor_port,
                mappings=settings.subjects.turn_mappings,  # [nats] turn_partitions
            )  # fmt: skip
            await stack.enter_async_context(server)
            url, where, monitor = server.url, f"embedded, store {store}", server.monitor_url
        nc = await connect(msgspec.structs.replace(settings, url=url), name="loopmesh-up")
        stack.push_async_callback(nc.close)
        actions = await provision_all(nc, settings, agents=config.agents)
        for action in actions:
            log.info(action)

        _say(f"nats      {url} ({where})")
        if monitor:
            _say(f"monitor   {monitor}")
        _say(f"provision {len(actions)} change(s)" if actions else "provision up to date")
        running = services(args)
        for name, _ in running:
            _say(f"service   {name}")
        _say(f"ready; set LOOPMESH_NATS__URL={url} for other commands. Ctrl-C stops.")

        async with asyncio.TaskGroup() as tg:
            if server is not None:
                watch = keep_running("nats-server", server, stop, _say)
                tg.create_task(_part("nats-server", watch, stop, failed))
            for name, service in running:
                part = _part(name, service(stop, url), stop, failed)
                task = tg.create_task(part, name=name)
                ready: asyncio.Event | None = getattr(service, "ready", None)
                if ready is not None:  # the next services need this one (the tool catalog)
                    await _until_ready(ready, task, stop)
            await stop.wait()
        _say("stopping")
    if failed:
        _say(f"stopped: {'; '.join(failed)}")
        return 1
    return 0


async def _part(
    name: str, work: Coroutine[Any, Any, None], stop: asyncio.Event, failed: list[str]
) -> None:
    """Run one part of ``up`` (a service, a child's watch). One that fails, or ends before
    ``stop`` is set, is reported and stops everything: ``up`` never runs on without it.
    What fails once stopping has begun (the server gone with a part given up on, say) is
    a consequence: logged, not reported as the reason."""
    try:
        await work
    except Exception as exc:
        while isinstance(exc, ExceptionGroup):  # a task group's: its first error says why
            exc = exc.exceptions[0]
        if stop.is_set():
            log.warning("%s failed while stopping: %r", name, exc)
            return
        failed.append(f"{name}: {exc}")
    else:
        if stop.is_set():
            return
        failed.append(f"{name} ended on its own")
    _say(f"error     {failed[-1]}; stopping everything")
    stop.set()


async def _until_ready(ready: asyncio.Event, task: asyncio.Task[None], stop: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(ready.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait([*waiters, task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _say(line: str) -> None:
    print(line, flush=True)
