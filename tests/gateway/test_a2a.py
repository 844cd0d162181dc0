"""A2A through the gateway with the official ``a2a-sdk`` client, on real servers: a
nats-server, gateways on real ports, a real loop worker and tool worker, and the fake
OpenAI server. The task store and the re-subscription are JetStream's, so a gateway
that goes away takes nothing with it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from a2a.client import A2ACardResolver
from a2a.client import Client as A2AClient
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import (
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from nats.aio.client import Client

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loop_worker.engine.settings import LoopSettings
from loopmesh.agents import apply_agents
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import SUBJECTS, wait_for
from loopmesh.testing.fake_replies import hang, text, tool_calls
from schemas import AgentSpec
from schemas.events import LoopEnd
from tests.conftest import Durable
from tests.gateway.a2a_client import (
    Followed,
    a2a_client,
    answer,
    follow,
    message,
    resolve_card,
)
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, KEYS, GatewayFactory, auth
from tests.loop_worker.durable import Mesh, Watch, count_task, mesh_on

CALC = AgentSpec(name="calc", description="Does arithmetic with the calculator tool.")
ANSWER = "The answer is forty-two, as computed with care."


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    """Workers whose loop takes a reply without a tool call as the answer once it has
    reminded the model once (so the reply streamed first is retracted)."""
    async with mesh_on(nats_url, provisioned=True) as mesh:
        await mesh.tool_worker()
        await mesh.loop_worker(loop=LoopSettings(max_iterations=6, max_no_tool_reminders=1))
        yield mesh


def rpc(method: str, params: dict, id_: int = 1) -> dict:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}


V1 = {"A2A-Version": "1.0"}


# -- cards ---------------------------------------------------------------------------


async def test_the_client_resolves_the_default_agents_card_and_a_named_agents(
    gateway_at: GatewayFactory, nc: Client
):
    await apply_agents(nc.jetstream(), SUBJECTS, [CALC])
    async with gateway_at() as gw:
        card = await resolve_card(gw.url)  # a card needs no key
        assert card.name == "default"
        [iface] = card.supported_interfaces
        assert (iface.url, iface.protocol_binding) == (f"{gw.url}/a2a/default", "JSONRPC")
        assert iface.protocol_version == "1.0"
        assert card.capabilities.streaming and card.capabilities.push_notifications
        assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
        assert list(card.security_requirements[0].schemes) == ["bearer"]

        card = await resolve_card(f"{gw.url}/a2a/calc")
        assert (card.name, card.description) == ("calc", CALC.description)
        assert card.supported_interfaces[0].url == f"{gw.url}/a2a/calc"
        assert card.skills[0].id == "calc" and int(card.version) > 0  # the revision

        async with httpx.AsyncClient(base_url=gw.url) as http:
            r = await http.get("/a2a/nobody/.well-known/agent-card.json")
            assert r.status_code == 404 and "no agent 'nobody'" in r.text
            r = await http.get("/a2a/no.way/.well-known/agent-card.json")
            assert r.status_code == 422
    async with gateway_at(no_auth=True, public_url="https://agents.example.com/mesh") as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            card = (await http.get("/.well-known/agent-card.json")).json()
        assert (
            card["supportedInterfaces"][0]["url"] == "https://agents.example.com/mesh/a2a/default"
        )
        assert "securitySchemes" not in card  # no keys, none to ask for


async def test_a_forged_host_header_never_reaches_the_card(gateway_at: GatewayFactory):
    forged = {"Host": "evil.example.com", "X-Forwarded-Proto": "https",
              "X-Forwarded-Host": "evil.example.com"}  # fmt: skip
    async with gateway_at() as gw, httpx.AsyncClient(headers=forged) as http:
        card = await A2ACardResolver(http, gw.url).get_agent_card()
        assert card.supported_interfaces[0].url == f"{gw.url}/a2a/default"
        card = await A2ACardResolver(http, f"{gw.url}/a2a/default").get_agent_card()
        assert card.supported_interfaces[0].url == f"{gw.url}/a2a/default"


# -- a task is a turn ------------------------------------------------------------------


async def test_a_message_streams_its_task_to_the_answer_through_a_real_loop_worker(
    mesh: Mesh, gateway_at: GatewayFactory
):
    assert mesh.fake is not None
    reply = text(ANSWER, chunk_size=6)
    mesh.fake.script(reply, reply)  # the first is retracted by the loop's reminder
    async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY) as client:
        got = await follow(client.send_message(message("What is six times seven?")))
        assert got.state == TaskState.TASK_STATE_COMPLETED
        kinds = got.kinds
        assert kinds[0] == "task" and kinds[1] == "status_update" and kinds[-1] == "status_update"
        chunks = [e.artifact_update for e in got.events if e.HasField("artifact_update")]
        assert any(c.append for c in chunks), "the reply streamed in chunks"
        assert chunks[-1].last_chunk and got.streamed_text() == ANSWER
        first = got.events[0].task
        assert first.status.state == TaskState.TASK_STATE_SUBMITTED
        assert got.events[1].status_update.status.state == TaskState.TASK_STATE_WORKING

        task = await client.get_task(GetTaskRequest(id=got.task_id))
        assert task.status.state == TaskState.TASK_STATE_COMPLETED
        assert answer(task) == ANSWER
        assert [p.text for p in task.history[0].parts] == ["What is six times seven?"]
        # the task is a turn of the context's session, for the loop worker and /v1 alike
        meta = task.metadata["loopmesh"]
        assert (meta["turn"], meta["session"], meta["agent"]) == (
            task.id,
            task.context_id,
            "default",
        )
    prompt = json.dumps(mesh.fake.requests[0]["messages"])
    assert "What is six times seven?" in prompt
    async with (
        gateway_at() as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY)) as http,
    ):
        session = (await http.get(f"/v1/sessions/{task.context_id}")).json()
    assert session["turns"] == 1 and session["agent"] == "default"


async def test_a_task_is_read_again_after_the_gateway_restarts(
    mesh: Mesh, gateway_at: GatewayFactory, tmp_path: Path
):
    async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY) as client:
        got = await follow(client.send_message(message(count_task(tmp_path / "n"))))
        assert got.state == TaskState.TASK_STATE_COMPLETED
        before = await client.get_task(GetTaskRequest(id=got.task_id))
    async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY) as client:  # a new gateway
        after = await client.get_task(GetTaskRequest(id=got.task_id))
        assert after == before
        assert answer(after).startswith("done: ")
        listed = await client.list_tasks(ListTasksRequest())
        assert [t.id for t in listed.tasks] == [got.task_id]
        with pytest.raises(UnsupportedOperationError, match="terminal state"):
            await follow(client.subscribe(SubscribeToTaskRequest(id=got.task_id)))
    assert (tmp_path / "n").read_text() == "a\n"


async def test_a_task_whose_gateway_goes_away_mid_turn_is_resubscribed_on_a_new_one(
    mesh: Mesh, gateway_at: GatewayFactory, nc: Client, tmp_path: Path
):
    await went_away_mid_turn(gateway_at, nc, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("durable", ["cluster"], indirect=True)
async def test_on_a_cluster_a_task_whose_gateway_goes_away_is_resubscribed(
    durable: Durable, tmp_path: Path
):
    async with mesh_on(durable.url, replicas=3) as mesh:
        await mesh.tool_worker()
        await mesh.loop_worker()

        def gateway_at(**settings: Any) -> GatewayServer:
            nats = NatsSettings(url=durable.url, reconnect_wait_s=0.05, replicas=3)
            gateway = GatewaySettings(port=0, api_keys=KEYS, **settings)
            return GatewayServer(GatewayConfig(nats=nats, gateway=gateway))

        await went_away_mid_turn(gateway_at, mesh.nc, tmp_path)


async def went_away_mid_turn(gateway_at: GatewayFactory, nc: Client, tmp_path: Path) -> None:
    """A task's gateway closes while its tool runs; a new gateway re-subscribes the
    client to the task, which ends completed, and stores it so."""
    task_text = count_task(tmp_path / "n", seconds=2.0)
    first = gateway_at()
    await first.__aenter__()
    try:
        async with Watch(nc, "acme", "c1") as watch, a2a_client(first.url, ACME_KEY) as client:
            stream = client.send_message(message(task_text, context_id="c1"))
            got = await follow(stream, until=frozenset({TaskState.TASK_STATE_WORKING}))
            await watch.wait("tool_call", got.task_id)  # the tool runs: 2 s
            await first.close()  # the gateway goes away; the turn goes on
            await follow(stream, got)  # the stream ends before the task does
            assert got.state == TaskState.TASK_STATE_WORKING
    finally:
        await first.close()
    async with gateway_at(a2a_repair_after_s=0) as gw, a2a_client(gw.url, ACME_KEY) as client:
        again = await follow(client.subscribe(SubscribeToTaskRequest(id=got.task_id)))
        assert again.kinds[0] == "task"
        assert again.events[0].task.status.state == TaskState.TASK_STATE_WORKING
        assert again.state == TaskState.TASK_STATE_COMPLETED
        task = await client.get_task(GetTaskRequest(id=got.task_id))
        assert task.status.state == TaskState.TASK_STATE_COMPLETED
        assert answer(task).startswith("done: ")
    # the tool ran once, and the task as stored caught up with its turn
    assert (tmp_path / "n").read_text() == "a\n"
    bucket = await nc.jetstream().key_value(SUBJECTS.a2a_tasks_bucket)

    async def stored_completed() -> bool:  # a follower of a cluster may answer a moment late
        entry = await bucket.get(f"acme.{got.task_id}")
        return msgspec.json.decode(entry.value)["task"]["status"]["state"] == "TASK_STATE_COMPLETED"

    await wait_for(stored_completed, what="the task stored completed")


# -- cancel ------------------------------------------------------------------------------


async def cancel_while_thinking(
    mesh: Mesh, nc: Client, client: A2AClient, canceller: A2AClient
) -> Followed:
    """Start a task whose model thinks until the turn is cancelled, cancel it through
    ``canceller``, and check that the turn ended cancelled; the task's stream, to its end."""
    assert mesh.fake is not None
    mesh.fake.script(hang(60))
    async with Watch(nc, "acme", "c1") as watch:
        stream = client.send_message(message("Think it over.", context_id="c1"))
        got = await follow(stream, until=frozenset({TaskState.TASK_STATE_WORKING}))
        await watch.wait("llm_request", got.task_id)
        cancelled = await canceller.cancel_task(CancelTaskRequest(id=got.task_id))
        assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
        end = await watch.wait("loop_end", got.task_id)
        assert isinstance(end, LoopEnd) and end.reason == "cancelled"
    await follow(stream, got)  # the task's stream ends with its turn
    assert got.state == TaskState.TASK_STATE_CANCELED
    return got


