"""The named agents as MCP tools at ``/mcp``: the ``mcp`` SDK's own client over
streamable HTTP, against the real gateway, a real nats-server and a real loop worker and
tool worker (in-process services) with the fake OpenAI server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.server import GatewayServer
from loopmesh.agents import apply_agents
from loopmesh.testing.durable import ROOT, SUBJECTS, Proc, stream_events
from loopmesh.testing.fake_replies import error, tool_calls
from schemas import AgentSpec
from schemas.agents import default_agent
from schemas.events import LoopEnd, LoopStart
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, GatewayFactory, auth
from tests.loop_worker.durable import Mesh, Watch, count_task, mesh_on

COUNTER = AgentSpec(
    name="counter",
    description="Counts with the count tool.",
    instructions="You count.",
    tools=("local.count",),
)
DEFAULT_DESCRIPTION = default_agent().description
ECHOER = AgentSpec(name="echoer", description="Says things back.", tools=("local.echo",))


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_url, provisioned=True, workers=True) as mesh:
        await apply_agents(mesh.nc.jetstream(), SUBJECTS, [COUNTER])
        book = mesh.running[-1].service.agents  # the loop worker's live view of them
        assert await book.wait_for(lambda b: b.get("counter") is not None, 10)
        yield mesh


@pytest.fixture
def abandoned_connections() -> Iterator[None]:
    """For a test that drops a call mid-stream (a cancel, a gateway stopping): after its
    gateway and mesh are gone, collect the connection objects the drop left, where an
    unclosed transport or socket is expected. Left to a later test's garbage collection, its
    ``ResourceWarning`` fails that test instead (seen once in CI on the floor's uvicorn
    0.31 and starlette 0.45). Request it first, so that its teardown runs last."""
    yield
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "unclosed", ResourceWarning)
        gc.collect()


@contextlib.asynccontextmanager
async def connected(
    gw: GatewayServer, key: str | None = ACME_KEY, **kw: Any
) -> AsyncIterator[Client]:
    """The SDK's client on the gateway's ``/mcp``, sending ``key`` as the bearer."""
    headers = auth(key) if key is not None else {}
    timeout = httpx2.Timeout(30.0, read=300.0)
    async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
        transport = streamable_http_client(f"{gw.url}/mcp", http_client=http)
        async with Client(transport, **kw) as client:
            yield client


class Progress:
    """A progress callback that keeps what it was told and says when a message came."""

    def __init__(self) -> None:
        self.got: list[tuple[float, float | None, str | None]] = []
        self._changed = asyncio.Condition()

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        async with self._changed:
            self.got.append((progress, total, message))
            self._changed.notify_all()

    @property
    def messages(self) -> list[str | None]:
        return [m for _, _, m in self.got]

    async def wait(self, message: str, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: message in self.messages)


async def test_the_agents_are_tools_and_a_call_runs_a_turn_with_progress_to_its_answer(
    mesh: Mesh, gateway: GatewayServer, client: httpx.AsyncClient, tmp_path: Path
):
    async with connected(gateway) as mcp:
        assert mcp.protocol_version == "2026-07-28"  # the SDK's default: stateless
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
        assert list(tools) == ["default", "counter"]
        counter = tools["counter"]
        assert counter.description == COUNTER.description
        assert counter.input_schema["required"] == ["input"]
        assert set(counter.input_schema["properties"]) == {"input", "session"}
        assert counter.output_schema is not None

        progress = Progress()
        task = count_task(tmp_path / "n", "a")
        result = await mcp.call_tool("counter", {"input": task}, progress_callback=progress)
        assert not result.is_error, result
        [text] = result.content
        assert text.type == "text" and text.text == "done: counted a"
        answer = result.structured_content
        assert answer is not None
        assert answer["answer"] == "done: counted a" and answer["reason"] == "task_completion"
        assert answer["agent"] == "counter" and answer["iterations"] == 2
        assert (tmp_path / "n").read_text() == "a\n"
        # the turn's iterations and tool calls, as they happened, counted up
        assert progress.messages == ["iteration 1 of 6", "calling local.count", "iteration 2 of 6"]
        assert [p for p, _, _ in progress.got] == [1, 2, 3]

        # a turn of the agent like any other, in the key's tenant
        session = answer["session"]
        [start] = await _stored(mesh, "acme", session, LoopStart)
        assert (start.turn_id, start.agent) == (answer["turn_id"], "counter")

        # `session` continues the conversation
        again = await mcp.call_tool(
            "counter", {"input": count_task(tmp_path / "n", "b"), "session": session}
        )
        assert not again.is_error and again.structured_content is not None
        assert again.structured_content["session"] == session
        view = (await client.get(f"/v1/sessions/{session}")).json()
        assert view["agent"] == "counter" and view["turns"] == 2

        # the list is live: an agent defined now is a tool now
        await apply_agents(mesh.nc.jetstream(), SUBJECTS, [COUNTER, ECHOER])
        listed = [t.name for t in (await mcp.list_tools()).tools]
        assert listed == ["default", "counter", "echoer"]


async def _stored(mesh: Mesh, tenant: str, session: str, type_: type) -> list[Any]:
    """The session's stored events of ``type_``."""
    events = await stream_events(mesh.nc, tenant, session)
    return [e for e, _ in events if isinstance(e, type_)]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_cancelled_call_cancels_its_turn(
    abandoned_connections: None, mode: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    """A 2026-07-28 client cancels by closing the call's response stream (the SDK's
    client does so for its ``notifications/cancelled``); a handshake-era client's
    posted ``notifications/cancelled`` cannot reach a stateless server's call, and
    closing its connection cancels the turn."""
    progress = Progress()
    task = count_task(tmp_path / "n", seconds=10.0)
    async with Watch(mesh.nc, "acme", "m1") as watch:
        async with connected(gateway, mode=mode) as mcp:
            async with anyio.create_task_group() as tg:
                call = {"input": task, "session": "m1"}
                tg.start_soon(lambda: mcp.call_tool("counter", call, progress_callback=progress))
                await progress.wait("calling local.count")
                tg.cancel_scope.cancel()  # the call
            if mode == "auto":
                end = await watch.wait("loop_end", timeout=20)  # the client still open
        end = await watch.wait("loop_end", timeout=20)
    assert isinstance(end, LoopEnd) and end.reason == "cancelled", end
    assert (tmp_path / "n").read_text() == "a\n"  # the tool ran once, and the turn stopped


async def test_a_gateway_that_stops_leaves_the_turns_of_its_calls_running(
    abandoned_connections: None, mesh: Mesh, gateway_at: GatewayFactory, tmp_path: Path
):
    progress = Progress()
    task = count_task(tmp_path / "n", seconds=4.0)  # past uvicorn's 2 s of grace
    async with Watch(mesh.nc, "acme", "m1") as watch:
        async with gateway_at() as gw, connected(gw) as mcp:
            call = {"input": task, "session": "m1"}
            caller = asyncio.create_task(mcp.call_tool("counter", call, progress_callback=progress))
            await progress.wait("calling local.count")
            await gw.close()  # a replica stops (a deploy): its calls end with it
            with pytest.raises(Exception):  # noqa: B017 - the connection went away
                await caller
        end = await watch.wait("loop_end", timeout=20)
    assert isinstance(end, LoopEnd) and end.reason == "task_completion", end


async def test_a_turn_that_fails_is_an_error_result_with_its_reason(
    mesh: Mesh, gateway: GatewayServer
):
    assert mesh.fake is not None
    mesh.fake.script(error(400, "the model refuses"))
    async with connected(gateway) as mcp:
        result = await mcp.call_tool("counter", {"input": "count to 3"})
    assert result.is_error
    [text] = result.content
    assert text.type == "text" and text.text.startswith("the turn ended with llm_failed: ")
    assert "the model refuses" in text.text
    assert result.structured_content is not None
    assert result.structured_content["reason"] == "llm_failed"


async def test_bad_calls_are_refused_saying_what_was_wrong(
    mesh: Mesh, gateway: GatewayServer, client: httpx.AsyncClient
):
    async with connected(gateway) as mcp:
        await mcp.list_tools()
        with pytest.raises(MCPError) as refused:
            await mcp.call_tool("nobody", {"input": "hi"})
        assert refused.value.error.code == -32602
        assert "unknown tool 'nobody'" in refused.value.error.message

        async def refusal(arguments: dict[str, Any], tool: str = "counter") -> str:
            result = await mcp.call_tool(tool, arguments)
            assert result.is_error, result
            [text] = result.content
            assert text.type == "text"
            return text.text

        assert "missing required field `input`" in await refusal({})
        assert "(field `input`)" in await refusal({})
        assert "`input` must not be empty (field `input`)" in await refusal({"input": "  "})
        assert "(field `session`)" in await refusal({"input": "hi", "session": "no.way"})
        assert "unknown field `colour`" in await refusal({"input": "hi", "colour": "red"})
        r = await client.post("/v1/sessions", json={"session": "c1", "agent": "counter"})
        assert r.status_code == 201
        mismatch = await refusal({"input": "hi", "session": "c1"}, tool="default")
        assert "session 'c1' belongs to agent 'counter'" in mismatch
    # none of them made a session or ran a turn
    [c1] = (await client.get("/v1/sessions")).json()["sessions"]
    assert c1["session"] == "c1" and c1["turns"] == 0


async def test_the_key_decides_the_tenant_and_no_key_gets_nothing(
    mesh: Mesh, gateway: GatewayServer, client: httpx.AsyncClient
):
    async with connected(gateway) as mcp:
        first = await mcp.call_tool("counter", {"input": "hello", "session": "s1"})
    assert not first.is_error
    # another tenant naming the same session reaches its own, not acme's
    async with connected(gateway, GLOBEX_KEY) as mcp:
        other = await mcp.call_tool("counter", {"input": "hello", "session": "s1"})
    assert not other.is_error
    assert first.structured_content is not None and other.structured_content is not None
    [acme] = await _stored(mesh, "acme", "s1", LoopStart)
    [globex] = await _stored(mesh, "globex", "s1", LoopStart)
    assert acme.turn_id == first.structured_content["turn_id"]
    assert globex.turn_id == other.structured_content["turn_id"]
    assert (await client.get("/v1/sessions/s1")).json()["turns"] == 1

    for key, why in ((None, "missing API key"), ("not-a-key", "unknown API key")):
        with pytest.raises(BaseExceptionGroup) as refused:  # the SDK's task groups'
            async with connected(gateway, key) as mcp:
                await mcp.list_tools()
        [error] = _leaves(refused.value)
        assert isinstance(error, MCPError) and why in error.error.message, error
    # what an HTTP client sees: 401, with a JSON-RPC error saying why
    async with httpx.AsyncClient(base_url=gateway.url) as bare:
        r = await bare.post("/mcp", json=_LIST, headers=_ACCEPT)
        # stateless: no stream to open, no session to end
        for method in ("GET", "DELETE"):
            answer = await bare.request(method, "/mcp", headers={**_ACCEPT, **auth(ACME_KEY)})
            assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": -32600,
            "message": "missing API key: send `Authorization: Bearer <key>`",
            "data": {"code": "unauthorized"},
        },
    }


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


_LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
_ACCEPT = {"Accept": "application/json, text/event-stream"}


async def test_without_keys_only_a_loopback_host_reaches_the_agents(gateway_at: GatewayFactory):
    async with gateway_at(no_auth=True) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        headers = {**_ACCEPT, "MCP-Protocol-Version": "2026-07-28"}
        rebound = await c.post("/mcp", json=_LIST, headers={**headers, "Host": "evil.example"})
        assert rebound.status_code == 421, rebound.text
        from_page = await c.post(
            "/mcp", json=_LIST, headers={**headers, "Origin": "http://evil.example"}
        )
        assert from_page.status_code == 403, from_page.text
    async with gateway_at(no_auth=True) as gw, connected(gw, None) as mcp:
        assert [t.name for t in (await mcp.list_tools()).tools] == ["default"]


async def test_the_example_lists_the_agents_and_calls_one_as_the_docs_show(
    mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    url = f"{gateway.url}/mcp"

    async def example(*args: str) -> list[str]:
        proc = Proc(
            str(ROOT / "examples" / "mcp_call.py"), "--url", url, *args,
            env={"LOOPMESH_API_KEY": ACME_KEY},
        )  # fmt: skip
        await proc.start()
        assert proc.proc is not None
        assert await asyncio.wait_for(proc.proc.wait(), 60) == 0, proc.output()
        await proc.close()
        return proc.lines

    assert await example() == ["default: " + DEFAULT_DESCRIPTION, f"counter: {COUNTER.description}"]
    lines = await example("counter", count_task(tmp_path / "n", "a"))
    assert lines[:3] == ["  … iteration 1 of 6", "  … calling local.count", "  … iteration 2 of 6"]
    assert lines[3] == "done: counted a"
    assert lines[4].startswith("session: ") and lines[4].endswith(" (task_completion)")
    session = lines[4].split()[1]
    again = await example("counter", count_task(tmp_path / "n", "b"), "--session", session)
    assert again[-1] == f"session: {session} (task_completion)"
    assert (tmp_path / "n").read_text() == "a\nb\n"


async def test_the_python_snippet_in_the_agents_doc_works(
    mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    calc = AgentSpec(name="calc", description="Does arithmetic.")
    await apply_agents(mesh.nc.jetstream(), SUBJECTS, [COUNTER, calc])
    assert await mesh.running[-1].service.agents.wait_for(lambda b: b.get("calc"), 10)
    assert mesh.fake is not None
    mesh.fake.script(
        tool_calls(("task_completion", {"result": "17 * 23 = 391"})),
        tool_calls(("task_completion", {"result": "391 / 2 = 195.5"})),
    )
    doc = (ROOT / "docs" / "AGENTS.md").read_text()
    snippet = doc.split("**From Python**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "snippet.py"
    script.write_text(
        snippet.replace("http://127.0.0.1:8080/mcp", f"{gateway.url}/mcp").replace(
            "<key>", ACME_KEY
        )
    )
    proc = Proc(str(script))
    await proc.start()
    assert proc.proc is not None
    assert await asyncio.wait_for(proc.proc.wait(), 60) == 0, proc.output()
    await proc.close()
    assert proc.lines == [
        "['default', 'calc', 'counter']",
        "… iteration 1 of 6",
        "17 * 23 = 391",
        "391 / 2 = 195.5",
    ]
