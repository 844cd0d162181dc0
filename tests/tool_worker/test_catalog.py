"""The catalog: live workers keep their tools' specs in the catalog bucket."""

from __future__ import annotations

import asyncio
import os
import sys

from nats.aio.client import Client
from nats.js import JetStreamContext

from loopmesh.catalog import read_catalog
from loopmesh.commands.tools import render
from loopmesh.server import NatsServer
from schemas import ToolSpec
from tool_worker import Registry, load_module, to_tool, tool
from tool_worker.builtins import builtin_tools

from .harness import ROOT, SUBJECTS, running


async def wait_for_catalog(
    js: JetStreamContext, check: object, timeout: float = 10.0
) -> list[ToolSpec]:
    """Read the catalog until ``check(specs)`` holds (the bucket has no change feed we
    could use without a watcher per test; reads are cheap)."""
    async with asyncio.timeout(timeout):
        while True:
            specs = await read_catalog(js, SUBJECTS)
            if check(specs):  # type: ignore[operator]
                return specs
            await asyncio.sleep(0.05)


async def test_a_worker_publishes_its_specs_and_they_expire_after_it_stops(
    nc: Client, js: JetStreamContext
) -> None:
    registry = Registry(builtin_tools(("calculator",)))
    async with running(nc, registry, pool="fast", catalog=True):
        specs = await read_catalog(js, SUBJECTS)
        assert [(s.server, s.name, s.pool) for s in specs] == [("local", "calculator", "fast")]
        assert specs[0].input_schema["required"] == ["expression"]
        assert specs[0].description.startswith("Evaluate an arithmetic expression")

        @tool(name="late")
        def late() -> str:
            """Registered while the worker runs."""
            return "late"

        registry.add(to_tool(late))
        specs = await wait_for_catalog(js, lambda s: len(s) == 2)
        assert {s.name for s in specs} == {"calculator", "late"}
    # The catalog bucket's TTL is 3 s here: nobody refreshes the specs any more.
    await wait_for_catalog(js, lambda s: s == [], timeout=10)


async def test_loopmesh_tools_prints_the_catalog(
    nats_server: NatsServer, nc: Client, js: JetStreamContext
) -> None:
    registry = Registry(load_module("tests.tool_worker.sample_tools"))
    async with running(nc, registry, catalog=True):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loopmesh", "tools", "--nats-url", nats_server.url,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert text.splitlines()[0].split() == ["TOOL", "POOL", "TIMEOUT", "DESCRIPTION"]
    assert "local.echo" in text and "Return the text unchanged." in text
    assert ["local.too_slow", "default", "0.2s"] in [line.split()[:3] for line in text.splitlines()]


def test_an_empty_catalog_says_so() -> None:
    assert "no tools in the catalog" in render([])


async def test_a_catalog_and_effects_opened_while_the_server_restarts_wait_for_it(
    nats_server: NatsServer,
) -> None:
    """A tool worker starting while its server does (a node restarted, a rolling
    upgrade): opening the catalog, and the effect records, meets a closed connection for
    longer than a request's timeout, and waits for the server instead of ending the
    worker."""
    import nats

    from loopmesh.jetstream import Publisher
    from loopmesh.testing.durable import provision_short
    from tool_worker.catalog import Catalog
    from tool_worker.effects import Effects

    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        await provision_short(nc)
        js = nc.jetstream(timeout=0.5)  # far shorter than the server is away
        await nats_server.stop()
        registry = Registry(builtin_tools(("calculator",)))
        opened = asyncio.create_task(Catalog.open(js, SUBJECTS, registry, "fast"))
        await asyncio.sleep(1.5)
        assert not opened.done()  # neither failed nor done while the server is down
        await nats_server.start()
        catalog = await asyncio.wait_for(opened, 30)
        assert await catalog.publish() == 1
        await nats_server.stop()  # and its effect records, the same
        publisher = Publisher(nc)
        effects = asyncio.create_task(Effects.open(nc, publisher, SUBJECTS))
        await asyncio.sleep(6.0)  # past its request's timeout (nats-py's 5 s)
        assert not effects.done()
        await nats_server.start()
        await asyncio.wait_for(effects, 30)
        await publisher.close()
    finally:
        await nc.close()