async def test_cancel_ends_the_running_turn_cancelled(
    mesh: Mesh, gateway_at: GatewayFactory, nc: Client
):
    async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY) as client:
        got = await cancel_while_thinking(mesh, nc, client, client)
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(CancelTaskRequest(id=got.task_id))


async def test_a_cancel_sent_to_another_gateway_cancels_the_turn(
    mesh: Mesh, gateway_at: GatewayFactory, nc: Client
):
    async with (
        gateway_at() as one,
        gateway_at() as other,
        a2a_client(one.url, ACME_KEY) as client,
        a2a_client(other.url, ACME_KEY) as elsewhere,
    ):
        await cancel_while_thinking(mesh, nc, client, elsewhere)


# -- a question, and its answer ---------------------------------------------------------


async def test_a_question_asks_for_input_and_the_answer_continues_the_task(
    mesh: Mesh, gateway_at: GatewayFactory
):
    assert mesh.fake is not None
    mesh.fake.script(tool_calls(("ask_question", {"question": "Metres or feet?"})))
    async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY) as client:
        got = await follow(client.send_message(message("How tall is it?", context_id="c2")))
        assert got.state == TaskState.TASK_STATE_INPUT_REQUIRED
        asked = got.events[-1].status_update.status.message
        assert [p.text for p in asked.parts] == ["Metres or feet?"]
        more = await follow(
            client.send_message(message("Metres.", context_id="c2", task_id=got.task_id))
        )
        assert more.task_id == got.task_id
        assert more.state == TaskState.TASK_STATE_COMPLETED
        task = await client.get_task(GetTaskRequest(id=got.task_id))
        said = [(m.role, m.parts[0].text) for m in task.history]
        assert said[0][1] == "How tall is it?" and said[-1][1] == "Metres."
        assert "Metres or feet?" in [t for _, t in said]
        assert answer(task).startswith("done: ")
        assert task.metadata["loopmesh"]["turn"] != task.id  # the task's second turn
    assert "Metres." in json.dumps(mesh.fake.requests[-1]["messages"])


