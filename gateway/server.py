"""The gateway as a running server: NATS connection, app and uvicorn, in the caller's
event loop::

    async with GatewayServer(config) as gateway:
        print(gateway.url)
        await stop.wait()

Refuses to start without API keys unless no-auth is on, and refuses no-auth on a
non-loopback host unless ``no_auth_any_host`` says so too (fail closed). Refuses, too,
a ``[nats] partitions`` other than the one the server's events streams were made for:
it would look for each session's events in another stream (:class:`ProvisionError`).
An address it cannot listen on (a port in use) is a :class:`ConfigError` too, raised from
``__aenter__`` like the others, never uvicorn's exit of the whole process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

import uvicorn
from nats.aio.client import Client

from loopmesh.egress import Allowlist
from loopmesh.errors import ConfigError
from loopmesh.jetstream import worker_name
from loopmesh.mappings import check_turn_partitions
from loopmesh.nats import connect
from loopmesh.provision import check_partitions
from loopmesh.scheduler import Scheduler

from .app import create_app
from .backend import Backend
from .core import Gateway
from .mcp import McpEndpoint
from .retention import Retention
from .settings import GatewayConfig, GatewaySettings

log = logging.getLogger("loopmesh.gateway")


def check_settings(settings: GatewaySettings) -> None:
    """Raise :class:`ConfigError` for an unsafe or useless auth set-up."""
    if settings.no_auth:
        if not is_loopback(settings.host) and not settings.no_auth_any_host:
            raise ConfigError(
                "[gateway]",
                f"no_auth = true on host {settings.host!r}, which is not a loopback address: "
                "anyone who can reach it would act as tenant 'local'. Bind to 127.0.0.1, "
                "or also set no_auth_any_host = true if that is really meant.",
            )
        if settings.api_keys:
            raise ConfigError("[gateway]", "no_auth = true and api_keys are both set; pick one")
    try:
        Allowlist(settings.push_allowlist, setting="push_allowlist")
    except ValueError as exc:
        raise ConfigError("[gateway] push_allowlist", str(exc)) from None
    if not settings.no_auth and not settings.api_keys:
        raise ConfigError(
            "[gateway]",
            "no api_keys configured: add [[gateway.api_keys]] entries "
            "(sha256 = ..., tenant = ...; `python -m gateway.keys` makes one), "
            "or set no_auth = true for a local, loopback-only gateway",
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the caller's stop event rules; and without
    its ``sys.exit(3)`` when it cannot listen (a port in use, an address not of this
    machine): in a task, ``SystemExit`` would escape the event loop and end the whole
    process with code 3, past every service's drain. It raises :class:`ConfigError`."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit as exc:
            why = exc.__context__  # the OSError that uvicorn logged before it exited
            raise ConfigError(
                "[gateway] host and port",
                f"the gateway cannot listen on {self.config.host}:{self.config.port} ({why}): "
                "stop what holds that port, or set another one (0: any free port)",
            ) from why


class GatewayServer:
    def __init__(self, config: GatewayConfig, *, nc: Client | None = None) -> None:
        check_settings(config.gateway)
        self.config = config
        self._nc = nc
        self._own_nc = nc is None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.gateway: Gateway | None = None
        self.scheduler: Scheduler | None = None
        self.retention: Retention | None = None
        self.mcp: McpEndpoint | None = None
        self.port = config.gateway.port

    @property
    def url(self) -> str:
        host = self.config.gateway.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}"

    async def __aenter__(self) -> GatewayServer:
        settings = self.config.gateway
        if self._nc is None:
            self._nc = await connect(self.config.nats, name="gateway")
        try:
            subjects = self.config.nats.subjects
            await check_partitions(self._nc.jetstream(), subjects)
            await check_turn_partitions(self._nc, subjects)
            backend = Backend(
                self._nc,
                subjects,
                timeout=settings.nats_timeout_s,
                max_schedules=self.config.scheduler.max_per_tenant,
            )
            self.gateway = Gateway(
                settings, backend, on_busy=self.config.loop.on_busy,
                webhooks=self.config.webhooks, tenants=self.config.tenants,
            )  # fmt: skip
            # the MCP SDK's session manager runs before the first request and stops
            # after the last (uvicorn's lifespan is off: this class is the lifespan)
            self.mcp = await McpEndpoint(self.gateway).__aenter__()
            app = create_app(self.gateway, self.mcp)
            uv = uvicorn.Config(
                app, host=settings.host, port=settings.port, log_config=None,
                lifespan="off", access_log=False, timeout_graceful_shutdown=2,
            )  # fmt: skip
            self._server = _Server(uv)
            self._task = asyncio.create_task(self._server.serve(), name="gateway-http")
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError("the gateway's HTTP server stopped while starting")
                await asyncio.sleep(0.01)
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
            if self.config.scheduler.enabled:
                self.scheduler = Scheduler(
                    self._nc, backend.subjects, self.config.scheduler,
                    name=f"gateway-{worker_name()}", publisher=backend.publisher(),
                )  # fmt: skip
                self.scheduler.start()
            self.retention = Retention(
                backend, self.config.tenants, every_s=settings.retention_sweep_s,
                cancel_wait_s=settings.erase_cancel_wait_s,
            )  # fmt: skip
            self.retention.start()
        except BaseException:
            await self.close()
            raise
        if settings.no_auth:
            log.warning("gateway in NO-AUTH mode: every request is tenant 'local' url=%s", self.url)
        log.info("gateway listening url=%s keys=%d", self.url, len(settings.api_keys))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        retention, self.retention = self.retention, None
        if retention is not None:
            await retention.close()
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            await scheduler.close()
        server, task = self._server, self._task
        self._server = self._task = None
        mcp, self.mcp = self.mcp, None
        if mcp is not None:
            mcp.closing = True  # the MCP calls it holds end with it; their turns go on
        if self.gateway is not None:
            await self.gateway.a2a.close()  # its streams end; the turns go on
        if server is not None and task is not None:
            server.should_exit = True
            with contextlib.suppress(Exception):  # its failure to start was raised already
                await task
        if mcp is not None:
            await mcp.close()
        if self.gateway is not None:
            await self.gateway.fanout.close()
        await self._close_nats()

    async def _close_nats(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and self._own_nc:
            with contextlib.suppress(Exception):
                await nc.drain()
