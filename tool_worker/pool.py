"""Provision one tool pool ahead of its workers, so that it can run none.

A pool that KEDA scales to zero needs two things that no worker is there to make:

- its durable consumer (``pool-<pool>`` on the tools stream), which holds the backlog
  KEDA reads and a starting worker drains. A durable pull consumer has no inactivity
  threshold here, so once made it outlives every worker;
- its tools in the catalog, so that the model keeps being offered them. The entries
  are pinned (``[tool_worker] pinned``, ``tool_worker/catalog.py``) and do not lapse
  with the catalog's TTL.

:func:`provision_pool` makes both from the same settings a worker of the pool would
serve (``loopmesh tool-worker --pool X --provision-only``: a Kubernetes Job, or any
one-off run). MCP servers are started just long enough to list their tools.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

from loopmesh.provision import ensure_consumer
from schemas import Subjects, pool_consumer

from .catalog import Catalog
from .errors import PoolProvisionError
from .mcp import McpServer
from .registry import Registry

log = logging.getLogger("tool_worker.pool")


async def provision_pool(
    nc: Client,
    subjects: Subjects,
    registry: Registry,
    *,
    pool: str,
    pinned: bool,
    ack_wait_s: float = 30.0,
    mcp: list[McpServer] | None = None,
    mcp_start_timeout_s: float = 30.0,
) -> list[str]:
    """Ensure ``pool``'s consumer and put its tools (``registry``, plus what ``mcp``
    servers list) in the catalog; return what was done."""
    js = nc.jetstream()
    actions = [await ensure_consumer(js, pool_consumer(subjects, pool, ack_wait_s=ack_wait_s))]
    servers = mcp or []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(s.run(), name=f"mcp-{s.name}") for s in servers]
            try:
                for server in servers:
                    if not await server.wait_ready(mcp_start_timeout_s):
                        raise PoolProvisionError(
                            pool,
                            f"MCP server {server.name} did not list its tools within "
                            f"{mcp_start_timeout_s:g}s",
                        )
                if not len(registry):
                    raise PoolProvisionError(
                        pool,
                        "it has no tools: assign tools to it in [tool_worker] assign, or "
                        f"serve a module's tools in it with --pool {pool} --module PKG.MODULE",
                    )
                catalog = await Catalog.open(js, subjects, registry, pool, pinned=pinned)
                count = await catalog.publish()
            finally:
                for server in servers:
                    server.close()
                if tasks:
                    await asyncio.wait(tasks, timeout=10.0)
    except ExceptionGroup as group:  # the refusal of the body, said as itself
        refusal = next((e for e in group.exceptions if isinstance(e, PoolProvisionError)), None)
        if refusal is None:
            raise
        raise refusal from None
    kind = "pinned" if pinned else "unpinned (they lapse with the catalog's TTL)"
    actions.append(f"put {count} catalog entries of pool {pool}, {kind}")
    return [a for a in actions if a]