# -- tenants, lists, errors ------------------------------------------------------------


async def test_tasks_are_listed_and_another_tenants_key_never_sees_them(
    mesh: Mesh, gateway_at: GatewayFactory
):
    async with gateway_at() as gw, a2a_client(gw.url, ACME_KEY, streaming=False) as acme:
        ids = []
        for i, context in enumerate(("c1", "c1", "c2")):
            got = await follow(acme.send_message(message(f"say {i}", context_id=context)))
            assert got.state == TaskState.TASK_STATE_COMPLETED
            ids.append(got.task_id)
        listed = await acme.list_tasks(ListTasksRequest())
        assert [t.id for t in listed.tasks] == ids[::-1]  # newest first
        assert listed.total_size == 3 and listed.tasks[0].artifacts == []  # none asked for
        page = await acme.list_tasks(ListTasksRequest(page_size=2, include_artifacts=True))
        assert [t.id for t in page.tasks] == ids[:0:-1] and answer(page.tasks[0])
        rest = await acme.list_tasks(ListTasksRequest(page_size=2, page_token=page.next_page_token))
        assert [t.id for t in rest.tasks] == ids[:1] and not rest.next_page_token
        in_c1 = await acme.list_tasks(ListTasksRequest(context_id="c1"))
        assert [t.id for t in in_c1.tasks] == ids[1::-1]

        async with a2a_client(gw.url, GLOBEX_KEY) as globex:
            assert list((await globex.list_tasks(ListTasksRequest())).tasks) == []
            with pytest.raises(TaskNotFoundError):
                await globex.get_task(GetTaskRequest(id=ids[0]))
            with pytest.raises(TaskNotFoundError):
                await globex.cancel_task(CancelTaskRequest(id=ids[0]))
            with pytest.raises(TaskNotFoundError):
                await follow(globex.subscribe(SubscribeToTaskRequest(id=ids[0])))
            with pytest.raises(TaskNotFoundError):  # nor continue it
                await follow(globex.send_message(message("mine now", task_id=ids[0])))
        async with httpx.AsyncClient(base_url=gw.url, headers=V1) as http:
            get = rpc("GetTask", {"id": ids[0]})
            r = await http.post("/a2a/default", json=get)  # no key, no task
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            r = await http.post("/a2a/default", json=get, headers=auth("wrong"))
            assert r.status_code == 401
            r = await http.post("/a2a/calc", json=get, headers=auth(ACME_KEY))
            assert r.status_code == 404  # nobody defined calc here
            r = await http.post(
                "/a2a/default", json=rpc("GetTask", {"id": ids[0], "tenant": "globex"}),
                headers=auth(ACME_KEY),
            )  # fmt: skip
            assert r.json()["error"]["code"] == -32602 and "tenant" in r.json()["error"]["message"]


