"""The NATS Agent Protocol host: every agent of the agents bucket registered, in step
with the bucket.

:class:`NatsAgents` watches the agents bucket (:class:`loopmesh.agents.AgentsWatch`, a
KV watch: a change arrives at once) and keeps one :class:`~.host.AgentHost` per agent,
``default`` included (the deployment's ``[loop]``, as the loop workers see it when the
bucket does not hold it). A new agent is registered as soon as the watch has it, so a
caller subscribed to the protocol's heartbeats (``agents.hb.>``) sees its first beat,
and the next discovery finds it. A deleted agent is withdrawn, its prompts in flight
given ``drain_s`` to end. A definition's other changes need nothing here (the loop
worker runs each turn by the definition as it stands); a changed description is
re-registered (the registration says it), the new one first, then the old withdrawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from nats.aio.client import Client

from loopmesh.agents import AgentsWatch
from loopmesh.errors import ConfigError
from loopmesh.mappings import check_turn_partitions
from loopmesh.metrics import MetricsServer
from loopmesh.nats import connect
from loopmesh.provision import check_partitions
from schemas import DEFAULT_AGENT, AgentSpec
from schemas.agents import default_agent

from .host import AgentHost, description_of
from .settings import NatsAgentsConfig

log = logging.getLogger("loopmesh.nats_agents")


def tenant_of(config: NatsAgentsConfig) -> str:
    """The configured tenant; a :class:`ConfigError` when there is none (fail closed: a
    protocol request says no tenant, and none is guessed)."""
    tenant = config.nats_agents.tenant
    if tenant is None:
        raise ConfigError(
            "[nats_agents] tenant",
            "not set: the NATS Agent Protocol carries no tenant, so name the one whose "
            "sessions its prompts run in (LOOPMESH_NATS_AGENTS__TENANT, or --tenant)",
        )
    return tenant


class NatsAgents:
    """The agents of the bucket on the protocol, on ``nc``, until ``run``'s ``stop``."""

    def __init__(self, nc: Client, config: NatsAgentsConfig) -> None:
        self.tenant = tenant_of(config)
        self.settings = config.nats_agents
        self.subjects = config.nats.subjects
        self.hosts: dict[str, AgentHost] = {}
        self.ready = asyncio.Event()  # set once every agent of the first load is registered
        self._nc = nc
        self._changed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``; :class:`ProvisionError` first if the server's events
        streams are for another partition count (a prompt's events would be followed
        in a stream that never gets them)."""
        await check_partitions(self._nc.jetstream(), self.subjects)
        await check_turn_partitions(self._nc, self.subjects)  # else its turns go unpulled
        watch = AgentsWatch(
            self._nc, self.subjects.agents_bucket, on_change=lambda _: self._changed.set()
        )
        async with watch, asyncio.TaskGroup() as retiring:
            try:
                while not stop.is_set():
                    if watch.is_loaded:
                        self._changed.clear()
                        await self._apply(watch.items(), retiring)
                        self.ready.set()
                    await _first(self._changed, stop)
            finally:
                hosts, self.hosts = list(self.hosts.values()), {}
                for host in hosts:
                    retiring.create_task(host.stop(self.settings.drain_s))

    async def _apply(self, specs: Sequence[AgentSpec], retiring: asyncio.TaskGroup) -> None:
        """Register what is new, then withdraw what is gone or re-registered."""
        wanted = {spec.name: spec for spec in specs}
        wanted.setdefault(DEFAULT_AGENT, default_agent())
        old: list[AgentHost] = []
        for name, spec in wanted.items():
            host = self.hosts.get(name)
            if host is not None and description_of(host.spec) == description_of(spec):
                host.spec = spec
                continue
            if host is not None:
                old.append(host)
            new = AgentHost(self._nc, self.subjects, self.settings, spec, tenant=self.tenant)
            await new.start()
            self.hosts[name] = new
        for name in [n for n in self.hosts if n not in wanted]:
            old.append(self.hosts.pop(name))
        for host in old:
            retiring.create_task(host.stop(self.settings.drain_s))


async def _first(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def serve(config: NatsAgentsConfig, stop: asyncio.Event) -> None:
    """Connect and serve every agent until ``stop`` is set (the command, ``loopmesh up``,
    tests), with ``/metrics`` and ``/healthz`` on ``[nats_agents] metrics_port`` if set:
    healthy while connected and every agent of the bucket's first load is registered."""
    tenant_of(config)  # refused before anything connects
    settings = config.nats_agents
    nc = await connect(config.nats, name="nats-agents")
    try:
        host = NatsAgents(nc, config)
        async with contextlib.AsyncExitStack() as stack:
            if settings.metrics_port is not None:
                server = await stack.enter_async_context(
                    MetricsServer(
                        settings.metrics_host,
                        settings.metrics_port,
                        healthy=lambda: nc.is_connected and host.ready.is_set(),
                    )
                )
                print(f"nats-agents metrics at {server.url}/metrics", flush=True)
            await host.run(stop)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
