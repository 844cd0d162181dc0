"""Every tool is handed the call's deterministic id as an idempotency key: local tools
through their ToolContext, MCP tools in the request's ``_meta``, ``http_fetch`` as an
``Idempotency-Key`` header; a call re-run after its worker was killed carries the same
key, so an idempotent endpoint applies it once."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from schemas import call_id
from tests.conftest import BOTH_SHARED, Durable, durable_nc
from tool_worker import Registry, ToolContext, load_module, to_tool, tool
from tool_worker.builtins import http_fetch_tool
from tool_worker.errors import RegistryError, ToolError
from tool_worker.mcp import McpServer, McpServerSettings

from .harness import Requester, WorkerProcess, running

DEMO = Path(__file__).parent / "mcp_servers" / "demo.py"

# A call re-run after a kill, also on the cluster (R3): its redelivery and effect record.
both = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)


nc = durable_nc()


@pytest.fixture
def replicas(durable: Durable) -> int:
    return durable.replicas


def a_call_id(index: int = 0) -> str:
    return call_id("t1", "s1", "turn1", 2, index)


class Ledger:
    """A loopback HTTP endpoint that applies each ``Idempotency-Key`` once: the first
    request of a key records an effect and (if ``hold``) never answers, as a slow
    endpoint whose caller dies; a repeat of the key is answered from the ledger."""

    def __init__(self, *, hold: bool = False) -> None:
        self.hold = hold
        self.keys: list[str | None] = []  # the key of every request, in order
        self.effects: list[str | None] = []  # one per key applied
        self.port = 0
        self.arrived = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        key = None
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "idempotency-key":
                key = value.strip()
        self.keys.append(key)
        self.arrived.set()
        if key is None or key not in self.effects:
            self.effects.append(key)
            if self.hold and len(self.effects) == 1:
                await reader.read()  # until the caller is gone
                writer.close()
                return
            body = b"applied"
        else:
            body = b"already applied"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()


async def serve(ledger: Ledger) -> AsyncIterator[Ledger]:
    server = await asyncio.start_server(ledger.handle, "127.0.0.1", 0)
    ledger.port = server.sockets[0].getsockname()[1]
    async with server:
        yield ledger


@pytest.fixture
async def ledger() -> AsyncIterator[Ledger]:
    async for served in serve(Ledger()):
        yield served


@pytest.fixture
async def holding_ledger() -> AsyncIterator[Ledger]:
    async for served in serve(Ledger(hold=True)):
        yield served


async def test_a_local_tool_reads_the_call_id_as_its_idempotency_key(
    nc: Client, requester: Requester, tmp_path: Path
) -> None:
    tools = {t.name: t for t in load_module("tests.tool_worker.sample_tools")}
    keyed, maybe = tools["keyed"], tools["maybe_keyed"]
    assert set(keyed.input_schema["properties"]) == {"path", "stall"}  # no ctx for the model
    assert maybe.input_schema["properties"] == {}
    log = tmp_path / "keys.txt"
    async with running(nc, Registry([keyed, maybe])):
        result = await requester.call(
            "local", "keyed", {"path": str(log), "stall": False}, call_id=a_call_id()
        )
        other = await requester.call("local", "maybe_keyed", {}, call_id=a_call_id(1))
    assert result.status == "ok", result.error
    key, attempt, _ = log.read_text().split()
    assert (key, attempt) == (a_call_id(), "1")  # a sync tool, run in a thread, sees it too
    assert other.content == a_call_id(1)
    assert await maybe.invoke({}) == "none"  # outside a worker: no context
    with pytest.raises(ToolError, match="needs a call context"):
        await keyed.invoke({"path": str(log), "stall": False})


def test_a_tool_may_not_take_two_contexts() -> None:
    def twice(a: ToolContext, b: ToolContext | None = None) -> str:
        return ""

    with pytest.raises(RegistryError, match="two ToolContext"):
        to_tool(tool(twice))


async def test_an_mcp_tool_receives_the_key_in_the_request_meta(
    nc: Client, requester: Requester
) -> None:
    registry = Registry()
    settings = McpServerSettings(name="demo", command=sys.executable, args=(str(DEMO), "stdio"))
    server = McpServer(settings, registry)
    async with running(nc, registry, mcp=[server]):
        result = await requester.call(
            "demo", "idempotency_key", {}, call_id=a_call_id(), timeout=30
        )
        unkeyed = await server.call("idempotency_key", {})  # no key: no _meta entry
    assert (result.status, result.content) == ("ok", a_call_id())
    assert unkeyed == "none"


async def test_http_fetch_sends_the_key_as_an_idempotency_key_header(
    nc: Client, requester: Requester, ledger: Ledger
) -> None:
    fetch = http_fetch_tool(allowlist=("127.0.0.1",))
    url = f"http://127.0.0.1:{ledger.port}/transfer"
    async with running(nc, Registry([fetch])):
        first = await requester.call("local", "http_fetch", {"url": url}, call_id=a_call_id())
        again = await requester.call("local", "http_fetch", {"url": url}, call_id=a_call_id(1))
    assert first.status == "ok" and again.status == "ok", (first.error, again.error)
    assert ledger.keys == [a_call_id(), a_call_id(1)]
    assert msgspec.json.decode(first.content)["content"] == "applied"


@pytest.mark.slow
@both
async def test_a_call_rerun_after_its_worker_is_killed_carries_the_same_key(
    durable: Durable,
    js: JetStreamContext,
    requester: Requester,
    holding_ledger: Ledger,
) -> None:
    env = {
        "LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2",
        "LOOPMESH_TOOL_WORKER__BUILTINS": "http_fetch",
        "LOOPMESH_TOOL_WORKER__HTTP_ALLOWLIST": "127.0.0.1",
    }

    def worker() -> WorkerProcess:
        return WorkerProcess(durable.url, "--no-provision", env=env)

    first, second = await worker().start(), worker()
    url = f"http://127.0.0.1:{holding_ledger.port}/transfer"
    try:
        await first.ready()
        req = requester.request("local", "http_fetch", {"url": url}, call_id=a_call_id())
        await requester.publish(req)
        async with asyncio.timeout(30):
            await holding_ledger.arrived.wait()  # the call is in flight at the endpoint
        first.kill()
        assert await first.wait() == -9
        await second.start()
        await second.ready()
        result = await requester.result(req.call_id, timeout=30)  # after AckWait (2 s)
    finally:
        await first.stop()
        second.terminate()
        await second.wait()
    assert result.status == "ok", result.error
    assert result.worker.endswith(f"-{second.pid}")
    assert holding_ledger.keys == [a_call_id(), a_call_id()]  # run twice, the same key
    assert holding_ledger.effects == [a_call_id()]  # applied once
    assert msgspec.json.decode(result.content)["content"] == "already applied"


@pytest.mark.slow
@both
async def test_a_local_tool_rerun_after_a_kill_sees_the_same_key_on_its_second_attempt(
    durable: Durable, js: JetStreamContext, requester: Requester, tmp_path: Path
) -> None:
    env = {"LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2", "LOOPMESH_TOOL_WORKER__BUILTINS": "calculator"}

    def worker() -> WorkerProcess:
        args = ("--module", "tests.tool_worker.sample_tools", "--no-provision")
        return WorkerProcess(durable.url, *args, env=env)

    first, second = await worker().start(), worker()
    log = tmp_path / "keys.txt"
    try:
        await first.ready()
        req = requester.request(
            "local", "keyed", {"path": str(log), "stall": True}, call_id=a_call_id()
        )
        await requester.publish(req)
        await first.wait_for_line("keyed: stalling")
        first.kill()
        assert await first.wait() == -9
        await second.start()
        await second.ready()
        result = await requester.result(req.call_id, timeout=30)
    finally:
        await first.stop()
        second.terminate()
        await second.wait()
    assert result.status == "ok", result.error
    (key1, attempt1, pid1), (key2, attempt2, pid2) = [
        line.split() for line in log.read_text().splitlines()
    ]
    assert key1 == key2 == a_call_id()  # the same key on both runs
    assert (attempt1, pid1, pid2) == ("1", str(first.pid), str(second.pid))
    assert int(attempt2) >= 2  # a redelivery (the dead worker's pull may have counted one)