async def test_bad_requests_get_the_protocols_errors(gateway_at: GatewayFactory, nc: Client):
    await apply_agents(nc.jetstream(), SUBJECTS, [CALC])
    headers = {**auth(ACME_KEY), **V1}
    async with gateway_at() as gw, httpx.AsyncClient(base_url=gw.url, headers=headers) as http:

        async def error(body: object, agent: str = "default") -> dict:
            r = await http.post(f"/a2a/{agent}", content=json.dumps(body))
            assert r.status_code == 200, r.text
            return r.json()["error"]

        r = await http.post("/a2a/default", content=b"{not json")
        assert r.json()["error"]["code"] == -32700
        assert (await error(rpc("NoSuchMethod", {})))["code"] == -32601
        assert (await error(rpc("GetTask", {"id": "t-nobody"})))["code"] == -32001
        empty = {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "  "}]}}
        e = await error(rpc("SendMessage", empty))
        assert e["code"] == -32602 and "no text" in e["message"]
        no_parts = {"message": {"messageId": "m1", "role": "ROLE_USER"}}
        assert (await error(rpc("SendMessage", no_parts)))["code"] == -32602
        url = {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [
            {"text": "see"}, {"url": "https://example.com/a.pdf", "mediaType": "application/pdf"},
        ]}}  # fmt: skip
        e = await error(rpc("SendMessage", url))
        assert e["code"] == -32602 and "message.parts[1]" in e["message"]
        # a context is a session, and a session belongs to one agent
        r = await http.post("/v1/sessions", json={"session": "s-calc", "agent": "calc"})
        assert r.status_code == 201
        other = {"message": {"messageId": "m1", "role": "ROLE_USER", "contextId": "s-calc",
                             "parts": [{"text": "hi"}]}}  # fmt: skip
        e = await error(rpc("SendMessage", other))
        assert e["code"] == -32602 and "belongs to agent 'calc'" in e["message"]
        big = {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "x" * 10}]}}
        r = await http.post(
            "/a2a/default", content=json.dumps(rpc("SendMessage", big)) + " " * 300_000
        )
        assert r.status_code == 413
        old = await http.post("/a2a/default", json=rpc("GetTask", {"id": "t1"}),
                              headers={"A2A-Version": "0.3"})  # fmt: skip
        assert old.json()["error"]["code"] == -32009  # version not supported


