"""MCP servers served through a pool: a project-written MCPServer over stdio and over
streamable HTTP, and mcp-server-time from PyPI."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from loopmesh.ports import free_port
from schemas import safe_token
from schemas.events import ToolErrorEvent
from tool_worker import Registry
from tool_worker.mcp import McpServer, McpServerSettings

from .harness import EventLog, Requester, running

DEMO = Path(__file__).parent / "mcp_servers" / "demo.py"


def stdio_demo(**kw: object) -> McpServerSettings:
    return McpServerSettings(name="demo", command=sys.executable, args=(str(DEMO), "stdio"), **kw)  # type: ignore[arg-type]


def changed(registry: Registry) -> asyncio.Event:
    event = asyncio.Event()
    registry.on_change(event.set)
    return event


async def test_a_stdio_mcp_server_serves_its_tools_through_the_pool(
    nc: Client, requester: Requester, events: EventLog
) -> None:
    registry = Registry()
    server = McpServer(stdio_demo(), registry)
    async with running(nc, registry, mcp=[server]):
        ok = await requester.call("demo", "add", {"a": 2, "b": 3})
        failed = await requester.call("demo", "fail", {"reason": "it must"})
        bad = await requester.call("demo", "add", {"a": "two", "b": 3})
        event = await events.wait_for(lambda e: getattr(e, "call_id", None) == failed.call_id)
    assert (ok.status, ok.content) == ("ok", "5")
    assert failed.error is not None and failed.error.code == "mcp_error"
    assert "failed because it must" in failed.error.message
    assert isinstance(event, ToolErrorEvent) and event.code == "mcp_error"
    assert bad.error is not None and bad.error.code == "invalid_arguments"


async def test_listing_follows_pages_and_maps_names_that_are_not_tokens(
    nc: Client, requester: Requester
) -> None:
    registry = Registry()
    server = McpServer(stdio_demo(), registry)
    async with running(nc, registry, mcp=[server]):
        token = safe_token("dotted.name")
        result = await requester.call("demo", token, {})
    names = {t.name for t in registry}
    assert {"add", "echo", "fail", "slow", "pid", "grow", token} <= names
    assert {f"page_{i}" for i in range(4)} <= names  # past the first pages of 3
    assert token != "dotted.name" and registry.get("demo", token).title == "dotted.name"
    assert result.content == "dotted ok"


async def test_tools_list_changed_adds_the_new_tool(nc: Client, requester: Requester) -> None:
    registry = Registry()
    server = McpServer(stdio_demo(), registry)
    async with running(nc, registry, mcp=[server]):
        relisted = changed(registry)
        grown = await requester.call("demo", "grow", {"name": "fresh"})
        async with asyncio.timeout(10):
            while ("demo", "fresh") not in registry:
                relisted.clear()
                await relisted.wait()
        fresh = await requester.call("demo", "fresh", {})
    assert grown.content == "added fresh"
    assert fresh.content == "fresh ok"


async def test_killing_the_stdio_server_restarts_it_and_the_next_call_succeeds(
    nc: Client, requester: Requester
) -> None:
    registry = Registry()
    server = McpServer(stdio_demo(), registry)
    async with running(nc, registry, mcp=[server]):
        before = int((await requester.call("demo", "pid", {})).content)
        sent = asyncio.Event()
        call = server._call

        async def spy(*args: Any) -> None:
            sent.set()
            await call(*args)

        server._call = spy  # type: ignore[method-assign]
        req = requester.request("demo", "slow", {"seconds": 30})
        await requester.publish(req)
        async with asyncio.timeout(10):
            await sent.wait()  # the call is on its way to the server
        os.kill(before, signal.SIGKILL)
        lost = await requester.result(req.call_id)
        after = await requester.call("demo", "pid", {})
    assert lost.error is not None and lost.error.code == "unavailable"
    assert after.status == "ok" and int(after.content) != before
    assert server.connects == 2


COOLDOWN_S = 5.0


async def test_repeated_failures_open_the_tools_circuit_breaker(
    nc: Client, requester: Requester
) -> None:
    registry = Registry()
    # the cool-down is also the window in which the 4th and the last call must find the
    # breaker open: generous, so a loaded machine's slow round trip stays inside it
    server = McpServer(stdio_demo(failure_threshold=3, cooldown_s=COOLDOWN_S), registry)
    async with running(nc, registry, mcp=[server]):
        codes = [
            (await requester.call("demo", "fail", {"reason": "x"})).error.code  # type: ignore[union-attr]
            for _ in range(4)
        ]
        other = await requester.call("demo", "echo", {"text": "still fine"})
        await asyncio.sleep(COOLDOWN_S)  # the cool-down under test (opened before `other`)
        trial = await requester.call("demo", "fail", {"reason": "x"})
        reopened = await requester.call("demo", "fail", {"reason": "x"})
    assert codes == ["mcp_error", "mcp_error", "mcp_error", "circuit_open"]
    assert other.content == "still fine"  # the breaker is per tool
    assert trial.error is not None and trial.error.code == "mcp_error"  # half-open: one trial
    assert reopened.error is not None and reopened.error.code == "circuit_open"
    assert "failed 4 times in a row" in reopened.error.message


@pytest.fixture
async def http_demo() -> AsyncIterator[tuple[str, list[asyncio.subprocess.Process]]]:
    """The demo server over streamable HTTP on a free loopback port; the list holds the
    current process (a test may replace it)."""
    port = free_port()
    procs = [await start_http_demo(port)]
    try:
        yield f"http://127.0.0.1:{port}/mcp", procs
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def start_http_demo(port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(DEMO), "http", str(port),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    async with asyncio.timeout(20):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)  # the port is not open yet: nothing to wait on
                continue
            writer.close()
            await writer.wait_closed()
            return proc


async def test_a_streamable_http_mcp_server_serves_tools_and_survives_a_restart(
    nc: Client,
    requester: Requester,
    http_demo: tuple[str, list[asyncio.subprocess.Process]],
) -> None:
    url, procs = http_demo
    registry = Registry()
    settings = McpServerSettings(name="web", url=url, headers={"X-Test": "1"})
    server = McpServer(settings, registry)
    async with running(nc, registry, mcp=[server]):
        first = await requester.call("web", "add", {"a": 20, "b": 22})
        # The server restarts and forgets the session: the worker reconnects.
        procs[0].kill()
        await procs[0].wait()
        procs.append(await start_http_demo(int(url.rsplit(":", 1)[1].split("/")[0])))
        results = [await requester.call("web", "echo", {"text": "again"}) for _ in range(3)]
    assert first.content == "42"
    assert results[-1].status == "ok" and results[-1].content == "again"
    # The call the new server rejected (unknown session) never ran: it is sent again on
    # the new session, so no call fails.
    assert all(r.status == "ok" for r in results), results
    assert server.connects >= 2


async def test_mcp_server_time_from_pypi_serves_through_the_pool(
    nc: Client, requester: Requester
) -> None:
    command = Path(sys.executable).parent / "mcp-server-time"
    registry = Registry()
    server = McpServer(McpServerSettings(name="time", command=str(command)), registry)
    async with running(nc, registry, mcp=[server]):
        result = await requester.call("time", "get_current_time", {"timezone": "Asia/Tokyo"})
        bad = await requester.call("time", "get_current_time", {"timezone": "Mars/Olympus"})
    assert result.status == "ok", result
    assert "Asia/Tokyo" in result.content
    assert bad.error is not None and bad.error.code == "mcp_error"
    assert "Mars/Olympus" in bad.error.message