# -- the JavaScript SDK ------------------------------------------------------------------

A2A_JS = Path(__file__).parent / "a2a_js"


async def test_the_javascript_sdk_client_streams_a_task_to_its_answer(
    mesh: Mesh, gateway_at: GatewayFactory
):
    node = shutil.which("node")
    if node is None or not (A2A_JS / "node_modules" / "@a2a-js" / "sdk").is_dir():
        pytest.skip("the @a2a-js/sdk client is not installed: `npm ci` in tests/gateway/a2a_js")
    assert mesh.fake is not None
    reply = text(ANSWER, chunk_size=6)
    mesh.fake.script(reply, reply)
    async with gateway_at() as gw:
        proc = await asyncio.create_subprocess_exec(
            node, "client.mjs", f"{gw.url}/a2a/default/", ACME_KEY, "What is six times seven?",
            cwd=A2A_JS, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    card, events, task = lines[0]["card"], [x["event"] for x in lines[1:-1]], lines[-1]["task"]
    assert card["name"] == "default"
    assert [e["kind"] for e in events[:2]] == ["task", "statusUpdate"]
    streamed = ""
    for e in events:
        if e["kind"] == "artifactUpdate":
            chunk = "".join(p["content"]["value"] for p in e["value"]["artifact"]["parts"])
            streamed = streamed + chunk if e["value"]["append"] else chunk
    assert streamed == ANSWER
    assert events[-1]["value"]["status"]["state"] == TaskState.TASK_STATE_COMPLETED
    assert task["status"]["state"] == TaskState.TASK_STATE_COMPLETED
    [artifact] = task["artifacts"]
    assert artifact["parts"][0]["content"]["value"] == ANSWER
